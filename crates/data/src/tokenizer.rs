//! Tokenizers: [`Tokenizer`], one enum over every tokenizer so corpora and
//! `macrobatch prepare` share one interface; [`TokenizerSpec`], a tokenizer
//! by name (`--tokenizer`); and [`ByteTokenizer`] (one token per UTF-8 byte,
//! vocabulary 256). A new tokenizer is a variant of both enums.

use crate::error::DataError;

/// The model's tokenizer. `Sync`: `prepare` tokenizes chunks in parallel.
#[derive(Debug)]
pub enum Tokenizer {
    /// Bytes as tokens.
    Byte(ByteTokenizer),
}

impl Tokenizer {
    /// For messages.
    pub fn name(&self) -> &str {
        match self {
            Self::Byte(_) => "bytes",
        }
    }

    /// Text to ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Self::Byte(t) => Ok(t.encode(text)),
        }
    }

    /// Ids to text.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Self::Byte(t) => Ok(t.decode(ids)),
        }
    }

    /// Number of ids: every id is below it.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Byte(_) => ByteTokenizer::VOCAB_SIZE,
        }
    }

    /// End-of-sequence id, written between documents (input files) when there is one.
    pub fn eos_id(&self) -> Option<u32> {
        match self {
            Self::Byte(_) => None,
        }
    }
}

/// A tokenizer by name: parse `--tokenizer`, then [`build`](Self::build) it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSpec {
    /// [`ByteTokenizer`].
    Byte,
}

impl TokenizerSpec {
    /// The names [`parse`](Self::parse) accepts, for messages.
    pub const AVAILABLE: &'static [&'static str] = &["byte"];

    /// A tokenizer name (or, for tokenizers made from a file, its path).
    pub fn parse(name: &str) -> Result<Self, DataError> {
        match name {
            "byte" => Ok(TokenizerSpec::Byte),
            _ => Err(DataError::UnknownTokenizer {
                name: name.into(),
                available: Self::AVAILABLE.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "),
            }),
        }
    }

    /// The name [`parse`](Self::parse) reads back (recorded in `meta.json`).
    pub fn name(&self) -> String {
        match self {
            TokenizerSpec::Byte => "byte".into(),
        }
    }

    /// The tokenizer itself (loading whatever files it needs).
    pub fn build(&self) -> Result<Tokenizer, DataError> {
        match self {
            TokenizerSpec::Byte => Ok(Tokenizer::Byte(ByteTokenizer)),
        }
    }
}

/// Byte-level tokenizer (lossless for any text).
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Vocabulary size.
    pub const VOCAB_SIZE: usize = 256;

    /// Text to tokens.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Tokens to text; bytes that are not valid UTF-8 become U+FFFD, tokens
    /// above 255 (possible from a larger model vocabulary) are skipped.
    pub fn decode(&self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens.iter().filter_map(|&t| u8::try_from(t).ok()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_unicode() {
        let t = ByteTokenizer;
        let s = "Call me Ishmael — ἀρχή";
        assert_eq!(t.decode(&t.encode(s)), s);
        assert_eq!(t.encode("A"), vec![65]);
    }

    #[test]
    fn specs_name_what_exists() {
        let spec = TokenizerSpec::parse("byte").unwrap();
        let t = spec.build().unwrap();
        assert_eq!((spec.name(), t.vocab_size(), t.encode("hi").unwrap()), ("byte".to_string(), 256, vec![104, 105]));
        let e = TokenizerSpec::parse("gpt2").unwrap_err().to_string();
        assert!(e.contains("`gpt2`") && e.contains("`byte`"), "{e}");
    }
}
