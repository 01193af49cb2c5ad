//! The engine's error type.

use thiserror::Error;

/// Everything the engine can refuse or fail at.
#[derive(Debug, Error)]
pub enum EngineError {
    /// A step was asked for with no micro-batches at all.
    #[error("an optimizer step needs at least one micro-batch, got none")]
    NoMicroBatches,
    /// The whole global batch held no target token, so the mean loss is undefined.
    #[error("the global batch of optimizer step {step} holds no target tokens (all targets ignored); the loss and its gradient are undefined — check the data and the ignore mask")]
    NoTargets {
        /// 1-based optimizer step number.
        step: u64,
    },
    /// The parameter buffer does not match the model's layout.
    #[error("parameter buffer has {got} values but the model's layout needs {expected}")]
    ParamCount {
        /// What the layout says.
        expected: usize,
        /// What was handed over.
        got: usize,
    },
    /// The gradient became non-finite (inf/NaN) at the boundary.
    #[error("the accumulated gradient of optimizer step {step} is not finite (norm {norm}); lower the learning rate or enable gradient clipping")]
    NonFiniteGradient {
        /// 1-based optimizer step number.
        step: u64,
        /// The offending norm.
        norm: f64,
    },
    /// A model's micro-step failed.
    #[error("micro-step {micro_step_idx} (0-based) of optimizer step {step} failed")]
    Model {
        /// 1-based optimizer step number.
        step: u64,
        /// 0-based micro-step index inside the step.
        micro_step_idx: usize,
        /// The model's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A collective failed (another rank died, stalled or disagreed).
    #[error("communication failed at optimizer step {step}")]
    Comm {
        /// 1-based optimizer step number.
        step: u64,
        /// The communicator's error.
        #[source]
        source: comm::CommError,
    },
    /// Ranks hold different parameters.
    #[error("parameters differ between ranks after step {step} (checksums {checksums:?}); ranks must start from the same parameters and apply identical updates")]
    RanksDiverged {
        /// Optimizer steps taken.
        step: u64,
        /// Per-rank checksums.
        checksums: Vec<u64>,
    },
    /// A model asked for a segment its layout does not have.
    #[error("segment {seg} does not exist")]
    NoSuchSegment {
        /// The index asked for.
        seg: usize,
    },
    /// An invalid ZeRO setting.
    #[error("invalid ZeRO configuration: {0}")]
    Zero(String),
    /// Under `dist.overlap_comm`, the model asked for a segment again after
    /// its gradient had been sent (a backward that returns to a segment after
    /// a lower one's `done`).
    #[error("optimizer step {step}: the model asked for segment {seg} after its gradient was already sent under dist.overlap_comm (a backward must finish a segment before it finishes a lower one); set dist.overlap_comm = false for this model")]
    Overlap {
        /// 1-based optimizer step number.
        step: u64,
        /// The segment.
        seg: usize,
    },
    /// Under `dist.overlap_comm`, the ranks started their gradient
    /// collectives in different orders: their segment visits differ.
    #[error("optimizer step {step}: the ranks started their gradient collectives in different orders under dist.overlap_comm (the model visits its segments in an order that depends on the data, which the Model contract forbids); nothing was updated; set dist.overlap_comm = false")]
    OverlapOrder {
        /// 1-based optimizer step number.
        step: u64,
    },
    /// A broken invariant of the engine itself.
    #[error("internal error: {0}")]
    Internal(&'static str),
    /// An invalid pipeline setting or a stage that cannot run.
    #[error("pipeline parallelism: {0}")]
    Pipeline(String),
    /// An invalid tensor-parallel setting or a model that cannot split.
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),
    /// Offloaded optimizer state could not be created, read or written.
    #[error("offloaded optimizer state: cannot {op} {}", path.display())]
    Offload {
        /// The file or folder.
        path: std::path::PathBuf,
        /// What was attempted.
        op: &'static str,
        /// The I/O error (ENOSPC, EACCES, a short read, …).
        source: std::io::Error,
    },
    /// A checkpoint lacks an optimizer state buffer.
    #[error("optimizer state `{name}` is missing (was the checkpoint written with another optimizer?)")]
    MissingState {
        /// PyTorch's name of the buffer.
        name: &'static str,
    },
    /// An optimizer hyper-parameter is out of range.
    #[error("invalid optimizer setting `{field}` = {value}: {rule}")]
    InvalidHyperParameter {
        /// Config spelling of the field.
        field: &'static str,
        /// The value given.
        value: f64,
        /// What it must satisfy.
        rule: &'static str,
    },
    /// An optimizer cannot work with this state layout or setting (the
    /// message names the combination and the fix).
    #[error("{0}")]
    Optimizer(String),
    /// A large buffer could not be allocated (the memory limit is tighter
    /// than the plan, or other processes took the memory).
    #[error("cannot allocate {bytes} bytes for {what}: out of memory")]
    OutOfMemory {
        /// The buffer.
        what: &'static str,
        /// Its size.
        bytes: u128,
    },
}
