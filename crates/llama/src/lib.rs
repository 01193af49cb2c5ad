//! The Llama family (RMSNorm, rotary embeddings, causal grouped-query
//! attention, SwiGLU MLP, tied or untied head) with hand-written forward and
//! backward passes composed from the shared layers of the `nn` crate over
//! flat f32 buffers, LoRA adapters inside the model,
//! and Hugging Face / PEFT checkpoints in both directions.
//!
//! Like `gpt`, this crate knows nothing about training: it implements
//! [`engine::Model`], whose micro-step adds the gradient of the summed loss
//! where the engine's store says. Parameters carry `LlamaForCausalLM`'s
//! names and shapes (`nn.Linear` weights `[out, in]`), adapters PEFT's.

pub mod block;
pub mod config;
pub mod dialect;
pub mod error;
pub mod export;
pub mod frozen;
pub mod frozen_load;
pub mod hf;
pub mod import;
pub mod layout;
pub mod lora;
pub mod model;
pub mod registration;
pub mod shard;

pub use block::ActSizes;
pub use config::RopeScaling;
pub use config::{GemmaBlock, LlamaConfig, LoadBalancing, MoeBlock, MoeNames};
pub use dialect::{Dialect, Names};
pub use error::LlamaError;
pub use frozen::{FrozenBase, FrozenFormat};
pub use layout::{LayerParams, LoraRanges, Proj};
pub use lora::{Adapter, LoraConfig};
pub use model::{Llama, TokenBatch, IGNORE_INDEX};
pub use registration::{LlamaFamily, Registered, FAMILY, LLAMA};
