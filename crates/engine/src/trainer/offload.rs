//! Moving the optimizer state to disk (`dist.offload_optimizer = "disk"`).

use super::Trainer;
use crate::error::EngineError;
use crate::optim::offload::{OffloadedState, WINDOW_ELEMS};

impl Trainer {
    /// Moves the optimizer state to files in `dir` (one per state slot,
    /// removed when the trainer is dropped): each update then streams it
    /// window by window ([`Optimizer::update_offloaded`](crate::Optimizer::update_offloaded)), bit-identical to
    /// the in-memory update. A no-op for an optimizer without state per
    /// element; Adafactor's statistics stay in memory (every rank keeps
    /// all of them, 4 bytes per matrix row and column).
    pub fn offload_optimizer(&mut self, dir: &std::path::Path) -> Result<(), EngineError> {
        self.offload_optimizer_windowed(dir, WINDOW_ELEMS)
    }

    /// [`Trainer::offload_optimizer`] with windows of `window` elements
    /// (tests use small ones to cross many window boundaries).
    pub fn offload_optimizer_windowed(&mut self, dir: &std::path::Path, window: usize) -> Result<(), EngineError> {
        if self.offload.is_some() {
            return Ok(());
        }
        let bufs = self.optimizer.element_state_buffers();
        if bufs.is_empty() {
            return Ok(());
        }
        let names: Vec<&'static str> = bufs.iter().map(|(n, _)| *n).collect();
        let values: Vec<&[f32]> = bufs.iter().map(|(_, b)| &b[..]).collect();
        let disk = OffloadedState::create(dir, &names, self.optimizer.state_len(), window, &values)?;
        drop(values);
        drop(bufs);
        self.optimizer.release_state();
        self.offload = Some(disk);
        Ok(())
    }

    /// The offloaded optimizer state, if any.
    pub fn offloaded(&self) -> Option<&OffloadedState> {
        self.offload.as_ref()
    }
}
