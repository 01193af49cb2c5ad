//! The model-agnostic training step: flat parameter and gradient buffers,
//! gradient accumulation with token-weighted normalisation, global-norm
//! clipping, optimizers and LR schedules — each applied exactly once per
//! optimizer step.
//!
//! The engine never looks inside a model. A [`Model`] adds the gradient of the
//! *summed* loss of one micro-batch into a flat gradient buffer and says how
//! many targets it saw; the [`Trainer`] owns everything that happens at the
//! accumulation boundary.

pub mod alloc;
pub mod batch;
pub mod conformance;
pub mod error;
pub mod layout;
pub mod model;
pub mod offload;
pub mod optim;
pub mod precision;
pub mod recompute;
pub mod rng;
pub mod saved;
pub mod scaler;
pub mod schedule;
pub mod store;
pub mod trainer;
pub mod zero;

pub use batch::{TokenBatch, IGNORE_INDEX};
pub use error::EngineError;
pub use layout::{check_shape_size, ParamLayout, TensorSpec, MAX_PARAMS, MAX_TENSORS};
pub use model::{MicroStepStats, Model};
pub use optim::{AdamW, Optimizer, OptimizerKind, Sgd};
pub use precision::Precision;
pub use recompute::Checkpointing;
pub use saved::SavedTensor;
pub use scaler::{LossScaler, LossScalerConfig};
pub use schedule::{Decay, LrSchedule};
pub use store::{FullStore, GradOut, GradSpace, ParamStore, SegTensor, SegmentGrads, SegmentView};
pub use trainer::{
    clip_grad_norm, grad_norm, LossNormalization, MemoryReport, StepReport, Trainer, TrainerOptions,
    DEFAULT_BUCKET_ELEMS,
};
pub use zero::{Accumulation, Partition, Reduction, Stage, UpdateRun, UpdateSharding, ZeroConfig};
