//! Corpora on disk and the fixed-length sequences cut from them.
//!
//! Sample `i` of a split is tokens `[i·T, i·T + T]`: inputs are the first T,
//! targets the last T (shifted by one). Samples never overlap, so an epoch
//! sees every token once.

use crate::error::DataError;
use crate::tokenizer::{ByteTokenizer, Tokenizer};
use std::path::{Path, PathBuf};

/// How a data file is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFormat {
    /// UTF-8 text, byte-level tokens.
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

    /// Text through the model's tokenizer.
    pub fn from_text_with(name: &str, text: &str, tok: &Tokenizer) -> Result<Self, DataError> {
        let tokens = tok.encode(text)?;
        if tokens.is_empty() {
            return Err(DataError::Empty { name: name.into() });
        }
        Ok(Self { name: name.into(), tokens })
    }

    /// A UTF-8 text file, or every file below a folder ([`text_files`]),
    /// through the model's tokenizer: each file is one document, encoded on
    /// its own, and documents are joined with the tokenizer's EOS when it has
    /// one (so the model sees where a document ends, and no BPE merge spans two
    /// files).
    pub fn load_text(path: &Path, tok: &Tokenizer) -> Result<Self, DataError> {
        let mut tokens = Vec::new();
        for (file_idx, file) in text_files(path)?.iter().enumerate() {
            let bytes = std::fs::read(file).map_err(|source| DataError::Read { path: file.clone(), source })?;
            let text = String::from_utf8(bytes).map_err(|_| DataError::NotUtf8 { path: file.clone() })?;
            if let (true, Some(eos)) = (file_idx > 0, tok.eos_id()) {
                tokens.push(eos);
            }
            tokens.extend(tok.encode(&text)?);
        }
        let name = path.display().to_string();
        if tokens.is_empty() {
            return Err(DataError::Empty { name });
        }
        Ok(Self { name, tokens })
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

/// Every regular file below `path` (itself, if a file), sorted by path,
/// skipping names that start with a dot.
pub fn text_files(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    let read_err = |p: &Path| {
        let p = p.to_path_buf();
        move |source| DataError::Read { path: p, source }
    };
    let meta = std::fs::metadata(path).map_err(read_err(path))?;
    if meta.is_file() {
        return Ok(vec![path.into()]);
    }
    let mut files = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(read_err(&dir))? {
            let p = entry.map_err(read_err(&dir))?.path();
            if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.')) {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
            } else if p.is_file() {
                files.push(p);
            }
        }
    }
    files.sort();
    Ok(files)
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

    /// A folder: files in path order (dot-names skipped), each encoded alone,
    /// EOS between documents.
    #[test]
    fn text_folder_through_a_tokenizer() {
        let dir = std::env::temp_dir().join(format!("macrobatch-corpus-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("b.txt"), "b").unwrap();
        std::fs::write(dir.join("a.txt"), "a").unwrap();
        std::fs::write(dir.join("sub/c.txt"), "c").unwrap();
        std::fs::write(dir.join(".hidden"), "x").unwrap();
        let tok = crate::sft::tests::byte_chatml();
        let c = Corpus::load_text(&dir, &tok).unwrap();
        assert_eq!(c.tokens, vec![97, 257, 98, 257, 99]);
        let one = Corpus::load_text(&dir.join("b.txt"), &tok).unwrap();
        assert_eq!(one.tokens, vec![98]);
        std::fs::write(dir.join("sub/d.bin"), [0xff, 0xfe]).unwrap();
        assert!(matches!(Corpus::load_text(&dir, &tok), Err(DataError::NotUtf8 { .. })));
        let bytes = Corpus::from_text_with("x", "hé", &Tokenizer::Byte(ByteTokenizer)).unwrap();
        assert_eq!(bytes.tokens, vec![104, 0xc3, 0xa9]);
    }
}
