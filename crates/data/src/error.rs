//! The data crate's error type.

use std::path::PathBuf;
use thiserror::Error;

/// What can go wrong while reading or batching data.
#[derive(Debug, Error)]
pub enum DataError {
    /// The data file cannot be read.
    #[error("cannot read data file {} (set data.path to an existing file, or leave it unset for the bundled corpus)", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The corpus holds no tokens.
    #[error("the corpus {name} is empty: it holds no tokens to train on")]
    Empty {
        /// Where it came from.
        name: String,
    },
    /// A token file's size is not a whole number of tokens.
    #[error("token file {name} has {n_bytes} bytes, not a multiple of {} (expected little-endian {dtype} tokens; is data.format right?)", if *dtype == "u16" { 2 } else { 4 })]
    RaggedTokens {
        /// Where it came from.
        name: String,
        /// File size.
        n_bytes: usize,
        /// `u16` or `u32`.
        dtype: &'static str,
    },
    /// A token id does not fit the token file's width.
    #[error("token {token} does not fit a {dtype} token file")]
    TokenTooWide {
        /// The token.
        token: u32,
        /// `u16`.
        dtype: &'static str,
    },
    /// A tokenizer name this build does not know.
    #[error("unknown tokenizer `{name}`: this build has {available}")]
    UnknownTokenizer {
        /// What was asked for.
        name: String,
        /// The names it knows, for the message.
        available: String,
    },
    /// A `meta.json` beside token files cannot be read as one.
    #[error("{} is not a macrobatch prepare meta.json: {reason}", path.display())]
    BadMeta {
        /// The file.
        path: PathBuf,
        /// What the JSON parser said.
        reason: String,
    },
    /// A token file's `meta.json` contradicts the configuration.
    #[error("token file {name}: {what}")]
    MetaMismatch {
        /// The token file.
        name: String,
        /// The contradiction and its fix.
        what: String,
    },
    /// A token file holds fewer bytes than when it was opened.
    #[error("token file {} shrank while in use: it had {n_bytes} bytes when opened, now {now}, and a sample needs bytes up to {needed} (was it truncated or rewritten in place during training?); restore the file — or write a new one under another name and rename it over the old — then resume the run with --resume", path.display())]
    Shrunk {
        /// The file.
        path: PathBuf,
        /// Its size when opened.
        n_bytes: u64,
        /// Its size now.
        now: u64,
        /// The end of the range the sample reads.
        needed: u64,
    },
    /// A token file without `meta.json` starts like text.
    #[error("{} looks like text, not {format} token ids (it starts with {start:?}) and no meta.json from `macrobatch prepare` is beside it: tokenize it with `macrobatch prepare {} --out DIR` and train on DIR/train.bin, or set data.format = \"text\" (or \"jsonl\" for JSON Lines)", path.display(), path.display())]
    LooksLikeText {
        /// The file.
        path: PathBuf,
        /// `data.format`.
        format: String,
        /// Its first characters.
        start: String,
    },
    /// A split is too short for even one sequence.
    #[error("the {split} split has {n_tokens} tokens, too few for one sequence of data.seq_len = {seq_len} (+1 target); use a shorter data.seq_len, a smaller data.val_fraction or more data")]
    TooShort {
        /// `train` or `validation`.
        split: &'static str,
        /// Tokens in the split.
        n_tokens: usize,
        /// Requested sequence length.
        seq_len: usize,
    },
    /// Not even one global batch fits in an epoch while drop_last is on.
    #[error("the training split has {n_samples} sequences but one global batch needs {global}; with data.drop_last = true no step could run — lower batch.global, shorten data.seq_len, or set data.drop_last = false")]
    NoFullBatch {
        /// Sequences available.
        n_samples: usize,
        /// Global batch size.
        global: usize,
    },
    /// A token id does not fit the vocabulary.
    #[error(
        "token {token} at token position {position} of {name} is outside the model's vocabulary of {vocab_size}; use a matching model.vocab_size, or data made with the model's tokenizer"
    )]
    TokenOutOfRange {
        /// Where it came from.
        name: String,
        /// The token.
        token: u32,
        /// Its index among the tokens of `name` (from 0).
        position: usize,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// A batch dimension is zero.
    #[error("batch dimension `{field}` must be at least 1")]
    ZeroSize {
        /// The field.
        field: &'static str,
    },
    /// The tokenizers library failed (a tokenizer file it cannot parse, or
    /// text it cannot encode).
    #[error("tokenizer: {what}")]
    Tokenizer {
        /// What was being done.
        what: String,
        /// The library's error.
        #[source]
        source: tokenizers::Error,
    },
    /// A tokenizer description this crate does not support or finds
    /// inconsistent (unknown `tokenizer.ggml.model` or `tokenizer.ggml.pre`,
    /// a malformed merge, an id out of range, …).
    #[error("tokenizer {source_name}: {problem}")]
    TokenizerFormat {
        /// The file or bundled asset.
        source_name: String,
        /// What is wrong, with what is supported.
        problem: String,
    },
    /// Reading the GGUF file failed.
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    /// A chat template failed to compile or render.
    #[error("chat template: {0}")]
    ChatTemplate(minijinja::Error),
    /// Chat data was given to a tokenizer without a chat template.
    #[error("the tokenizer {tokenizer} has no chat template, so chat lines (`messages`, Alpaca, ShareGPT, prompt/completion message lists) cannot be rendered; use `text` or prompt/completion string lines, or a model whose tokenizer carries one")]
    NoChatTemplate {
        /// Which tokenizer.
        tokenizer: String,
    },
    /// A line of a JSON Lines file is not valid JSON.
    #[error("{}:{line}: not valid JSON: {error}", path.display())]
    BadJson {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parser's error (in the message, so not also a source: it
        /// would be printed twice).
        error: serde_json::Error,
    },
    /// A JSON Lines file holds bytes that are not UTF-8.
    #[error("{}:{line}: not UTF-8 (invalid byte at column {column}); JSON Lines must be UTF-8 — convert the file (e.g. `iconv -f latin1 -t utf-8`)", path.display())]
    NotUtf8Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// 1-based byte column of the first invalid byte.
        column: usize,
    },
    /// Examples that the length limit leaves without a target: refused
    /// (`data.drop_empty = false`), or every example is such.
    #[error("{}: {n} of {n_lines} examples keep no target once cut to data.seq_len = {max_len} positions (their assistant replies lie beyond it): lines {lines}; {}", path.display(), if *all { "no example is left — raise data.seq_len (or model.block_size) or shorten the prompts" } else { "raise data.seq_len, shorten their prompts, or set data.drop_empty = true to drop them" })]
    CutToNoTargets {
        /// The file.
        path: PathBuf,
        /// How many.
        n: usize,
        /// Examples in the file.
        n_lines: usize,
        /// The first of their 1-based lines.
        lines: String,
        /// The limit in positions.
        max_len: usize,
        /// Whether no example is left.
        all: bool,
    },
    /// Holding out `data.val_fraction` of a JSON Lines file's examples
    /// would leave one of the two splits empty.
    #[error("{}: cannot hold out data.val_fraction = {val_fraction} of {n} example(s): validation would take {n_val}, leaving none for training; add examples, or give held-out examples in data.val_path", path.display())]
    TooFewExamples {
        /// The file.
        path: PathBuf,
        /// Examples kept.
        n: usize,
        /// Examples validation would take.
        n_val: usize,
        /// The share asked for.
        val_fraction: f64,
    },
    /// A line of a JSON Lines file lacks a field or has one of the wrong type.
    #[error("{}:{line}: {problem}", path.display())]
    BadExample {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is missing or wrong, and what is expected.
        problem: String,
    },
    /// A chat message has a role other than system, user, assistant.
    #[error("{}:{line}: message {message_idx} has role `{role}`; expected system, user or assistant", path.display())]
    UnknownRole {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// 0-based index of the message.
        message_idx: usize,
        /// The role given.
        role: String,
    },
    /// An assistant message is empty, so the example would train on nothing
    /// but the end-of-turn token.
    #[error("{}:{line}: message {message_idx} (assistant) has empty content", path.display())]
    EmptyAssistant {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// 0-based index of the message.
        message_idx: usize,
    },
    /// An example renders to nothing to learn from.
    #[error("{}:{line}: {problem}", path.display())]
    NoTargets {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Why.
        problem: String,
    },
    /// Preference pairs asked to be packed.
    #[error("{}: preference pairs (prompt/chosen/rejected) cannot be packed: set data.pack = false", path.display())]
    PackedPairs {
        /// The file.
        path: PathBuf,
    },
    /// A text file is not UTF-8.
    #[error("{} is not UTF-8 text (invalid byte at offset {offset}); convert it, or leave it out of the input", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid byte.
        offset: u64,
    },
    /// A file read as text holds a NUL byte: a binary file.
    #[error("{} holds a NUL byte at offset {offset}: it is binary (a token file?), not text; leave it out of the input (a token file trains with data.format = \"u16\" or \"u32\")", path.display())]
    Binary {
        /// The file.
        path: PathBuf,
        /// Byte offset of the NUL.
        offset: u64,
    },
    /// A table file (Parquet, Arrow) cannot be read as one.
    #[error("{}: {problem}", path.display())]
    Table {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong, and what is expected.
        problem: String,
    },
    /// A table lacks the columns of every schema (or of the one forced).
    #[error("{}: no columns of {expected}; its columns are: {found} (rename them, or set data.schema)", path.display())]
    MissingColumns {
        /// The file.
        path: PathBuf,
        /// The column sets that would do.
        expected: String,
        /// The columns it has.
        found: String,
    },
    /// A Parquet column is compressed with a codec this build lacks.
    #[error("{}: column \"{column}\" is compressed with {codec}, which this build does not decode (it reads uncompressed, SNAPPY — pyarrow's default — and GZIP); rewrite it, e.g. pyarrow.parquet.write_table(table, path, compression=\"snappy\")", path.display())]
    UnsupportedCodec {
        /// The file.
        path: PathBuf,
        /// The codec.
        codec: String,
        /// The column.
        column: String,
    },
    /// A mixture of sources cannot be drawn as configured.
    #[error("{problem}")]
    Mixture {
        /// What is wrong, naming the source and the fix.
        problem: String,
    },
}
