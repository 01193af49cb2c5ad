//! GPT-2 (pre-LayerNorm, GELU-tanh, learned positions, tied embeddings,
//! biases, causal attention) with hand-written forward and backward kernels
//! over flat f32 buffers, multithreaded with rayon on the `gemm` crate.
//!
//! This crate knows nothing about training: it implements
//! [`engine::Model`], whose micro-step adds the gradient of the summed loss
//! into a flat buffer. Parameters carry Hugging Face GPT-2 names and layouts
//! (`Conv1D` weights stored `[in, out]`), so checkpoints load in
//! `transformers` as they are.

pub mod config;
pub mod error;
pub mod hf;
pub mod kernels;
pub mod model;
pub mod registration;

pub use config::GptConfig;
pub use error::GptError;
pub use model::{init_params, init_segment, Batch, Gpt, IGNORE_INDEX};
pub use registration::{Gpt2, FAMILY};
