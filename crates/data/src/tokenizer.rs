//! Tokenizers: [`Tokenizer`], one enum over every tokenizer (bytes, or a
//! byte-level [`BpeTokenizer`]) so corpora, fine-tuning data, generation and
//! `macrobatch prepare` share one interface; [`TokenizerSpec`], a tokenizer
//! by name or path (`--tokenizer`); and [`ByteTokenizer`] (one token per UTF-8
//! byte, vocabulary 256). A new tokenizer is a variant of both enums.

use crate::bpe::{BpeTokenizer, Encoded};
use crate::chat::ChatTemplate;
use crate::error::DataError;
use std::path::{Path, PathBuf};

/// The model's tokenizer. `Sync`: `prepare` tokenizes chunks in parallel.
#[derive(Debug)]
pub enum Tokenizer {
    /// Bytes as tokens.
    Byte(ByteTokenizer),
    /// Byte-level BPE.
    Bpe(Box<BpeTokenizer>),
}

impl Tokenizer {
    /// Writes the files that rebuild it into `dir` (`tokenizer.json` and
    /// `tokenizer_config.json` for BPE; nothing for bytes). Returns whether
    /// it wrote any.
    pub fn save_pretrained(&self, dir: &Path) -> Result<bool, DataError> {
        match self {
            Tokenizer::Byte(_) => Ok(false),
            Tokenizer::Bpe(b) => b.save_pretrained(dir).map(|()| true),
        }
    }

    /// The tokenizer in a GGUF file's metadata.
    pub fn from_gguf(path: &Path) -> Result<Self, DataError> {
        BpeTokenizer::from_gguf(path).map(|t| Self::Bpe(Box::new(t)))
    }

    /// A Hugging Face `tokenizer.json` (with `tokenizer_config.json` beside it, if any).
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, DataError> {
        BpeTokenizer::from_tokenizer_json(path).map(|t| Self::Bpe(Box::new(t)))
    }

    /// GPT-2's tokenizer, bundled.
    pub fn gpt2() -> Result<Self, DataError> {
        BpeTokenizer::gpt2().map(|t| Self::Bpe(Box::new(t)))
    }

    /// For messages.
    pub fn name(&self) -> &str {
        match self {
            Self::Byte(_) => "bytes",
            Self::Bpe(t) => t.name(),
        }
    }

    /// Text to ids with the byte range each came from.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Encoded, DataError> {
        match self {
            Self::Byte(_) => Ok(Encoded {
                ids: text.bytes().map(u32::from).collect(),
                offsets: (0..text.len()).map(|i| (i, i + 1)).collect(),
            }),
            Self::Bpe(t) => t.encode_with_offsets(text),
        }
    }

    /// A rendered chat template to ids with offsets, no BOS / EOS added (see
    /// [`BpeTokenizer::encode_chat`]).
    pub fn encode_chat(&self, rendered: &str) -> Result<Encoded, DataError> {
        match self {
            Self::Byte(_) => self.encode_with_offsets(rendered),
            Self::Bpe(t) => t.encode_chat(rendered),
        }
    }

    /// Text to ids; special tokens only where configured (see [`BpeTokenizer::encode_with_offsets`]).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Self::Byte(t) => Ok(t.encode(text)),
            Self::Bpe(t) => t.encode(text),
        }
    }

    /// The first `n` ids of [`Self::encode`]`(text)` (all of them when there
    /// are fewer), tokenizing only a prefix of a long text: a line of 50 MB
    /// cut to a few thousand positions costs what its first kilobytes do.
    ///
    /// The prefix ends before a whitespace that follows a non-whitespace
    /// character, where the pre-tokenizers we load (byte-level GPT-2 and
    /// Llama 3 patterns, SentencePiece's metaspace) start a new piece, so
    /// the ids before the cut are the whole text's. That is checked, not
    /// assumed: a second prefix half as long again must give the same first
    /// `n` ids, else the whole text is encoded.
    pub fn encode_prefix(&self, text: &str, n: usize) -> Result<Vec<u32>, DataError> {
        // Bytes that surely hold n + 8 tokens for any vocabulary we load
        // (a token of over 16 bytes is rare), doubled while they do not.
        let mut want = n.saturating_add(8).saturating_mul(16).max(4096);
        while want < text.len() {
            let Some(cut) = piece_start_at_or_after(text, want) else { break };
            let ids = self.encode(&text[..cut])?;
            if ids.len() >= n + 8 {
                let check = piece_start_at_or_after(text, cut + cut / 2);
                let again = match check {
                    Some(c) => self.encode(&text[..c])?,
                    None => self.encode(text)?,
                };
                if again.len() >= n && again[..n] == ids[..n] {
                    return Ok(ids[..n].to_vec());
                }
                break;
            }
            want = want.saturating_mul(2);
        }
        let mut ids = self.encode(text)?;
        ids.truncate(n);
        Ok(ids)
    }

    /// Ids to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Self::Byte(t) => Ok(t.decode(ids)),
            Self::Bpe(t) => t.decode(ids),
        }
    }

    /// Number of ids.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Byte(_) => ByteTokenizer::VOCAB_SIZE,
            Self::Bpe(t) => t.vocab_size(),
        }
    }

    /// Beginning-of-sequence id.
    pub fn bos_id(&self) -> Option<u32> {
        match self {
            Self::Byte(_) => None,
            Self::Bpe(t) => t.bos_id(),
        }
    }

    /// End-of-sequence id (also ends an assistant turn in chat data).
    pub fn eos_id(&self) -> Option<u32> {
        match self {
            Self::Byte(_) => None,
            Self::Bpe(t) => t.eos_id(),
        }
    }

    /// Padding id.
    pub fn pad_id(&self) -> Option<u32> {
        match self {
            Self::Byte(_) => None,
            Self::Bpe(t) => t.pad_id(),
        }
    }

    /// The id of a token as the vocabulary spells it (for bytes: a
    /// one-character ASCII string).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Self::Byte(_) => match token.as_bytes() {
                [b] if b.is_ascii() => Some(u32::from(*b)),
                _ => None,
            },
            Self::Bpe(t) => t.token_id(token),
        }
    }

    /// The chat template, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        match self {
            Self::Byte(_) => None,
            Self::Bpe(t) => t.chat_template(),
        }
    }
}

/// A tokenizer by name or path: parse `--tokenizer`, then [`build`](Self::build) it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TokenizerSpec {
    /// [`ByteTokenizer`].
    Byte,
    /// GPT-2's byte-level BPE, bundled ([`BpeTokenizer::gpt2`]).
    Gpt2,
    /// The tokenizer in a GGUF model file's metadata (a path ending in `.gguf`).
    Gguf(PathBuf),
    /// A Hugging Face `tokenizer.json` (a path ending in `.json`), with the
    /// `tokenizer_config.json` beside it if there is one.
    TokenizerJson(PathBuf),
}

impl TryFrom<String> for TokenizerSpec {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        Self::parse(&s).map_err(|e| e.to_string())
    }
}

impl From<TokenizerSpec> for String {
    fn from(t: TokenizerSpec) -> String {
        t.name()
    }
}

impl TokenizerSpec {
    /// What [`parse`](Self::parse) accepts, for messages.
    pub const AVAILABLE: &'static [&'static str] = &["byte", "gpt2", "PATH.gguf", "PATH/tokenizer.json"];

    /// A tokenizer name, or the path of the file it is made from.
    pub fn parse(name: &str) -> Result<Self, DataError> {
        match name {
            "byte" => Ok(TokenizerSpec::Byte),
            "gpt2" => Ok(TokenizerSpec::Gpt2),
            path if path.ends_with(".gguf") => Ok(TokenizerSpec::Gguf(path.into())),
            path if path.ends_with(".json") => Ok(TokenizerSpec::TokenizerJson(path.into())),
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
            TokenizerSpec::Gpt2 => "gpt2".into(),
            TokenizerSpec::Gguf(p) | TokenizerSpec::TokenizerJson(p) => p.display().to_string(),
        }
    }

    /// The tokenizer itself (loading whatever files it needs).
    pub fn build(&self) -> Result<Tokenizer, DataError> {
        match self {
            TokenizerSpec::Byte => Ok(Tokenizer::Byte(ByteTokenizer)),
            TokenizerSpec::Gpt2 => Tokenizer::gpt2(),
            TokenizerSpec::Gguf(p) => Tokenizer::from_gguf(p),
            TokenizerSpec::TokenizerJson(p) => Tokenizer::from_tokenizer_json(p),
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

/// The first byte offset at or after `from` (less than `text.len()`) where
/// a whitespace character follows a non-whitespace one: a place where a
/// word ends, so a prefix cut there keeps every piece before it whole.
fn piece_start_at_or_after(text: &str, from: usize) -> Option<usize> {
    let mut at = from.max(1);
    while at < text.len() && !text.is_char_boundary(at) {
        at += 1;
    }
    let mut prev_ws = text[..at].chars().next_back().is_none_or(char::is_whitespace);
    for (i, c) in text[at..].char_indices() {
        let ws = c.is_whitespace();
        if ws && !prev_ws {
            return Some(at + i);
        }
        prev_ws = ws;
    }
    None
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
        let gpt2 = TokenizerSpec::parse("gpt2").unwrap();
        assert_eq!((gpt2.name(), gpt2.build().unwrap().vocab_size()), ("gpt2".to_string(), 50257));
        assert_eq!(TokenizerSpec::parse("m/x.gguf").unwrap(), TokenizerSpec::Gguf("m/x.gguf".into()));
        assert_eq!(TokenizerSpec::parse("m/x.gguf").unwrap().name(), "m/x.gguf");
        let e = TokenizerSpec::parse("llama").unwrap_err().to_string();
        assert!(e.contains("`llama`") && e.contains("`byte`") && e.contains("`gpt2`"), "{e}");
        let e = TokenizerSpec::parse("/nonexistent/tokenizer.json").unwrap().build().unwrap_err().to_string();
        assert!(e.contains("/nonexistent/tokenizer.json"), "{e}");
    }

    /// `prepare` shares one tokenizer across its worker threads.
    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }
}
