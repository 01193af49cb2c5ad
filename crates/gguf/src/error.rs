//! The gguf crate's error type.

use std::path::PathBuf;
use thiserror::Error;

/// What can go wrong while reading a GGUF file or mapping it to Hugging Face
/// tensors. Every variant names the file, key or tensor involved.
#[derive(Debug, Error)]
pub enum GgufError {
    /// The file cannot be opened or mapped.
    #[error("cannot read GGUF file {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("{} is not a GGUF file: it starts with {found:?}, not \"GGUF\"", path.display())]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first (up to) four bytes.
        found: Vec<u8>,
    },
    /// A format version this reader does not know (v1 used 32-bit counts;
    /// a big-endian file shows its version byte-swapped).
    #[error("{} is GGUF version {version}; only versions 2 and 3 (little-endian) are supported", path.display())]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version field as read (little-endian).
        version: u32,
    },
    /// The file ends (or a length field points) before a structure is complete.
    #[error("{} is truncated or corrupt: {what} at byte {offset} needs {needed} bytes, the file has {file_len}", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// Bytes it needs.
        needed: u64,
        /// File size.
        file_len: u64,
    },
    /// A structurally invalid field (unknown value type, non-UTF-8 string,
    /// misaligned tensor, bad alignment value, …).
    #[error("{} is invalid: {problem}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A metadata key that is required is absent.
    #[error("{} has no metadata key `{key}`", path.display())]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A metadata value has another type than the one needed.
    #[error("{}: metadata `{key}` is {found}, expected {expected}", path.display())]
    WrongType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What was expected, e.g. "an unsigned integer".
        expected: &'static str,
        /// The value's type as stored.
        found: String,
    },
    /// No tensor of that name.
    #[error("{} has no tensor `{name}`", path.display())]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        name: String,
    },
    /// The tensor's ggml type cannot be dequantised by this reader.
    #[error("tensor `{tensor}` has ggml type {type_name} (id {type_id}); supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1")]
    UnsupportedType {
        /// The tensor name.
        tensor: String,
        /// The ggml type id.
        type_id: u32,
        /// Its name, or "unknown".
        type_name: &'static str,
    },
    /// The model architecture is not one this mapping knows.
    #[error("{}: general.architecture is `{found}`, this loader maps `{expected}` only", path.display())]
    WrongArchitecture {
        /// The file.
        path: PathBuf,
        /// What the loader maps.
        expected: &'static str,
        /// What the file says.
        found: String,
    },
    /// A tensor or hyperparameter the Llama mapping cannot express faithfully.
    #[error("{}: {what}", path.display())]
    UnsupportedModel {
        /// The file.
        path: PathBuf,
        /// What is not supported and why.
        what: String,
    },
    /// Values that cannot be stored as the type asked for (a length that is
    /// not a whole number of blocks, a type without an encoder, NaN or ±∞
    /// in a block format).
    #[error("cannot encode tensor data: {0}")]
    Encode(String),
    /// Writing a file failed.
    #[error("cannot write GGUF file {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}
