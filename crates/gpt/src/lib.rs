//! GPT-2 (pre-LayerNorm, GELU-tanh, learned positions, tied embeddings,
//! biases, causal multi-head attention) composed from the shared layers of
//! the `nn` crate, over flat f32 buffers.
//!
//! This crate knows nothing about training: it implements
//! [`engine::Model`], whose micro-step adds the gradient of the summed loss
//! into a flat buffer. Parameters carry Hugging Face GPT-2 names and layouts
//! (`Conv1D` weights stored `[in, out]`), so checkpoints load in
//! `transformers` as they are.

pub mod block;
pub mod config;
pub mod error;
pub mod export;
pub mod frozen;
pub mod frozen_load;
pub mod hf;
pub mod layout;
pub mod lora;
pub mod model;
pub mod registration;
pub mod shard;

pub use block::ActSizes;
pub use config::GptConfig;
pub use error::GptError;
pub use frozen::FrozenBase;
pub use layout::{init_params, init_segment, BlockParams};
pub use model::{Batch, Gpt, IGNORE_INDEX};
pub use registration::{Gpt2, FAMILY};
