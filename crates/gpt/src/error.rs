//! The model crate's error type.

use thiserror::Error;

/// What can go wrong in the model or its checkpoint files.
#[derive(Debug, Error)]
pub enum GptError {
    /// A model dimension is unusable.
    #[error("invalid model shape: {0}")]
    InvalidConfig(String),
    /// A setting cannot be applied to this model: the message names the
    /// key and the fix (a frozen base that cannot be packed as asked).
    #[error("{0}")]
    Setting(String),
    /// A batch does not fit the model.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// The parameter store failed (a collective of a sharded store, say).
    #[error("parameter store")]
    Store(#[from] engine::EngineError),
    /// Reading or writing a file failed, or a checkpoint file is malformed
    /// or does not match the model.
    #[error(transparent)]
    File(#[from] nn::io::FileError),
    /// A LoRA configuration or adapter file is unusable.
    #[error(transparent)]
    Lora(#[from] nn::lora::LoraError),
}
