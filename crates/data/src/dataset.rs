//! Corpora on disk and the fixed-length sequences cut from them.
//!
//! Sample `i` of a split is tokens `[i·T, i·T + T]`: inputs are the first T,
//! targets the last T (shifted by one). Samples never overlap, so an epoch
//! sees every token once. Text is tokenized into memory; token files (u16 /
//! u32) are read a sample at a time (one positional read of T + 1 tokens).

use crate::error::DataError;
use crate::token_file::{check_vocab, refuse_text, TokenDtype, TokenFile, TokenFileMeta};
use crate::tokenizer::{ByteTokenizer, Tokenizer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How a data file is encoded (`data.format`): `text`, or a token file `u16`
/// (nanoGPT `.bin`; `tokens_u16` is an alias) or `u32`, read a sample at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// UTF-8 text, byte-level tokens.
    #[default]
    Text,
    /// nanoGPT-style little-endian u16 tokens, read a sample at a time.
    #[serde(alias = "tokens_u16")]
    U16,
    /// Little-endian u32 tokens, read a sample at a time.
    U32,
    /// JSON Lines of fine-tuning examples: `{"text": …}`, `{"messages":
    /// [{"role", "content"}, …]}` (only the assistant's replies are
    /// targets), Alpaca, ShareGPT or prompt/completion lines (`Schema`).
    Jsonl,
    /// A Parquet file (or a folder of them) of fine-tuning rows in any
    /// JSON Lines schema, or of `text` documents ([`crate::tabular`]).
    Parquet,
    /// Arrow IPC streams as Hugging Face `datasets` saves them (a
    /// `save_to_disk` folder or one `.arrow` file), read as `parquet` is.
    Arrow,
}

impl DataFormat {
    /// Every format.
    pub const ALL: [DataFormat; 6] =
        [DataFormat::Text, DataFormat::U16, DataFormat::U32, DataFormat::Jsonl, DataFormat::Parquet, DataFormat::Arrow];

    /// The name `data.format` gives it.
    pub fn name(self) -> &'static str {
        match self {
            DataFormat::Text => "text",
            DataFormat::U16 => "u16",
            DataFormat::U32 => "u32",
            DataFormat::Jsonl => "jsonl",
            DataFormat::Parquet => "parquet",
            DataFormat::Arrow => "arrow",
        }
    }

    /// The token width of a token-file format (`None` for text).
    pub fn dtype(self) -> Option<TokenDtype> {
        match self {
            DataFormat::Text | DataFormat::Jsonl | DataFormat::Parquet | DataFormat::Arrow => None,
            DataFormat::U16 => Some(TokenDtype::U16),
            DataFormat::U32 => Some(TokenDtype::U32),
        }
    }
}

impl DataFormat {
    /// Whether records are read from it (fine-tuning examples, or a
    /// table's documents): `jsonl`, `parquet`, `arrow`.
    pub fn has_records(self) -> bool {
        matches!(self, DataFormat::Jsonl | DataFormat::Parquet | DataFormat::Arrow)
    }

    /// The table format `path` is in, told by its name: `.parquet`,
    /// `.arrow`, or a folder that holds a `datasets` `save_to_disk`
    /// `state.json`, `.arrow` or `.parquet` files.
    pub fn table_of(path: &Path) -> Option<DataFormat> {
        let ext = |p: &Path, e: &str| p.extension().is_some_and(|x| x.eq_ignore_ascii_case(e));
        if ext(path, "parquet") {
            return Some(DataFormat::Parquet);
        }
        if ext(path, "arrow") {
            return Some(DataFormat::Arrow);
        }
        if !path.is_dir() {
            return None;
        }
        if path.join("state.json").is_file() || path.join("dataset_dict.json").is_file() {
            return Some(DataFormat::Arrow);
        }
        let names: Vec<PathBuf> = std::fs::read_dir(path).ok()?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        [DataFormat::Parquet, DataFormat::Arrow].into_iter().find(|f| names.iter().any(|p| ext(p, f.name())))
    }

    /// The format of `path` when none is given: a table
    /// ([`Self::table_of`]), `.jsonl` / `.json` as records, a token file
    /// by the `meta.json` beside it, else text.
    pub fn detect(path: &Path) -> Result<DataFormat, DataError> {
        if let Some(table) = Self::table_of(path) {
            return Ok(table);
        }
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("json")) {
            return Ok(DataFormat::Jsonl);
        }
        if path.is_file() {
            if let Some(meta) = TokenFileMeta::beside(path)? {
                return Ok(match meta.dtype {
                    TokenDtype::U16 => DataFormat::U16,
                    TokenDtype::U32 => DataFormat::U32,
                });
            }
        }
        Ok(DataFormat::Text)
    }

    /// The format `path` is read in when this one is configured: `text`
    /// (the default) becomes `parquet` or `arrow` where the name says so
    /// ([`Self::table_of`]); any other is kept.
    pub fn resolved_for(self, path: Option<&Path>) -> DataFormat {
        match (self, path.and_then(Self::table_of)) {
            (DataFormat::Text, Some(table)) => table,
            _ => self,
        }
    }
}

/// Tokens probed for the vocabulary when a token file is opened (4 MB of
/// u32 at most: a mismatched file fails at startup without reading it all).
const VOCAB_PROBE: usize = 1 << 20;

/// The (train, validation) datasets of `path` in `format`: validation from
/// `val_path` when given, else the last `val_fraction` of the tokens. Token
/// files are opened, not read; their `meta.json`, when present, must agree
/// with `format` and `vocab_size`; without one, a file that starts like
/// text is refused (text or JSON given as token ids).
pub fn load_splits(
    path: &Path,
    val_path: Option<&Path>,
    format: DataFormat,
    val_fraction: f64,
    seq_len: usize,
    vocab_size: usize,
) -> Result<(TokenDataset, TokenDataset), DataError> {
    let Some(dtype) = format.dtype() else {
        let corpus = Corpus::load(path, format)?;
        corpus.check_vocab(vocab_size)?;
        let Some(val_path) = val_path else { return corpus.split(val_fraction, seq_len) };
        let val = Corpus::load(val_path, format)?;
        val.check_vocab(vocab_size)?;
        return Ok((
            TokenDataset::new("train", corpus.tokens, seq_len)?,
            TokenDataset::new("validation", val.tokens, seq_len)?,
        ));
    };
    let open = |p: &Path| open_token_file(p, dtype, vocab_size);
    let train = open(path)?;
    match val_path {
        Some(vp) => {
            let val = open(vp)?;
            let (n_train, n_val) = (train.n_tokens(), val.n_tokens());
            Ok((
                TokenDataset::from_file("train", train, 0, n_train, seq_len, vocab_size)?,
                TokenDataset::from_file("validation", val, 0, n_val, seq_len, vocab_size)?,
            ))
        }
        None => {
            let n = train.n_tokens();
            let n_val = n_val_tokens(n, val_fraction);
            Ok((
                TokenDataset::from_file("train", train.clone(), 0, n - n_val, seq_len, vocab_size)?,
                TokenDataset::from_file("validation", train, n - n_val, n_val, seq_len, vocab_size)?,
            ))
        }
    }
}

/// Opens the token file `p` of `dtype` for a model of `vocab_size` tokens:
/// its `meta.json`, when present, must agree; without one, a file that
/// starts like text is refused; the first tokens are probed against the
/// vocabulary.
pub fn open_token_file(p: &Path, dtype: TokenDtype, vocab_size: usize) -> Result<Arc<TokenFile>, DataError> {
    match TokenFileMeta::beside(p)? {
        Some(meta) => meta.check(p, dtype, vocab_size)?,
        None => refuse_text(p, dtype.name())?,
    }
    let f = TokenFile::open(p, dtype)?;
    f.check_vocab_prefix(vocab_size, VOCAB_PROBE)?;
    Ok(Arc::new(f))
}

/// Tokens of `n` held out for validation: the last `round(n · val_fraction)`.
pub fn n_val_tokens(n: usize, val_fraction: f64) -> usize {
    ((n as f64 * val_fraction).round() as usize).min(n)
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
        let tokens: Vec<u32> = match format.dtype() {
            None => bytes.iter().map(|&b| b as u32).collect(),
            Some(dtype) => {
                if !bytes.len().is_multiple_of(dtype.width()) {
                    return Err(DataError::RaggedTokens {
                        name: name.into(),
                        n_bytes: bytes.len(),
                        dtype: dtype.name(),
                    });
                }
                let mut tokens = Vec::with_capacity(bytes.len() / dtype.width());
                dtype.decode(bytes, &mut tokens);
                tokens
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

    /// UTF-8 text files (those of a folder: [`text_files`]) through the
    /// model's tokenizer, as one corpus called `name`: each file is one
    /// document, encoded on its own, and documents are joined with the
    /// tokenizer's EOS when it has one (so the model sees where a document
    /// ends, and no BPE merge spans two files). A file that is not UTF-8 or
    /// holds a NUL byte (binary, e.g. a token file) is an error naming it.
    pub fn load_files(name: &str, files: &[PathBuf], tok: &Tokenizer) -> Result<Self, DataError> {
        let read = files.iter().map(|file| {
            let bytes = std::fs::read(file).map_err(|source| DataError::Read { path: file.clone(), source })?;
            text_of(file, &bytes, 0)?;
            String::from_utf8(bytes)
                .map_err(|e| DataError::NotUtf8 { path: file.clone(), offset: e.utf8_error().valid_up_to() as u64 })
        });
        Self::from_documents(name, read, tok)
    }

    /// Documents (each read as it is reached: the first error stops)
    /// through the model's tokenizer, as one corpus called `name`: each
    /// encoded on its own, joined with the tokenizer's EOS when it has one
    /// (so the model sees where a document ends, and no BPE merge spans
    /// two).
    pub fn from_documents<S: AsRef<str>>(
        name: &str,
        docs: impl IntoIterator<Item = Result<S, DataError>>,
        tok: &Tokenizer,
    ) -> Result<Self, DataError> {
        let mut tokens = Vec::new();
        for (doc_idx, text) in docs.into_iter().enumerate() {
            let text = text?;
            if let (true, Some(eos)) = (doc_idx > 0, tok.eos_id()) {
                tokens.push(eos);
            }
            tokens.extend(tok.encode(text.as_ref())?);
        }
        if tokens.is_empty() {
            return Err(DataError::Empty { name: name.into() });
        }
        Ok(Self { name: name.into(), tokens })
    }

    /// Errors if a token does not fit a vocabulary of `vocab_size`.
    pub fn check_vocab(&self, vocab_size: usize) -> Result<(), DataError> {
        check_vocab(&self.name, 0, &self.tokens, vocab_size)
    }

    /// Splits into (train, validation): the last `val_fraction` of the tokens
    /// is validation.
    pub fn split(&self, val_fraction: f64, seq_len: usize) -> Result<(TokenDataset, TokenDataset), DataError> {
        let n_val = n_val_tokens(self.tokens.len(), val_fraction);
        let (train, val) = self.tokens.split_at(self.tokens.len() - n_val);
        Ok((
            TokenDataset::new("train", train.to_vec(), seq_len)?,
            TokenDataset::new("validation", val.to_vec(), seq_len)?,
        ))
    }

    /// All of it as one split (`split` names it in errors).
    pub fn split_all(self, split: &'static str, seq_len: usize) -> Result<TokenDataset, DataError> {
        TokenDataset::new(split, self.tokens, seq_len)
    }
}

/// Where a dataset's tokens live.
#[derive(Debug, Clone)]
enum Tokens {
    /// Tokenized into memory.
    Memory(Arc<Vec<u32>>),
    /// `len` tokens of a token file from `start`, each sample checked
    /// against `vocab_size` as it is read.
    File { file: Arc<TokenFile>, start: usize, len: usize, vocab_size: usize },
}

/// Non-overlapping sequences of `seq_len` inputs and `seq_len` targets.
#[derive(Debug, Clone)]
pub struct TokenDataset {
    tokens: Tokens,
    seq_len: usize,
}

impl TokenDataset {
    /// Errors if not even one sequence fits.
    pub fn new(split: &'static str, tokens: Vec<u32>, seq_len: usize) -> Result<Self, DataError> {
        Self::checked(split, Tokens::Memory(Arc::new(tokens)), seq_len)
    }

    /// Tokens `[start, start + len)` of a token file, read a sample at a
    /// time; a token not below `vocab_size` is an error naming the file and
    /// its position. Errors if not even one sequence fits.
    pub fn from_file(
        split: &'static str,
        file: Arc<TokenFile>,
        start: usize,
        len: usize,
        seq_len: usize,
        vocab_size: usize,
    ) -> Result<Self, DataError> {
        let len = len.min(file.n_tokens().saturating_sub(start));
        Self::checked(split, Tokens::File { file, start, len, vocab_size }, seq_len)
    }

    fn checked(split: &'static str, tokens: Tokens, seq_len: usize) -> Result<Self, DataError> {
        if seq_len == 0 {
            return Err(DataError::ZeroSize { field: "data.seq_len" });
        }
        let ds = Self { tokens, seq_len };
        if ds.n_tokens() < seq_len + 1 {
            return Err(DataError::TooShort { split, n_tokens: ds.n_tokens(), seq_len });
        }
        Ok(ds)
    }

    /// Tokens in the split.
    pub fn n_tokens(&self) -> usize {
        match &self.tokens {
            Tokens::Memory(t) => t.len(),
            Tokens::File { len, .. } => *len,
        }
    }

    /// Number of samples.
    pub fn n_samples(&self) -> usize {
        (self.n_tokens() - 1) / self.seq_len
    }

    /// Bytes of tokens held in memory (a token file's pages are the OS's cache).
    pub fn resident_bytes(&self) -> u64 {
        match &self.tokens {
            Tokens::Memory(t) => 4 * t.len() as u64,
            Tokens::File { .. } => 0,
        }
    }

    /// Sequence length T.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Appends the inputs and targets of sample `idx` (below
    /// [`n_samples`](Self::n_samples)). Errors only for a token file: one
    /// that shrank or cannot be read since it was opened, or a token outside
    /// the vocabulary, each naming the file.
    pub fn push_sample(&self, idx: usize, inputs: &mut Vec<u32>, targets: &mut Vec<i32>) -> Result<(), DataError> {
        let (t, first) = (self.seq_len, idx * self.seq_len);
        match &self.tokens {
            Tokens::Memory(tokens) => {
                let s = &tokens[first..][..t + 1];
                inputs.extend_from_slice(&s[..t]);
                targets.extend(s[1..].iter().map(|&x| x as i32));
            }
            Tokens::File { file, start, vocab_size, .. } => {
                let at = inputs.len();
                file.read(start + first, t + 1, inputs)?;
                check_vocab(&file.path().display(), start + first, &inputs[at..], *vocab_size)?;
                // The window's last token is the last target, not an input.
                let last = inputs.pop().unwrap_or_default();
                targets.extend(inputs[at + 1..].iter().map(|&x| x as i32));
                targets.push(last as i32);
            }
        }
        Ok(())
    }
}

/// `bytes` (of `path`, from byte `offset` of it) as text: UTF-8 without NUL
/// bytes (a NUL means a binary file, such as a token file), else an error
/// naming the file and the offset of the first bad byte.
pub fn text_of<'a>(path: &Path, bytes: &'a [u8], offset: u64) -> Result<&'a str, DataError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|e| DataError::NotUtf8 { path: path.into(), offset: offset + e.valid_up_to() as u64 })?;
    match bytes.iter().position(|&b| b == 0) {
        Some(at) => Err(DataError::Binary { path: path.into(), offset: offset + at as u64 }),
        None => Ok(text),
    }
}

/// What [`text_files`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextFiles {
    /// Regular files (and links to them), sorted by path.
    pub files: Vec<PathBuf>,
    /// Entries left out, each with why: links to folders (never followed, so
    /// a link loop cannot repeat files) and anything that is not a regular file.
    pub skipped: Vec<(PathBuf, &'static str)>,
}

/// Every regular file below `path` (itself, if a file), sorted by path,
/// skipping names that start with a dot. `path` itself may be a link; below
/// it links to files are read and links to folders are not followed.
pub fn text_files(path: &Path) -> Result<TextFiles, DataError> {
    let read_err = |p: &Path| {
        let p = p.to_path_buf();
        move |source| DataError::Read { path: p, source }
    };
    let meta = std::fs::metadata(path).map_err(read_err(path))?;
    let mut found = TextFiles::default();
    if meta.is_file() {
        found.files.push(path.into());
        return Ok(found);
    }
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(read_err(&dir))? {
            let entry = entry.map_err(read_err(&dir))?;
            let p = entry.path();
            if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.')) {
                continue;
            }
            // The entry's own type: a link is not followed here.
            let kind = entry.file_type().map_err(read_err(&p))?;
            if kind.is_dir() {
                stack.push(p);
            } else if kind.is_file() || (kind.is_symlink() && p.is_file()) {
                found.files.push(p);
            } else if kind.is_symlink() && p.is_dir() {
                found.skipped.push((p, "a link to a folder (not followed)"));
            } else {
                found.skipped.push((p, "not a regular file"));
            }
        }
    }
    found.files.sort();
    found.skipped.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_shifted_windows() {
        let ds = TokenDataset::new("train", (0..10).collect(), 3).unwrap();
        assert_eq!(ds.n_samples(), 3);
        let (mut i, mut t) = (Vec::new(), Vec::new());
        ds.push_sample(2, &mut i, &mut t).unwrap();
        assert_eq!((i, t), (vec![6, 7, 8], vec![7, 8, 9]));
    }

    #[test]
    fn bad_corpora_are_named_errors() {
        assert!(matches!(Corpus::from_bytes("x", b"", DataFormat::Text), Err(DataError::Empty { .. })));
        assert!(matches!(Corpus::from_bytes("x", b"abc", DataFormat::U16), Err(DataError::RaggedTokens { .. })));
        let c = Corpus::from_bytes("x", &[1, 0, 2, 0], DataFormat::U16).unwrap();
        assert_eq!(c.tokens, vec![1, 2]);
        let e = Corpus::from_text("x", "hello").unwrap().split(0.1, 8).unwrap_err();
        assert!(e.to_string().contains("data.seq_len = 8"), "{e}");
        let e = Corpus::load(Path::new("/nonexistent/file.txt"), DataFormat::Text).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/file.txt"));
    }

    /// A folder: files in path order (dot-names skipped), each encoded alone,
    /// EOS between documents; a link to a folder is not followed (a loop
    /// would repeat every file) but reported; binary and non-UTF-8 files are
    /// errors naming the file and offset.
    #[test]
    fn text_folder_through_a_tokenizer() {
        let dir = std::env::temp_dir().join(format!("macrobatch-corpus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("b.txt"), "b").unwrap();
        std::fs::write(dir.join("a.txt"), "a").unwrap();
        std::fs::write(dir.join("sub/c.txt"), "c").unwrap();
        std::fs::write(dir.join(".hidden"), "x").unwrap();
        std::os::unix::fs::symlink(".", dir.join("sub/loop")).unwrap();
        std::os::unix::fs::symlink("../a.txt", dir.join("sub/link.txt")).unwrap();
        let tok = crate::sft::tests::byte_chatml();
        let listed = text_files(&dir).unwrap();
        assert_eq!(listed.files, ["a.txt", "b.txt", "sub/c.txt", "sub/link.txt"].map(|f| dir.join(f)));
        assert_eq!(listed.skipped, vec![(dir.join("sub/loop"), "a link to a folder (not followed)")]);
        let c = Corpus::load_files("x", &listed.files, &tok).unwrap();
        assert_eq!(c.tokens, vec![97, 257, 98, 257, 99, 257, 97]);
        let one = text_files(&dir.join("b.txt")).unwrap();
        assert_eq!(one.files, vec![dir.join("b.txt")]);
        std::fs::write(dir.join("sub/d.bin"), [b'o', b'k', 0xff, 0xfe]).unwrap();
        let e = Corpus::load_files("x", &text_files(&dir).unwrap().files, &tok).unwrap_err();
        assert!(matches!(e, DataError::NotUtf8 { offset: 2, .. }), "{e}");
        std::fs::write(dir.join("sub/d.bin"), [b'o', 0, b'k', 0]).unwrap();
        let e = Corpus::load_files("x", &text_files(&dir).unwrap().files, &tok).unwrap_err();
        assert!(matches!(e, DataError::Binary { offset: 1, .. }), "{e}");
        let bytes = Corpus::from_text_with("x", "hé", &Tokenizer::Byte(ByteTokenizer)).unwrap();
        assert_eq!(bytes.tokens, vec![104, 0xc3, 0xa9]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
