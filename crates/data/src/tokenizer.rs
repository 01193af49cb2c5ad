//! Tokenizers: the [`Tokenizer`] trait every tokenizer implements, the
//! [`TokenizerSpec`] that names one (`--tokenizer`), and the byte-level
//! tokenizer (one token per UTF-8 byte, vocabulary 256).

use crate::error::DataError;

/// What `macrobatch prepare` (and anything else that tokenizes text) needs
/// of a tokenizer. `Sync` so that chunks are tokenized in parallel.
pub trait Tokenizer: Send + Sync {
    /// The name recorded in `meta.json`.
    fn name(&self) -> String;
    /// Every id it produces is below this.
    fn vocab_size(&self) -> usize;
    /// Text to tokens.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Tokens to text.
    fn decode(&self, tokens: &[u32]) -> String;
    /// A token written after each input file (e.g. an end-of-text token), if any.
    fn document_separator(&self) -> Option<u32> {
        None
    }
}

/// A tokenizer by name: parse `--tokenizer`, then [`build`](Self::build) it.
/// New tokenizers are new variants here and an `impl Tokenizer`.
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

    /// The tokenizer itself (loading whatever files it needs).
    pub fn build(&self) -> Result<Box<dyn Tokenizer>, DataError> {
        match self {
            TokenizerSpec::Byte => Ok(Box::new(ByteTokenizer)),
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

impl Tokenizer for ByteTokenizer {
    fn name(&self) -> String {
        "byte".into()
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        ByteTokenizer::encode(self, text)
    }

    fn decode(&self, tokens: &[u32]) -> String {
        ByteTokenizer::decode(self, tokens)
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
        let t = TokenizerSpec::parse("byte").unwrap().build().unwrap();
        assert_eq!((t.name(), t.vocab_size(), t.encode("hi")), ("byte".to_string(), 256, vec![104, 105]));
        let e = TokenizerSpec::parse("gpt2").unwrap_err().to_string();
        assert!(e.contains("`gpt2`") && e.contains("`byte`"), "{e}");
    }
}
