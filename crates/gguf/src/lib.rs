//! A GGUF reader written for macrobatch: header, every metadata value type,
//! tensor infos, alignment, memory-mapped tensor data, dequantisation of
//! F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 to f32, and the mapping of Llama
//! files to Hugging Face `LlamaForCausalLM` names, shapes and layouts; and
//! the way back: encoders of F32 / F16 / BF16 / Q8_0 / Q4_0 and a streaming
//! writer. Knows nothing about training.

pub mod encode;
pub mod error;
pub mod file;
pub mod llama;
pub mod quant;
pub mod testing;
pub mod value;
pub mod writer;

pub use encode::{file_type, quantize, storage_type};
pub use error::GgufError;
pub use file::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT};
pub use quant::GgmlType;
pub use value::{Value, ValueType};
