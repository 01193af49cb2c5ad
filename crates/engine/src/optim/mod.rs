//! Optimizers with PyTorch semantics, updating a flat buffer in place.
//!
//! One file per optimizer: [`adamw`], [`sgd`]. Both are elementwise, so
//! they update any contiguous range of the flat buffer independently — the
//! property ZeRO sharding relies on.

pub mod adamw;
pub mod sgd;

pub use adamw::AdamW;
pub use sgd::Sgd;

use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::offload::OffloadedState;
use adamw::AdamStep;
use sgd::SgdStep;
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

/// Cuts `(start, len, decay)` runs into chunks of at most [`CHUNK`].
pub(crate) fn chunk_runs(runs: impl IntoIterator<Item = (usize, usize, bool)>) -> Vec<(usize, usize, bool)> {
    let mut out = Vec::new();
    for (start, len, decay) in runs {
        let mut at = 0;
        while at < len {
            let n = CHUNK.min(len - at);
            out.push((start + at, n, decay));
            at += n;
        }
    }
    out
}

/// Pieces for a whole flat buffer laid out by `layout` (state indexed like the buffer).
pub fn pieces<'a>(layout: &ParamLayout, params: &'a mut [f32], grads: &'a [f32]) -> Vec<Piece<'a>> {
    let runs = chunk_runs(layout.tensors().iter().map(|t| (t.offset, t.numel(), t.decay)));
    let ranges: Vec<Range<usize>> = runs.iter().map(|&(s, n, _)| s..s + n).collect();
    split(params, &ranges)
        .into_iter()
        .zip(runs)
        .map(|(p, (s, n, decay))| Piece { params: p, grads: &grads[s..s + n], state: s..s + n, decay })
        .collect()
}

/// Disjoint mutable slices of `buf` for ascending, non-overlapping `ranges`.
pub(crate) fn split<'a>(mut buf: &'a mut [f32], ranges: &[Range<usize>]) -> Vec<&'a mut [f32]> {
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

/// One update's constants, whichever optimizer.
enum Step {
    AdamW(AdamStep),
    Sgd(SgdStep),
}

/// Which optimizer (the config's `optim.name`; checkpoints record it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// [`AdamW`].
    AdamW,
    /// [`Sgd`].
    Sgd,
}

impl OptimizerKind {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd => "sgd",
        }
    }

    /// f32 state values kept per parameter (AdamW: both moments; SGD: the
    /// momentum buffer when there is momentum).
    pub fn state_slots(self, momentum: f32) -> u32 {
        match self {
            OptimizerKind::AdamW => 2,
            OptimizerKind::Sgd if momentum > 0.0 => 1,
            OptimizerKind::Sgd => 0,
        }
    }
}

impl std::fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The optimizers the engine knows.
#[derive(Debug, Clone, PartialEq)]
pub enum Optimizer {
    /// AdamW.
    AdamW(AdamW),
    /// SGD with momentum.
    Sgd(Sgd),
}

impl Optimizer {
    /// Applies one update with learning rate `lr` to the gradient
    /// `grad_scale · grads` (the scale folds normalisation and clipping into
    /// the update, saving two passes over the buffer).
    pub fn update(&mut self, layout: &ParamLayout, params: &mut [f32], grads: &[f32], lr: f32, grad_scale: f32) {
        self.update_pieces(pieces(layout, params, grads), lr, grad_scale);
    }

    /// [`Optimizer::update`] over explicit pieces (a ZeRO shard scattered
    /// through a full buffer, say).
    pub fn update_pieces(&mut self, pieces: Vec<Piece<'_>>, lr: f32, grad_scale: f32) {
        match self {
            Optimizer::AdamW(o) => o.update(pieces, lr, grad_scale),
            Optimizer::Sgd(o) => o.update(pieces, lr, grad_scale),
        }
    }

    /// [`Optimizer::update_pieces`] with the state in `disk` instead of
    /// memory: pieces (ascending state ranges) are grouped into windows of
    /// the state, each read, updated with the same arithmetic in the same
    /// order per element, and written back.
    pub fn update_offloaded(
        &mut self,
        pieces: Vec<Piece<'_>>,
        lr: f32,
        grad_scale: f32,
        disk: &mut OffloadedState,
    ) -> Result<(), EngineError> {
        let window = disk.window();
        let step = match self {
            Optimizer::AdamW(o) => Step::AdamW(o.begin(lr, grad_scale)),
            Optimizer::Sgd(o) => Step::Sgd(o.begin(lr, grad_scale)),
        };
        let mut pieces = pieces.into_iter().peekable();
        while let Some(first) = pieces.next() {
            let base = first.state.start;
            let mut group = vec![first];
            while let Some(p) = pieces.next_if(|p| p.state.end - base <= window) {
                group.push(p);
            }
            let end = group.last().map_or(base, |p| p.state.end);
            disk.load(base, end - base)?;
            let mut bufs = disk.buffers().into_iter();
            match &step {
                Step::AdamW(c) => match (bufs.next(), bufs.next()) {
                    (Some(m), Some(v)) => adamw::adam_apply(c, group, base, m, v),
                    _ => return Err(EngineError::MissingState { name: "exp_avg" }),
                },
                Step::Sgd(c) => sgd::sgd_apply(c, group, base, bufs.next()),
            }
            disk.store(base, end - base)?;
        }
        Ok(())
    }

    /// The state slots' names (PyTorch's state keys), in storage order.
    pub fn slot_names(&self) -> Vec<&'static str> {
        self.state_buffers().into_iter().map(|(n, _)| n).collect()
    }

    /// Values per state slot.
    pub fn state_len(&self) -> usize {
        self.state_buffers().first().map_or(0, |(_, b)| b.len())
    }

    /// Frees the in-memory state (it lives elsewhere now, e.g. on disk);
    /// the update count is kept.
    pub fn release_state(&mut self) {
        match self {
            Optimizer::AdamW(o) => {
                o.m = Vec::new();
                o.v = Vec::new();
            }
            Optimizer::Sgd(o) => o.buf = Vec::new(),
        }
    }

    /// Sets the update count (AdamW's `t`) when the state is restored elsewhere.
    pub fn set_n_updates(&mut self, n: u64) {
        match self {
            Optimizer::AdamW(o) => o.n_updates = n,
            Optimizer::Sgd(o) => o.n_updates = n,
        }
    }

    /// The same optimizer with fresh state for `n` parameters (a shard).
    pub fn with_len(&self, n: usize) -> Self {
        match self {
            Optimizer::AdamW(o) => Optimizer::AdamW(AdamW {
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                weight_decay: o.weight_decay,
                m: vec![0.0; n],
                v: vec![0.0; n],
                n_updates: 0,
            }),
            Optimizer::Sgd(o) => Optimizer::Sgd(Sgd {
                momentum: o.momentum,
                nesterov: o.nesterov,
                weight_decay: o.weight_decay,
                buf: if o.momentum > 0.0 { vec![0.0; n] } else { Vec::new() },
                n_updates: 0,
            }),
        }
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> usize {
        4 * self.state_buffers().iter().map(|(_, b)| b.len()).sum::<usize>()
    }

    /// Largest parameter difference the *first* update can produce from two
    /// gradients that differ by up to `tol_g`, at an element with gradient `g`
    /// and parameter `p` — the gradient tolerance carried through the update.
    ///
    /// AdamW's step 1 moves p by `lr·g/(|g|+ε)` (m̂ = g, √v̂ = |g|), whose
    /// sensitivity to g is `lr·ε/(|g|+ε)²`: negligible where |g| ≫ ε, but
    /// ~lr/ε where a gradient cancels to ≈ ε, so rounding there is amplified.
    /// SGD moves p by `lr·g`. Both add 4 ulp of the parameter for rounding.
    pub fn first_step_tolerance(&self, g: f32, p: f32, lr: f32, tol_g: f32) -> f32 {
        let sensitivity = match self {
            Optimizer::AdamW(o) => {
                let d = g.abs() + o.eps;
                lr * o.eps / (d * d)
            }
            Optimizer::Sgd(_) => lr,
        };
        sensitivity * tol_g + 4.0 * f32::EPSILON * p.abs().max(lr)
    }

    /// How many updates have been applied (AdamW's `t`).
    pub fn n_updates(&self) -> u64 {
        match self {
            Optimizer::AdamW(o) => o.n_updates,
            Optimizer::Sgd(o) => o.n_updates,
        }
    }

    /// The state buffers by name (PyTorch's state keys), for checkpoints.
    pub fn state_buffers(&self) -> Vec<(&'static str, &[f32])> {
        match self {
            Optimizer::AdamW(o) => vec![("exp_avg", &o.m), ("exp_avg_sq", &o.v)],
            Optimizer::Sgd(o) if o.momentum > 0.0 => vec![("momentum_buffer", &o.buf)],
            Optimizer::Sgd(_) => Vec::new(),
        }
    }

    /// Restores the state saved by [`Optimizer::state_buffers`] and the update count.
    pub fn restore(
        &mut self,
        n_updates: u64,
        mut get: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        let mut take = |name: &'static str, dst: &mut Vec<f32>| -> Result<(), EngineError> {
            let v = get(name).ok_or(EngineError::MissingState { name })?;
            if v.len() != dst.len() {
                return Err(EngineError::ParamCount { expected: dst.len(), got: v.len() });
            }
            *dst = v;
            Ok(())
        };
        match self {
            Optimizer::AdamW(o) => {
                take("exp_avg", &mut o.m)?;
                take("exp_avg_sq", &mut o.v)?;
                o.n_updates = n_updates;
            }
            Optimizer::Sgd(o) => {
                if o.momentum > 0.0 {
                    take("momentum_buffer", &mut o.buf)?;
                }
                o.n_updates = n_updates;
            }
        }
        Ok(())
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
