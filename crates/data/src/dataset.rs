//! Corpora on disk and the fixed-length sequences cut from them.
//!
//! Sample `i` of a split is tokens `[i·T, i·T + T]`: inputs are the first T,
//! targets the last T (shifted by one). Samples never overlap, so an epoch
//! sees every token once.

use crate::error::DataError;
use crate::tokenizer::ByteTokenizer;
use std::path::Path;

/// How a data file is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// UTF-8 text, byte-level tokens.
    #[default]
    Text,
    /// nanoGPT-style little-endian u16 tokens.
    TokensU16,
}

/// A tokenized corpus.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Where it came from (for messages).
    pub name: String,
    /// All tokens.
    pub tokens: Vec<u32>,
}

impl Corpus {
    /// Tokenizes in-memory bytes.
    pub fn from_bytes(name: &str, bytes: &[u8], format: DataFormat) -> Result<Self, DataError> {
        let tokens: Vec<u32> = match format {
            DataFormat::Text => bytes.iter().map(|&b| b as u32).collect(),
            DataFormat::TokensU16 => {
                if !bytes.len().is_multiple_of(2) {
                    return Err(DataError::RaggedTokens { name: name.into(), n_bytes: bytes.len() });
                }
                bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect()
            }
        };
        if tokens.is_empty() {
            return Err(DataError::Empty { name: name.into() });
        }
        Ok(Self { name: name.into(), tokens })
    }

    /// Reads and tokenizes a file.
    pub fn load(path: &Path, format: DataFormat) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|source| DataError::Read { path: path.into(), source })?;
        Self::from_bytes(&path.display().to_string(), &bytes, format)
    }

    /// Text through the byte tokenizer.
    pub fn from_text(name: &str, text: &str) -> Result<Self, DataError> {
        let tokens = ByteTokenizer.encode(text);
        if tokens.is_empty() {
            return Err(DataError::Empty { name: name.into() });
        }
        Ok(Self { name: name.into(), tokens })
    }

    /// Errors if a token does not fit a vocabulary of `vocab_size`.
    pub fn check_vocab(&self, vocab_size: usize) -> Result<(), DataError> {
        match self.tokens.iter().find(|&&t| t as usize >= vocab_size) {
            Some(&token) => Err(DataError::TokenOutOfRange { name: self.name.clone(), token, vocab_size }),
            None => Ok(()),
        }
    }

    /// Splits into (train, validation): the last `val_fraction` of the tokens
    /// is validation.
    pub fn split(&self, val_fraction: f64, seq_len: usize) -> Result<(TokenDataset, TokenDataset), DataError> {
        let n_val = ((self.tokens.len() as f64) * val_fraction).round() as usize;
        let (train, val) = self.tokens.split_at(self.tokens.len() - n_val);
        Ok((
            TokenDataset::new("train", train.to_vec(), seq_len)?,
            TokenDataset::new("validation", val.to_vec(), seq_len)?,
        ))
    }
}

/// Non-overlapping sequences of `seq_len` inputs and `seq_len` targets.
#[derive(Debug, Clone)]
pub struct TokenDataset {
    tokens: Vec<u32>,
    seq_len: usize,
}

impl TokenDataset {
    /// Errors if not even one sequence fits.
    pub fn new(split: &'static str, tokens: Vec<u32>, seq_len: usize) -> Result<Self, DataError> {
        if seq_len == 0 {
            return Err(DataError::ZeroSize { field: "data.seq_len" });
        }
        if tokens.len() < seq_len + 1 {
            return Err(DataError::TooShort { split, n_tokens: tokens.len(), seq_len });
        }
        Ok(Self { tokens, seq_len })
    }

    /// Number of samples.
    pub fn n_samples(&self) -> usize {
        (self.tokens.len() - 1) / self.seq_len
    }

    /// Sequence length T.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Appends the inputs and targets of sample `idx`.
    pub fn push_sample(&self, idx: usize, inputs: &mut Vec<u32>, targets: &mut Vec<i32>) {
        let s = &self.tokens[idx * self.seq_len..][..self.seq_len + 1];
        inputs.extend_from_slice(&s[..self.seq_len]);
        targets.extend(s[1..].iter().map(|&t| t as i32));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_shifted_windows() {
        let ds = TokenDataset::new("train", (0..10).collect(), 3).unwrap();
        assert_eq!(ds.n_samples(), 3);
        let (mut i, mut t) = (Vec::new(), Vec::new());
        ds.push_sample(2, &mut i, &mut t);
        assert_eq!((i, t), (vec![6, 7, 8], vec![7, 8, 9]));
    }

    #[test]
    fn bad_corpora_are_named_errors() {
        assert!(matches!(Corpus::from_bytes("x", b"", DataFormat::Text), Err(DataError::Empty { .. })));
        assert!(matches!(Corpus::from_bytes("x", b"abc", DataFormat::TokensU16), Err(DataError::RaggedTokens { .. })));
        let c = Corpus::from_bytes("x", &[1, 0, 2, 0], DataFormat::TokensU16).unwrap();
        assert_eq!(c.tokens, vec![1, 2]);
        let e = Corpus::from_text("x", "hello").unwrap().split(0.1, 8).unwrap_err();
        assert!(e.to_string().contains("data.seq_len = 8"), "{e}");
        let e = Corpus::load(Path::new("/nonexistent/file.txt"), DataFormat::Text).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/file.txt"));
    }
}
