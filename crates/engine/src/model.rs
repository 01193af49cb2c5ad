//! The boundary between the engine and a model (the contract in full:
//! docs/contract.md).

use crate::layout::{ParamLayout, TensorSpec};
use crate::store::ParamStore;
use std::ops::Range;

/// What one micro-step reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MicroStepStats {
    /// Sum of the per-target losses (not the mean, not scaled).
    pub loss_sum: f64,
    /// Number of targets that contributed (ignored targets excluded).
    pub n_targets: u64,
    /// Sum over the targets of what the training loss adds to the
    /// cross-entropy in `loss_sum` (label smoothing, z-loss: a model's
    /// [`crate::LossTerms`]); 0 for plain cross-entropy. The gradient is
    /// that of `loss_sum + aux_sum`.
    pub aux_sum: f64,
}

/// Sums a model may gather besides the loss (an objective's own statistics,
/// e.g. preference rewards), summed over the micro-steps and ranks of a
/// step exactly as the loss is and reported in [`crate::StepReport::aux`].
pub type AuxStats = [f64; AUX_STATS];

/// Number of [`AuxStats`] slots.
pub const AUX_STATS: usize = 4;

/// A differentiable model over a flat f32 parameter buffer.
///
/// Contract: [`Model::micro_step`] computes `loss_seed · ∂(Σ losses)/∂params` and
/// puts it where the store says — adding into a tensor's gradient, or
/// overwriting it where the store grants that ([`crate::GradOut`]) — segment
/// by segment. It never zeroes, never divides by a count and never talks to
/// other ranks: all of that belongs to the engine. A batch without rows
/// runs the same code (the same segment visits) as any other.
pub trait Model {
    /// One micro-batch of input.
    type Batch;
    /// What can go wrong inside the model.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The named layout of the parameters this model reads.
    fn layout(&self) -> &ParamLayout;

    /// Marks each tensor trainable or frozen (in the model's layout); returns
    /// the number of trainable parameters. Call before building a trainer.
    fn set_trainable(&mut self, trainable: &dyn Fn(&TensorSpec) -> bool) -> usize;

    /// The model's segments: back-to-back ranges of whole tensors covering
    /// the layout, in the order the forward pass first uses them (default:
    /// one segment).
    fn segments(&self) -> Vec<Range<usize>> {
        std::iter::once(0..self.layout().n_params()).collect()
    }

    /// Number of targets in `batch` that count towards the loss.
    fn n_targets(&self, batch: &Self::Batch) -> u64;

    /// Forward and backward of one micro-batch, reading parameters from and
    /// putting `loss_seed ·` gradients into `store`, segment by segment; see
    /// the trait's contract. `loss_seed` is the backward pass's starting
    /// gradient `∂L/∂(Σ losses)`: what the engine's normalisation and loss
    /// scale ask this micro-batch's summed loss to be multiplied by (1 for
    /// plain token normalisation, which divides at the boundary).
    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Self::Batch,
        loss_seed: f32,
    ) -> Result<MicroStepStats, Self::Error>;

    /// Forward only (evaluation).
    fn loss(&mut self, store: &mut dyn ParamStore, batch: &Self::Batch) -> Result<MicroStepStats, Self::Error>;

    /// The model's own sums gathered since the last call, and reset
    /// (default: none). The trainer takes them after every micro-step.
    fn take_aux_stats(&mut self) -> AuxStats {
        [0.0; AUX_STATS]
    }

    /// Called by the trainer before the micro-steps of optimizer step
    /// `step` (0-based: the steps taken so far, which a resumed trainer
    /// restores). A model whose training pass draws random numbers
    /// (dropout) keys them on it; the default ignores it.
    fn begin_step(&mut self, _step: u64) {}

    /// How many sums over the whole step's batch (every micro-batch of
    /// every data-parallel rank) the model needs before the first backward
    /// (a mixture of experts' global-batch routing counts); default none.
    /// The trainer then runs [`Model::collect_step_stats`] over the step's
    /// micro-batches, all-reduces the sums and hands them to
    /// [`Model::set_step_stats`] before the first micro-step.
    fn step_stats_len(&self) -> usize {
        0
    }

    /// A forward-only pass over `batch` adding its sums into `into`
    /// (`step_stats_len` long).
    fn collect_step_stats(
        &mut self,
        _store: &mut dyn ParamStore,
        _batch: &Self::Batch,
        _into: &mut [f64],
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// The step's sums over every micro-batch and data-parallel rank.
    fn set_step_stats(&mut self, _stats: &[f64]) {}
}

/// A boxed model is a model: the binary holds one family's model behind a
/// trait object and hands it to the (generic) trainer.
impl<M: Model + ?Sized> Model for Box<M> {
    type Batch = M::Batch;
    type Error = M::Error;

    fn layout(&self) -> &ParamLayout {
        (**self).layout()
    }

    fn set_trainable(&mut self, trainable: &dyn Fn(&TensorSpec) -> bool) -> usize {
        (**self).set_trainable(trainable)
    }

    fn segments(&self) -> Vec<Range<usize>> {
        (**self).segments()
    }

    fn n_targets(&self, batch: &Self::Batch) -> u64 {
        (**self).n_targets(batch)
    }

    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Self::Batch,
        loss_seed: f32,
    ) -> Result<MicroStepStats, Self::Error> {
        (**self).micro_step(store, batch, loss_seed)
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &Self::Batch) -> Result<MicroStepStats, Self::Error> {
        (**self).loss(store, batch)
    }

    fn take_aux_stats(&mut self) -> AuxStats {
        (**self).take_aux_stats()
    }

    fn begin_step(&mut self, step: u64) {
        (**self).begin_step(step)
    }

    fn step_stats_len(&self) -> usize {
        (**self).step_stats_len()
    }

    fn collect_step_stats(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Self::Batch,
        into: &mut [f64],
    ) -> Result<(), Self::Error> {
        (**self).collect_step_stats(store, batch, into)
    }

    fn set_step_stats(&mut self, stats: &[f64]) {
        (**self).set_step_stats(stats)
    }
}

/// A store over a model's own layout and segments (the model knows the
/// store, the store does not know models).
impl<'a> crate::store::FullStore<'a> {
    /// [`crate::store::FullStore::new`] with `model`'s layout and segments.
    pub fn for_model<M: Model>(
        model: &M,
        params: &'a [f32],
        grads: &'a mut [f32],
    ) -> Result<Self, crate::error::EngineError> {
        Self::new(model.layout(), model.segments(), params, grads)
    }

    /// [`crate::store::FullStore::read_only`] with `model`'s layout and segments.
    pub fn read_only_for<M: Model>(model: &M, params: &'a [f32]) -> Result<Self, crate::error::EngineError> {
        Self::read_only(model.layout(), model.segments(), params)
    }
}
