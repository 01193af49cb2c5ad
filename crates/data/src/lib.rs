//! Tokenizers, corpora and the sampler that implements the batch contract
//! (docs/contract.md). Knows nothing about models or communication.

pub mod bpe;
pub mod chat;
pub mod dataset;
pub mod error;
pub mod gguf_meta;
pub mod mixture;
pub mod order;
pub mod preference;
pub mod sampler;
pub mod samples;
pub mod schemas;
pub mod sft;
pub mod tabular;
pub mod token_file;
pub mod tokenizer;

pub use bpe::{BpeParts, BpeTokenizer, Encoded, PreTokenizer};
pub use chat::{ChatTemplate, Message, Role};
pub use dataset::{
    load_splits, n_val_tokens, open_token_file, text_files, text_of, Corpus, DataFormat, TextFiles, TokenDataset,
};
pub use error::DataError;
pub use mixture::Mixture;
pub use order::{EpochOrder, LAZY_ORDER_FROM};
pub use preference::PairDataset;
pub use sampler::{BatchShape, Sampler};
pub use samples::{Mixed, Samples};
pub use schemas::Schema;
pub use sft::{Example, SftDataset, SftOptions, SftStats};
pub use tabular::{Table, TableData};
pub use token_file::{SourceFile, TokenDtype, TokenFile, TokenFileMeta};
pub use tokenizer::{ByteTokenizer, Tokenizer, TokenizerSpec};
