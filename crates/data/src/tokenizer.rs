//! Tokenizers: [`ByteTokenizer`] (one token per UTF-8 byte, vocabulary 256)
//! and [`Tokenizer`], which is either it or a [`BpeTokenizer`], behind one
//! interface for corpora, fine-tuning data and generation.

use crate::bpe::{BpeTokenizer, Encoded};
use crate::chat::ChatTemplate;
use crate::error::DataError;
use std::path::Path;

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

/// The model's tokenizer.
#[derive(Debug)]
pub enum Tokenizer {
    /// Bytes as tokens.
    Byte(ByteTokenizer),
    /// Byte-level BPE.
    Bpe(Box<BpeTokenizer>),
}

impl Tokenizer {
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
}
