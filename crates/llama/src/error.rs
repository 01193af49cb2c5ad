//! The Llama crate's error type: one enum, each variant carrying what a user
//! needs to fix the input (field, tensor name, shapes, path).

use std::path::PathBuf;
use thiserror::Error;

/// What can go wrong in the model, its configuration, its checkpoint files
/// or its LoRA adapters.
#[derive(Debug, Error)]
pub enum LlamaError {
    /// A configuration field is missing, of the wrong type or out of range.
    #[error("invalid Llama config: `{field}` {problem}")]
    InvalidConfig {
        /// The field (our name, or the config.json key when reading one).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The configuration asks for something this implementation does not do.
    #[error("unsupported Llama config: {what}; {hint}")]
    Unsupported {
        /// The feature and its value, e.g. `rope_scaling = {"type": "linear"}`.
        what: String,
        /// What is supported instead.
        hint: String,
    },
    /// A parameter buffer does not match the layout it is read with.
    #[error("the parameter buffer holds {got} values but the {what} needs {expected}")]
    ParamCount {
        /// Which layout: `model` or `base model`.
        what: &'static str,
        /// What the layout needs.
        expected: usize,
        /// What was handed over.
        got: usize,
    },
    /// A batch does not fit the model.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// A tensor the model needs is not in the checkpoint.
    #[error("tensor `{name}` is missing")]
    MissingTensor {
        /// Hugging Face name of the tensor.
        name: String,
    },
    /// Tensors that are not parameters of this model (first few, sorted).
    #[error("unexpected tensors {names:?}: the checkpoint does not hold a Llama of this shape and adapter set")]
    UnexpectedTensors {
        /// Their names.
        names: Vec<String>,
    },
    /// The same tensor was given twice.
    #[error("tensor `{name}` is given twice")]
    DuplicateTensor {
        /// Its name.
        name: String,
    },
    /// A tensor's shape does not match the configuration.
    #[error(
        "tensor `{name}` has shape {got:?} but the config needs {expected:?} (is config.json from the same model?)"
    )]
    ShapeMismatch {
        /// Its name.
        name: String,
        /// Shape in the checkpoint.
        got: Vec<usize>,
        /// Shape the configuration implies.
        expected: Vec<usize>,
    },
    /// `tie_word_embeddings` is true but `lm_head.weight` differs from the
    /// token embedding.
    #[error("tie_word_embeddings is true but `lm_head.weight` differs from `model.embed_tokens.weight` (at element {first_diff}); set tie_word_embeddings to false to load an untied head")]
    TiedHeadMismatch {
        /// First element that differs.
        first_diff: usize,
    },
    /// A tensor is stored in a dtype we do not read.
    #[error("tensor `{name}` is {dtype}; only F32, F16 and BF16 are supported")]
    UnsupportedDtype {
        /// Its name.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// A LoRA setting is invalid.
    /// A shape whose parameter or tensor count is beyond what a layout may
    /// hold (`engine::MAX_PARAMS`, `engine::MAX_TENSORS`).
    #[error("Llama shape too large: {0}")]
    TooLarge(String),
    #[error("invalid LoRA config: `{field}` {problem}")]
    InvalidLora {
        /// The field (`r`, `lora_alpha`, `target_modules`, ...).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The parameter store failed (a collective of a sharded store, say).
    #[error("parameter store")]
    Store(#[from] engine::EngineError),
    /// Writing a file through the shared atomic writer failed.
    #[error("writing a file")]
    Write(#[from] nn::io::FileError),
    /// Reading a file failed, or it is malformed.
    #[error(transparent)]
    Read(nn::io::FileError),
    /// A GGUF file could not be read (its error names the file).
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    /// An error about the contents of a file (a tensor, a config field).
    #[error("{}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        #[source]
        source: Box<LlamaError>,
    },
}

impl From<nn::lora::LoraError> for LlamaError {
    fn from(e: nn::lora::LoraError) -> Self {
        use nn::lora::LoraError as E;
        match e {
            E::Invalid { field, problem } => LlamaError::InvalidLora { field, problem },
            E::File(f) => LlamaError::Read(f),
            E::InFile { path, source } => LlamaError::InFile { path, source: Box::new((*source).into()) },
            E::Missing { name } => LlamaError::MissingTensor { name },
            E::Shape { name, got, expected } => LlamaError::ShapeMismatch { name, got, expected },
            E::Unexpected { names } => LlamaError::UnexpectedTensors { names },
        }
    }
}

impl LlamaError {
    /// This error, located in file `path`.
    pub fn in_file(self, path: &std::path::Path) -> Self {
        LlamaError::InFile { path: path.to_path_buf(), source: Box::new(self) }
    }

    /// `Err(ParamCount)` unless `got == expected`.
    pub(crate) fn check_count(what: &'static str, expected: usize, got: usize) -> Result<(), Self> {
        if got == expected {
            Ok(())
        } else {
            Err(LlamaError::ParamCount { what, expected, got })
        }
    }

    pub(crate) fn config(field: &str, problem: impl Into<String>) -> Self {
        LlamaError::InvalidConfig { field: field.to_string(), problem: problem.into() }
    }

    pub(crate) fn unsupported(what: impl Into<String>, hint: impl Into<String>) -> Self {
        LlamaError::Unsupported { what: what.into(), hint: hint.into() }
    }

    pub(crate) fn lora(field: &str, problem: impl Into<String>) -> Self {
        LlamaError::InvalidLora { field: field.to_string(), problem: problem.into() }
    }
}
