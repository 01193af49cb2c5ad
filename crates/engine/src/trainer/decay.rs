//! Choosing the tensors with weight decay after construction
//! (`optim.no_decay`): the layout's flags and the update pieces that carry them.

use super::boundary::update_chunks;
use super::Trainer;
use crate::layout::{ParamLayout, TensorSpec};

impl Trainer {
    /// Sets which tensors get weight decay: `decay(tensor)` (by the whole
    /// model's tensor, as this rank's layout names it). Only the flags the
    /// update reads change; parameters and state are untouched.
    pub fn set_decay(&mut self, decay: impl Fn(&TensorSpec) -> bool) {
        self.layout.set_decay(decay);
        self.update = update_chunks(&self.part, &self.layout, self.zero_stage.update_sharding(self.options.precision));
    }

    /// The layout the trainer updates (this rank's, or its stage's).
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }
}
