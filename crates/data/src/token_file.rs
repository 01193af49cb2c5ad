//! Header-less token files (nanoGPT `.bin`): little-endian u16 or u32 token
//! ids back to back, read with positional reads (`pread`) a sample at a time,
//! so that a file of any size opens at once and only the bytes a sample
//! needs are ever read. A file truncated while open is a short read — an
//! error naming the file — never a fault (as a memory map would give).
//!
//! `macrobatch prepare` writes them with a `meta.json` beside them
//! ([`TokenFileMeta`]); training reads only the `.bin`, and checks the
//! `meta.json` next to it when there is one.

use crate::error::DataError;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The width of one token id in a token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// Little-endian u16: vocabularies of at most 65,536 tokens.
    U16,
    /// Little-endian u32.
    U32,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The narrowest width that holds every id of a vocabulary.
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    /// The name used in `data.format` and `meta.json`.
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        }
    }

    /// Appends the ids in `bytes` to `out` (a partial last token is ignored).
    pub fn decode(self, bytes: &[u8], out: &mut Vec<u32>) {
        match self {
            TokenDtype::U16 => out.extend(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)),
            TokenDtype::U32 => out.extend(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        }
    }

    /// Appends `tokens` to `out` in this width; an id that does not fit is an error.
    pub fn encode(self, tokens: &[u32], out: &mut Vec<u8>) -> Result<(), DataError> {
        match self {
            TokenDtype::U16 => {
                for &t in tokens {
                    let t = u16::try_from(t).map_err(|_| DataError::TokenTooWide { token: t, dtype: "u16" })?;
                    out.extend_from_slice(&t.to_le_bytes());
                }
            }
            TokenDtype::U32 => tokens.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes())),
        }
        Ok(())
    }
}

/// An open token file. Opening it reads nothing but its length.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    file: File,
    n_bytes: u64,
    dtype: TokenDtype,
}

impl TokenFile {
    /// Opens `path`. Errors: unreadable, empty, or a size that is not a whole
    /// number of tokens.
    pub fn open(path: &Path, dtype: TokenDtype) -> Result<Self, DataError> {
        let read_err = |source| DataError::Read { path: path.into(), source };
        let file = File::open(path).map_err(read_err)?;
        let n_bytes = file.metadata().map_err(read_err)?.len();
        if n_bytes == 0 {
            return Err(DataError::Empty { name: path.display().to_string() });
        }
        if n_bytes % dtype.width() as u64 != 0 {
            return Err(DataError::RaggedTokens {
                name: path.display().to_string(),
                n_bytes: n_bytes as usize,
                dtype: dtype.name(),
            });
        }
        Ok(Self { path: path.into(), file, n_bytes, dtype })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token width.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Number of tokens (when it was opened).
    pub fn n_tokens(&self) -> usize {
        (self.n_bytes / self.dtype.width() as u64) as usize
    }

    /// Appends tokens `[start, start + len)` to `out` with one positional
    /// read. Errors, naming the file, if it cannot be read or no longer
    /// holds the range (truncated since it was opened); callers index within
    /// [`n_tokens`](Self::n_tokens).
    pub fn read(&self, start: usize, len: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        let w = self.dtype.width();
        let mut bytes = vec![0u8; len * w];
        self.file.read_exact_at(&mut bytes, (start * w) as u64).map_err(|source| {
            let now = self.file.metadata().map(|m| m.len()).ok();
            match now {
                Some(now) if now < ((start + len) * w) as u64 => DataError::Shrunk {
                    path: self.path.clone(),
                    n_bytes: self.n_bytes,
                    now,
                    needed: ((start + len) * w) as u64,
                },
                _ => DataError::Read { path: self.path.clone(), source },
            }
        })?;
        self.dtype.decode(&bytes, out);
        Ok(())
    }

    /// Errors if a token among the first `n_probe` does not fit `vocab_size`
    /// (a cheap check at startup: a file made for another vocabulary shows at
    /// once; the model checks every batch it is given anyway).
    pub fn check_vocab_prefix(&self, vocab_size: usize, n_probe: usize) -> Result<(), DataError> {
        if self.dtype == TokenDtype::U16 && vocab_size >= 1 << 16 {
            return Ok(());
        }
        // In pieces: the probe's memory stays small whatever n_probe is.
        const PIECE: usize = 1 << 16;
        let (n, mut head) = (n_probe.min(self.n_tokens()), Vec::with_capacity(PIECE));
        for start in (0..n).step_by(PIECE) {
            head.clear();
            self.read(start, PIECE.min(n - start), &mut head)?;
            check_vocab(&self.path.display(), start, &head, vocab_size)?;
        }
        Ok(())
    }
}

/// Errors if a token of `tokens` — positions `first..` of `name` — does not
/// fit a vocabulary of `vocab_size`, naming the first such token and where it is.
pub(crate) fn check_vocab(
    name: &dyn std::fmt::Display,
    first: usize,
    tokens: &[u32],
    vocab_size: usize,
) -> Result<(), DataError> {
    match tokens.iter().position(|&t| t as usize >= vocab_size) {
        Some(i) => Err(DataError::TokenOutOfRange {
            name: name.to_string(),
            token: tokens[i],
            position: first + i,
            vocab_size,
        }),
        None => Ok(()),
    }
}

/// Bytes probed by [`refuse_text`].
const TEXT_PROBE: usize = 512;

/// Whether `head` (the first bytes of a file) reads as text: a UTF-8 byte
/// order mark, or UTF-8 (a character cut at the end allowed) without
/// control characters other than tab and line ends. Token ids almost always
/// hold a zero or another control byte in their high bytes.
fn looks_like_text(head: &[u8]) -> bool {
    if head.starts_with(b"\xEF\xBB\xBF") {
        return true;
    }
    let valid = match std::str::from_utf8(head) {
        Ok(s) => s,
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&head[..e.valid_up_to()]).unwrap_or_default(),
        Err(_) => return false,
    };
    valid.len() >= 8 && valid.chars().all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r'))
}

/// Errors if the file at `path` starts like text (UTF-8 without control
/// bytes, or a byte order mark): text or JSON Lines given as token ids would
/// train on its bytes. `format` is `data.format`, for the message.
pub fn refuse_text(path: &Path, format: &str) -> Result<(), DataError> {
    let read_err = |source| DataError::Read { path: path.into(), source };
    let mut head = Vec::with_capacity(TEXT_PROBE);
    File::open(path).and_then(|f| f.take(TEXT_PROBE as u64).read_to_end(&mut head)).map_err(read_err)?;
    if !looks_like_text(&head) {
        return Ok(());
    }
    let start: String = String::from_utf8_lossy(&head).chars().take(24).collect();
    Err(DataError::LooksLikeText { path: path.into(), format: format.into(), start })
}

/// `meta.json` of a folder written by `macrobatch prepare`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenFileMeta {
    /// Tokenizer name (`byte`, …).
    pub tokenizer: String,
    /// Its vocabulary size: every id is below it.
    pub vocab_size: usize,
    /// Width of the ids in `train.bin` and `val.bin`.
    pub dtype: TokenDtype,
    /// Tokens in `train.bin`.
    pub n_train_tokens: u64,
    /// Tokens in `val.bin`.
    pub n_val_tokens: u64,
    /// The share of the tokens (from the end) written to `val.bin`.
    pub val_fraction: f64,
    /// The input files, in the order their tokens were written.
    pub sources: Vec<SourceFile>,
}

/// One input of `macrobatch prepare`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceFile {
    /// The path as it was found.
    pub path: String,
    /// Its size.
    pub n_bytes: u64,
    /// SHA-256 of its bytes, hex.
    pub sha256: String,
}

impl TokenFileMeta {
    /// The file name beside the token files.
    pub const FILE: &'static str = "meta.json";

    /// Reads the `meta.json` in the folder of `bin`, if there is one.
    pub fn beside(bin: &Path) -> Result<Option<Self>, DataError> {
        let path = bin.parent().unwrap_or(Path::new(".")).join(Self::FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(DataError::Read { path, source }),
        };
        serde_json::from_str(&text).map(Some).map_err(|e| DataError::BadMeta { path, reason: e.to_string() })
    }

    /// Errors where the token files cannot be what `dtype` and `vocab_size` expect.
    pub fn check(&self, bin: &Path, dtype: TokenDtype, vocab_size: usize) -> Result<(), DataError> {
        let name = bin.display().to_string();
        if self.dtype != dtype {
            return Err(DataError::MetaMismatch {
                name,
                what: format!(
                    "its meta.json says {} tokens, but data.format = \"{}\"; set data.format = \"{}\"",
                    self.dtype.name(),
                    dtype.name(),
                    self.dtype.name()
                ),
            });
        }
        if self.vocab_size > vocab_size {
            return Err(DataError::MetaMismatch {
                name,
                what: format!(
                    "its meta.json says tokenizer `{}` with a vocabulary of {}, larger than the model's {vocab_size}; set model.vocab_size = {}",
                    self.tokenizer, self.vocab_size, self.vocab_size
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("macrobatch-tokfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn reads_little_endian_ids_of_both_widths() {
        let mut b16 = Vec::new();
        TokenDtype::U16.encode(&[1, 258, 65535], &mut b16).unwrap();
        let f = TokenFile::open(&write("a.bin", &b16), TokenDtype::U16).unwrap();
        let mut out = Vec::new();
        f.read(1, 2, &mut out).unwrap();
        assert_eq!((f.n_tokens(), out), (3, vec![258, 65535]));
        let mut b32 = Vec::new();
        TokenDtype::U32.encode(&[70000, 7], &mut b32).unwrap();
        let f = TokenFile::open(&write("b.bin", &b32), TokenDtype::U32).unwrap();
        let mut out = Vec::new();
        f.read(0, 2, &mut out).unwrap();
        assert_eq!(out, vec![70000, 7]);
        assert!(matches!(TokenDtype::U16.encode(&[70000], &mut Vec::new()), Err(DataError::TokenTooWide { .. })));
    }

    #[test]
    fn bad_token_files_are_named_errors() {
        let e = TokenFile::open(&write("odd.bin", &[1, 2, 3]), TokenDtype::U16).unwrap_err();
        assert!(e.to_string().contains("not a multiple of 2"), "{e}");
        let e = TokenFile::open(&write("six.bin", &[0; 6]), TokenDtype::U32).unwrap_err();
        assert!(e.to_string().contains("not a multiple of 4"), "{e}");
        assert!(matches!(TokenFile::open(&write("empty.bin", &[]), TokenDtype::U16), Err(DataError::Empty { .. })));
        let e = TokenFile::open(Path::new("/no/such/train.bin"), TokenDtype::U16).unwrap_err();
        assert!(e.to_string().contains("/no/such/train.bin"), "{e}");
        let f = TokenFile::open(&write("big.bin", &[0, 0, 0, 1]), TokenDtype::U16).unwrap();
        let e = f.check_vocab_prefix(256, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("token 256 at token position 1 of"), "{e}");
    }
}
