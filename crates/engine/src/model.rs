//! The boundary between the engine and a model.

use crate::layout::ParamLayout;
use crate::store::ParamStore;
use std::ops::Range;

/// What one micro-step reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MicroStepStats {
    /// Sum of the per-target losses (not the mean, not scaled).
    pub loss_sum: f64,
    /// Number of targets that contributed (ignored targets excluded).
    pub n_targets: u64,
}

/// A differentiable model over a flat f32 parameter buffer.
///
/// Contract: [`Model::micro_step`] *adds* `grad_scale · ∂(Σ losses)/∂params`
/// into the store's gradient buffers — it never zeroes, never divides by a
/// count and never talks to other ranks. All of that belongs to the engine
/// (the store and the accumulation boundary).
pub trait Model {
    /// One micro-batch of input.
    type Batch;
    /// What can go wrong inside the model.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The named layout of the parameters this model reads.
    fn layout(&self) -> &ParamLayout;

    /// The model's segments: back-to-back ranges covering the layout, in the
    /// order the forward pass first uses them (default: one segment).
    fn segments(&self) -> Vec<Range<usize>> {
        std::iter::once(0..self.layout().n_params()).collect()
    }

    /// Number of targets in `batch` that count towards the loss.
    fn n_targets(&self, batch: &Self::Batch) -> u64;

    /// Forward and backward of one micro-batch, reading parameters from and
    /// adding gradients into `store`, segment by segment; see the trait's contract.
    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Self::Batch,
        grad_scale: f32,
    ) -> Result<MicroStepStats, Self::Error>;

    /// Forward only (evaluation).
    fn loss(&mut self, store: &mut dyn ParamStore, batch: &Self::Batch) -> Result<MicroStepStats, Self::Error>;
}
