//! The model crate's error type.

use std::path::PathBuf;
use thiserror::Error;

/// What can go wrong in the model or its checkpoint files.
#[derive(Debug, Error)]
pub enum GptError {
    /// A model dimension is unusable.
    #[error("invalid model shape: {0}")]
    InvalidConfig(String),
    /// A batch does not fit the model.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// The parameter store failed (a collective of a sharded store, say).
    #[error("parameter store")]
    Store(#[from] engine::EngineError),
    /// Reading or writing a file failed.
    #[error("{}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing a file through the shared I/O failed.
    #[error(transparent)]
    File(#[from] nn::io::FileError),
    /// A checkpoint file is malformed or does not match the model.
    #[error("{}: {problem}", path.display())]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
}
