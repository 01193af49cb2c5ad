//! Optimizers updating a flat buffer in place, one file each: [`adamw`]
//! and [`sgd`] (PyTorch semantics), [`lion`] (Chen et al. 2023),
//! [`adamw8bit`] (AdamW with blockwise 8-bit moments, Dettmers et al. 2022)
//! and [`adafactor`] (transformers' `Adafactor`); [`Optimizer`] dispatches.
//!
//! AdamW, SGD and Lion are elementwise, so they update any contiguous range
//! of the flat buffer independently — the property ZeRO sharding relies
//! on. 8-bit AdamW is blockwise: its blocks are cut at multiples of
//! [`adamw8bit::BLOCK`] from each segment's start and a ZeRO partition
//! cuts on those multiples too ([`StateSize::shard_align`]), so a block
//! never spans two ranks. Adafactor's statistics are sums over whole
//! tensors: every rank keeps all of them (they are small), and when its
//! state holds only parts of tensors the ranks add their partial sums as
//! [`exact`] integers, so any cut gives the bits of the uncut update.

pub mod adafactor;
pub mod adamw;
pub mod adamw8bit;
pub mod exact;
pub mod lion;
pub mod offload;
mod optimizer;
pub mod sgd;

pub use adafactor::{Adafactor, AdafactorConfig};
pub use adamw::AdamW;
pub use adamw8bit::AdamW8bit;
pub use lion::Lion;
pub use optimizer::Optimizer;
pub use sgd::Sgd;

use crate::error::EngineError;
use crate::layout::ParamLayout;
use std::ops::Range;

/// Elements per parallel task of an elementwise update.
pub const CHUNK: usize = 1 << 14;

/// A contiguous run of parameters updated together: its values, its
/// gradient, where its optimizer state lives, and its weight-decay flag.
/// Pieces never straddle a tensor and hold at most [`CHUNK`] elements.
pub struct Piece<'a> {
    /// Parameter values to update.
    pub params: &'a mut [f32],
    /// Their (unscaled) gradient.
    pub grads: &'a [f32],
    /// Range of the optimizer state buffers that belongs to these parameters.
    pub state: Range<usize>,
    /// Whether weight decay applies.
    pub decay: bool,
}

/// Cuts a run of `len` elements starting `at` elements past an origin into
/// pieces that end at the origin's multiples of [`CHUNK`] (or the run's
/// end): `(offset in the run, length)`. Cut relative to a segment's start,
/// every piece holds whole 8-bit blocks ([`adamw8bit::BLOCK`] divides
/// [`CHUNK`]).
pub fn aligned_chunks(at: usize, len: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut off = 0;
    std::iter::from_fn(move || {
        if off >= len {
            return None;
        }
        let pos = at + off;
        let n = (CHUNK - pos % CHUNK).min(len - off);
        let out = (off, n);
        off += n;
        Some(out)
    })
}

/// Pieces for a whole flat buffer laid out by `layout` (state indexed like
/// the buffer; one segment: the whole buffer).
pub fn pieces<'a>(layout: &ParamLayout, params: &'a mut [f32], grads: &'a [f32]) -> Vec<Piece<'a>> {
    let runs: Vec<(usize, usize, bool)> = layout
        .tensors()
        .iter()
        .flat_map(|t| aligned_chunks(t.offset, t.numel()).map(move |(o, n)| (t.offset + o, n, t.decay)))
        .collect();
    let ranges: Vec<Range<usize>> = runs.iter().map(|&(s, n, _)| s..s + n).collect();
    slices_mut(params, &ranges)
        .into_iter()
        .zip(runs)
        .map(|(p, (s, n, decay))| Piece { params: p, grads: &grads[s..s + n], state: s..s + n, decay })
        .collect()
}

/// Disjoint mutable slices of `buf` for ascending, non-overlapping `ranges`.
pub(crate) fn slices_mut<'a, T>(mut buf: &'a mut [T], ranges: &[Range<usize>]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut at = 0;
    for r in ranges {
        let rest = std::mem::take(&mut buf);
        let (_, rest) = rest.split_at_mut(r.start - at);
        let (head, tail) = rest.split_at_mut(r.len());
        out.push(head);
        buf = tail;
        at = r.end;
    }
    out
}

/// One contiguous run of this rank's optimizer state that belongs to one
/// tensor (all of it, or the part a ZeRO shard holds): what a blockwise or
/// factored optimizer needs to know about its state beyond its length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateRun {
    /// The state elements.
    pub state: Range<usize>,
    /// The whole tensor's shape (row-major).
    pub shape: Vec<usize>,
    /// Index of the run's first element within its tensor.
    pub at: usize,
    /// Offset of the run's first element from its segment's first parameter.
    pub seg_at: usize,
    /// Index of its tensor in [`StateRuns::tensors`].
    pub tensor: usize,
}

impl StateRun {
    /// Whether the run holds its whole tensor.
    pub fn is_whole(&self) -> bool {
        self.at == 0 && self.state.len() == self.shape.iter().product::<usize>()
    }
}

/// What one rank's optimizer state covers: its runs (ascending state
/// ranges), and the shapes of every tensor the optimizer updates on some
/// rank — the trainable tensors of the model (or pipeline stage), in
/// gradient-space order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateRuns {
    /// This rank's runs.
    pub runs: Vec<StateRun>,
    /// Every updated tensor's shape.
    pub tensors: Vec<Vec<usize>>,
}

impl StateRuns {
    /// The runs of a whole flat buffer laid out by `layout`, state indexed
    /// like the buffer, as [`pieces`] cuts it (one segment: the buffer).
    pub fn for_layout(layout: &ParamLayout) -> Self {
        let runs = layout
            .tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| StateRun { state: t.range(), shape: t.shape.clone(), at: 0, seg_at: t.offset, tensor: i })
            .collect();
        Self { runs, tensors: layout.tensors().iter().map(|t| t.shape.clone()).collect() }
    }

    /// Elements of every updated tensor (the gradient space's length).
    pub fn total_elems(&self) -> usize {
        self.tensors.iter().map(|s| s.iter().product::<usize>()).sum()
    }
}

/// Sums an f64 buffer over the ranks whose optimizer states hold parts of
/// the same tensors (an all-reduce), in place.
pub type SumOverRanks<'a> = &'a mut dyn FnMut(&mut [f64]) -> Result<(), EngineError>;

/// Which optimizer (the config's `optim.name`; checkpoints record it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// [`AdamW`].
    AdamW,
    /// [`Sgd`].
    Sgd,
    /// [`Lion`].
    Lion,
    /// [`AdamW8bit`].
    AdamW8bit,
    /// [`Adafactor`].
    Adafactor,
}

impl OptimizerKind {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Lion => "lion",
            OptimizerKind::AdamW8bit => "adamw8bit",
            OptimizerKind::Adafactor => "adafactor",
        }
    }

    /// f32 state values kept per parameter by the elementwise optimizers
    /// (AdamW: both moments; SGD: the momentum buffer when there is
    /// momentum; Lion: its momentum); 8-bit AdamW and Adafactor are not
    /// counted in slots (see [`OptimizerKind::state_size`]).
    pub fn state_slots(self, momentum: f32) -> u32 {
        match self {
            OptimizerKind::AdamW => 2,
            OptimizerKind::Sgd if momentum > 0.0 => 1,
            OptimizerKind::Sgd => 0,
            OptimizerKind::Lion => 1,
            OptimizerKind::AdamW8bit | OptimizerKind::Adafactor => 0,
        }
    }

    /// How the optimizer's state is sized, for memory plans: `momentum` is
    /// SGD's, `first_moment` whether Adafactor keeps one (its `beta1`).
    pub fn state_size(self, momentum: f32, first_moment: bool) -> StateSize {
        match self {
            OptimizerKind::AdamW8bit => StateSize::Blockwise8bit,
            OptimizerKind::Adafactor => StateSize::Factored { first_moment },
            _ => StateSize::Slots(self.state_slots(momentum) as usize),
        }
    }
}

impl std::fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How an optimizer's state is sized from the state runs it covers: one
/// definition for what an optimizer holds ([`Optimizer::state_bytes`]) and
/// what a memory plan predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateSize {
    /// This many f32 values per element (AdamW 2, SGD with momentum 1, Lion 1).
    Slots(usize),
    /// 8-bit AdamW: two 8-bit codes per element and two f32 scales per block.
    Blockwise8bit,
    /// Adafactor: row and column statistics per matrix, one value per
    /// element of the others, and one more per element with a first moment.
    Factored {
        /// Whether a first moment (`beta1`) is kept.
        first_moment: bool,
    },
}

impl From<usize> for StateSize {
    fn from(slots: usize) -> Self {
        StateSize::Slots(slots)
    }
}

impl StateSize {
    /// Bytes of state in memory for `len` state elements laid out as `runs`.
    pub fn bytes(self, len: usize, runs: &StateRuns) -> usize {
        match self {
            StateSize::Slots(n) => 4 * n * len,
            StateSize::Blockwise8bit => adamw8bit::state_bytes(len, adamw8bit::blocks(&runs.runs).len()),
            StateSize::Factored { first_moment } => self.kept_in_memory(runs) + if first_moment { 4 * len } else { 0 },
        }
    }

    /// Bytes that stay in memory when the state is offloaded to disk:
    /// Adafactor's second-moment statistics (every rank keeps all of them).
    pub fn kept_in_memory(self, runs: &StateRuns) -> usize {
        match self {
            StateSize::Factored { .. } => 4 * adafactor::second_moment_len(&runs.tensors),
            _ => 0,
        }
    }

    /// f32 files per state element when the state is offloaded to disk.
    pub fn offload_slots(self) -> usize {
        match self {
            StateSize::Factored { first_moment } => usize::from(first_moment),
            _ => self.checkpoint_slots(),
        }
    }

    /// f32 values per state element in a checkpoint (the named slots of
    /// [`Optimizer::state_buffers`]).
    pub fn checkpoint_slots(self) -> usize {
        match self {
            StateSize::Slots(n) => n,
            StateSize::Blockwise8bit => adamw8bit::SLOTS.len(),
            StateSize::Factored { first_moment } => 1 + usize::from(first_moment),
        }
    }

    /// The multiple a ZeRO partition cuts each segment on (1: anywhere).
    pub fn shard_align(self) -> usize {
        match self {
            StateSize::Blockwise8bit => adamw8bit::BLOCK,
            _ => 1,
        }
    }
}

pub(super) fn check_unit(field: &'static str, value: f32) -> Result<(), EngineError> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(EngineError::InvalidHyperParameter { field, value: value as f64, rule: "must be in [0, 1)" })
    }
}

pub(super) fn check_non_negative(field: &'static str, value: f32) -> Result<(), EngineError> {
    if value >= 0.0 && value.is_finite() {
        Ok(())
    } else {
        Err(EngineError::InvalidHyperParameter { field, value: value as f64, rule: "must be finite and >= 0" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_chunks_end_on_multiples_of_chunk() {
        let got: Vec<_> = aligned_chunks(100, 2 * CHUNK).collect();
        assert_eq!(got, vec![(0, CHUNK - 100), (CHUNK - 100, CHUNK), (2 * CHUNK - 100, 100)]);
        assert_eq!(aligned_chunks(0, 5).collect::<Vec<_>>(), vec![(0, 5)]);
        assert_eq!(aligned_chunks(7, 0).count(), 0);
    }
}
