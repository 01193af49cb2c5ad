//! Shared by the model's integration tests.
#![allow(dead_code)]

use engine::{MicroStepStats, Model, ParamLayout, ParamStore};
use gpt::{Batch, Gpt, GptError};
use std::ops::Range;

/// A GPT whose micro-step calls `tap(store)` after the real one: to count,
/// to watch the communicator, or to inject a fault into the gradient.
pub struct Tapped<F> {
    pub inner: Gpt,
    pub tap: F,
}

impl<F: FnMut(&mut dyn ParamStore) -> Result<(), GptError>> Model for Tapped<F> {
    type Batch = Batch;
    type Error = GptError;
    fn layout(&self) -> &ParamLayout {
        self.inner.layout()
    }
    fn set_trainable(&mut self, trainable: &dyn Fn(&engine::TensorSpec) -> bool) -> usize {
        self.inner.set_trainable(trainable)
    }
    fn segments(&self) -> Vec<Range<usize>> {
        self.inner.segments()
    }
    fn n_targets(&self, b: &Batch) -> u64 {
        b.n_targets()
    }
    fn micro_step(&mut self, store: &mut dyn ParamStore, b: &Batch, s: f32) -> Result<MicroStepStats, GptError> {
        let out = self.inner.micro_step(store, b, s)?;
        (self.tap)(store)?;
        Ok(out)
    }
    fn loss(&mut self, store: &mut dyn ParamStore, b: &Batch) -> Result<MicroStepStats, GptError> {
        self.inner.loss(store, b)
    }
}
