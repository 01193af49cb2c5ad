//! The model-agnostic training step: flat parameter and gradient buffers,
//! gradient accumulation with token-weighted normalisation, global-norm
//! clipping, optimizers and LR schedules — each applied exactly once per
//! optimizer step.
//!
//! The engine never looks inside a model. A [`Model`] adds the gradient of the
//! *summed* loss of one micro-batch into a flat gradient buffer and says how
//! many targets it saw; the [`Trainer`] owns everything that happens at the
//! accumulation boundary.
//!
//! A model fitting `y ≈ w·x` with the loss `½(w·x − y)²` per sample, its
//! summed-loss gradient through a [`FullStore`], and one optimizer step over
//! two micro-batches of different sizes with a [`Trainer`]:
//!
//! ```
//! use engine::{EngineError, FullStore, LrSchedule, MicroStepStats, Model, Optimizer};
//! use engine::{ParamLayout, ParamStore, Sgd, TensorSpec, Trainer, TrainerOptions};
//!
//! struct Line {
//!     layout: ParamLayout,
//! }
//!
//! impl Model for Line {
//!     type Batch = Vec<(f32, f32)>;
//!     type Error = EngineError;
//!
//!     fn layout(&self) -> &ParamLayout {
//!         &self.layout
//!     }
//!     fn set_trainable(&mut self, trainable: &dyn Fn(&TensorSpec) -> bool) -> usize {
//!         self.layout.set_trainable(trainable)
//!     }
//!     fn n_targets(&self, batch: &Self::Batch) -> u64 {
//!         batch.len() as u64
//!     }
//!     fn micro_step(
//!         &mut self,
//!         store: &mut dyn ParamStore,
//!         batch: &Self::Batch,
//!         loss_seed: f32,
//!     ) -> Result<MicroStepStats, EngineError> {
//!         let mut view = store.segment(0)?;
//!         let w = view.params[0];
//!         let (mut loss_sum, mut grad) = (0.0, 0.0);
//!         for &(x, y) in batch {
//!             loss_sum += 0.5 * ((w * x - y) as f64).powi(2);
//!             grad += loss_seed * (w * x - y) * x;
//!         }
//!         // Add, or overwrite where this step's gradient is not there yet.
//!         if let Some(g) = view.grads.tensor(0..1) {
//!             g.buf[0] = if g.accumulate { g.buf[0] + grad } else { grad };
//!         }
//!         store.done(0, true)?;
//!         Ok(MicroStepStats { loss_sum, n_targets: batch.len() as u64, ..Default::default() })
//!     }
//!     fn loss(&mut self, store: &mut dyn ParamStore, batch: &Self::Batch) -> Result<MicroStepStats, EngineError> {
//!         let w = store.segment(0)?.params[0];
//!         store.done(0, false)?;
//!         let loss_sum = batch.iter().map(|&(x, y)| 0.5 * ((w * x - y) as f64).powi(2)).sum();
//!         Ok(MicroStepStats { loss_sum, n_targets: batch.len() as u64, ..Default::default() })
//!     }
//! }
//!
//! # fn main() -> Result<(), EngineError> {
//! let mut layout = ParamLayout::new();
//! layout.push("w", &[1], false);
//! let mut model = Line { layout };
//! let micro_batches = vec![vec![(1.0, 2.0), (2.0, 4.0)], vec![(3.0, 6.0)]]; // y = 2x
//!
//! // At w = 0 the summed loss's gradient is Σ −x·y = −28.
//! let mut grad = vec![0.0];
//! let mut store = FullStore::for_model(&model, &[0.0], &mut grad)?;
//! model.micro_step(&mut store, &micro_batches.concat(), 1.0)?;
//! assert_eq!(grad, [-28.0]);
//!
//! // One SGD step (lr 0.1) over both micro-batches follows the mean
//! // gradient over all 3 targets, −28/3, as one batch would.
//! let sgd = Optimizer::Sgd(Sgd::new(1, 0.0, false, 0.0)?);
//! let mut trainer = Trainer::new(&model, vec![0.0], sgd, LrSchedule::constant(0.1), TrainerOptions::default())?;
//! let report = trainer.step(&mut model, &mut comm::SingleProcess::new(), &micro_batches)?;
//! assert_eq!((report.n_micro_steps, report.n_targets), (2, 3));
//! assert!((trainer.params()[0] - 0.1 * 28.0 / 3.0).abs() < 1e-6);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod alloc;
pub mod batch;
pub mod conformance;
pub mod context;
pub mod error;
pub mod layout;
pub mod loss_terms;
pub mod model;
pub mod optim;
pub mod pieces;
pub mod pipeline;
pub mod precision;
pub mod profile;
pub mod recompute;
pub mod rng;
pub mod saved;
pub mod scaler;
pub mod schedule;
pub mod store;
pub mod tensor;
pub mod trainer;
pub mod zero;

pub use batch::{TokenBatch, IGNORE_INDEX};
pub use context::{ContextAttention, ContextRank};
pub use error::EngineError;
pub use layout::{check_shape_size, NonFinite, ParamLayout, TensorSpec, MAX_PARAMS, MAX_TENSORS};
pub use loss_terms::LossTerms;
pub use model::{AuxStats, MicroStepStats, Model, AUX_STATS};
pub use optim::{
    Adafactor, AdafactorConfig, AdamW, AdamW8bit, Lion, Optimizer, OptimizerKind, Sgd, StateRun, StateSize,
};
pub use pieces::{LocalTensor, PieceMap, Run};
pub use pipeline::{Schedule, ScheduleKind, StageLayout, StageSpec, StagedModel};
pub use precision::Precision;
pub use recompute::{Checkpointing, Inner};
pub use saved::SavedTensor;
pub use scaler::{LossScaler, LossScalerConfig};
pub use schedule::{Decay, LrSchedule};
pub use store::{FullStore, GradOut, GradSpace, ParamStore, SegTensor, SegmentGrads, SegmentView};
pub use tensor::{Shard, TensorGroup, TensorShards, TpRank, TpTraffic};
pub use trainer::{
    clip_grad_norm, grad_norm, Held, InitSegment, LossNormalization, MemoryReport, OverlapReport, PipelineReport,
    PipelineStage, StepReport, Trainer, TrainerOptions, DEFAULT_BUCKET_ELEMS,
};
pub use zero::{Accumulation, Partition, Reduction, UpdateRun, UpdateSharding, ZeroConfig, ZeroStage};
