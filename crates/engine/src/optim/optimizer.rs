//! [`Optimizer`]: the optimizers the engine knows, behind one interface —
//! update (in memory or through an offloaded window), state by name for
//! checkpoints, restore, and sizes.

use super::adamw::{adam_apply, AdamStep};
use super::lion::{lion_apply, LionStep};
use super::sgd::{sgd_apply, SgdStep};
use super::{pieces, Adafactor, AdamW, AdamW8bit, Lion, Piece, Sgd, StateRuns, StateSize, SumOverRanks};
use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::optim::offload::OffloadedState;
use std::borrow::Cow;

/// One update's constants, whichever optimizer streams its state.
enum Step {
    AdamW(AdamStep),
    Sgd(SgdStep),
    Lion(LionStep),
    AdamW8bit(AdamStep),
    Adafactor(super::adafactor::Prepared),
}

/// The optimizers the engine knows.
#[derive(Debug, Clone, PartialEq)]
pub enum Optimizer {
    /// AdamW.
    AdamW(AdamW),
    /// SGD with momentum.
    Sgd(Sgd),
    /// Lion.
    Lion(Lion),
    /// AdamW with blockwise 8-bit moments.
    AdamW8bit(AdamW8bit),
    /// Adafactor.
    Adafactor(Adafactor),
}

impl Optimizer {
    /// Applies one update with learning rate `lr` to the gradient
    /// `grad_scale · grads` (the scale folds normalisation and clipping into
    /// the update, saving two passes over the buffer). The state must have
    /// been sized for `layout` ([`Optimizer::for_layout`]).
    pub fn update(
        &mut self,
        layout: &ParamLayout,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        grad_scale: f32,
    ) -> Result<(), EngineError> {
        self.update_pieces(pieces(layout, params, grads), lr, grad_scale, None)
    }

    /// [`Optimizer::update`] over explicit pieces (a ZeRO shard scattered
    /// through a full buffer, say). `reduce` sums over the ranks whose
    /// states hold parts of the same tensors: Adafactor needs it when this
    /// state holds parts of tensors (an error without it); the elementwise
    /// and blockwise optimizers never call it.
    pub fn update_pieces(
        &mut self,
        pieces: Vec<Piece<'_>>,
        lr: f32,
        grad_scale: f32,
        reduce: Option<SumOverRanks<'_>>,
    ) -> Result<(), EngineError> {
        match self {
            Optimizer::AdamW(o) => o.update(pieces, lr, grad_scale),
            Optimizer::Sgd(o) => o.update(pieces, lr, grad_scale),
            Optimizer::Lion(o) => o.update(pieces, lr, grad_scale),
            Optimizer::AdamW8bit(o) => o.update(pieces, lr, grad_scale),
            Optimizer::Adafactor(o) => return o.update(pieces, lr, grad_scale, reduce),
        }
        Ok(())
    }

    /// [`Optimizer::update_pieces`] with the state in `disk` instead of
    /// memory: pieces (ascending state ranges) are grouped into windows of
    /// the state, each read, updated with the same arithmetic in the same
    /// order per element, and written back. Adafactor keeps its
    /// statistics in memory and streams its first moment.
    pub fn update_offloaded(
        &mut self,
        pieces: Vec<Piece<'_>>,
        lr: f32,
        grad_scale: f32,
        disk: &mut OffloadedState,
        reduce: Option<SumOverRanks<'_>>,
    ) -> Result<(), EngineError> {
        let window = disk.window();
        let step = match self {
            Optimizer::AdamW(o) => Step::AdamW(o.begin(lr, grad_scale)),
            Optimizer::Sgd(o) => Step::Sgd(o.begin(lr, grad_scale)),
            Optimizer::Lion(o) => Step::Lion(o.begin(lr, grad_scale)),
            Optimizer::AdamW8bit(o) => Step::AdamW8bit(o.begin(lr, grad_scale)),
            Optimizer::Adafactor(o) => Step::Adafactor(o.prepare(&pieces, lr, grad_scale, reduce)?),
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
            let bufs = disk.buffers();
            let mut it = bufs.into_iter();
            match (&step, &*self) {
                (Step::AdamW(c), _) => match (it.next(), it.next()) {
                    (Some(m), Some(v)) => adam_apply(c, group, base, m, v),
                    _ => return Err(EngineError::MissingState { name: "exp_avg" }),
                },
                (Step::Sgd(c), _) => sgd_apply(c, group, base, it.next()),
                (Step::Lion(c), _) => match it.next() {
                    Some(m) => lion_apply(c, group, base, m),
                    None => return Err(EngineError::MissingState { name: "exp_avg" }),
                },
                (Step::AdamW8bit(c), Optimizer::AdamW8bit(o)) => o.update_window(c, group, base, it.collect()),
                (Step::AdamW8bit(_), _) => return Err(EngineError::MissingState { name: "exp_avg.code" }),
                (Step::Adafactor(prep), Optimizer::Adafactor(o)) => match it.next() {
                    Some(m) => o.apply(prep, group, Some((m, base))),
                    None => return Err(EngineError::MissingState { name: "exp_avg" }),
                },
                (Step::Adafactor(_), _) => {
                    return Err(EngineError::MissingState { name: super::adafactor::STATS_SLOT })
                }
            }
            disk.store(base, end - base)?;
        }
        Ok(())
    }

    /// Whether slot `name` holds the same values on every rank and is
    /// checkpointed and restored whole, not as this rank's state elements
    /// (Adafactor's statistics). Such a slot stays in memory when the
    /// state is offloaded.
    pub fn is_replicated_slot(&self, name: &str) -> bool {
        matches!(self, Optimizer::Adafactor(_)) && name == super::adafactor::STATS_SLOT
    }

    /// The slots stored per state element (those offloaded to disk).
    pub fn element_slot_names(&self) -> Vec<&'static str> {
        self.slot_names().into_iter().filter(|n| !self.is_replicated_slot(n)).collect()
    }

    /// [`Optimizer::state_buffers`] of the [`Optimizer::element_slot_names`]
    /// only, without building the replicated ones (Adafactor's statistics
    /// slot is one value per parameter: a transient worth skipping).
    pub fn element_state_buffers(&self) -> Vec<(&'static str, Cow<'_, [f32]>)> {
        match self {
            Optimizer::Adafactor(o) => o.first_moment_slot().into_iter().collect(),
            _ => self.state_buffers(),
        }
    }

    /// [`Optimizer::state_buffers`] of the replicated slots only (they stay
    /// in memory when the rest is offloaded).
    pub fn replicated_state_buffers(&self) -> Vec<(&'static str, Cow<'_, [f32]>)> {
        match self {
            Optimizer::Adafactor(o) => vec![o.stats_slot()],
            _ => Vec::new(),
        }
    }

    /// The state slots' names (PyTorch's state keys where PyTorch has the
    /// optimizer), in storage order.
    pub fn slot_names(&self) -> Vec<&'static str> {
        match self {
            Optimizer::AdamW(_) => vec!["exp_avg", "exp_avg_sq"],
            Optimizer::Sgd(o) if o.momentum > 0.0 => vec!["momentum_buffer"],
            Optimizer::Sgd(_) => Vec::new(),
            Optimizer::Lion(_) => vec!["exp_avg"],
            Optimizer::AdamW8bit(_) => super::adamw8bit::SLOTS.to_vec(),
            Optimizer::Adafactor(o) if o.config.beta1.is_some() => vec![super::adafactor::STATS_SLOT, "exp_avg"],
            Optimizer::Adafactor(_) => vec![super::adafactor::STATS_SLOT],
        }
    }

    /// Values per state slot (the state elements).
    pub fn state_len(&self) -> usize {
        match self {
            Optimizer::AdamW(o) => o.m.len(),
            Optimizer::Sgd(o) => o.buf.len(),
            Optimizer::Lion(o) => o.m.len(),
            Optimizer::AdamW8bit(o) => o.len(),
            Optimizer::Adafactor(o) => o.len(),
        }
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
            Optimizer::Lion(o) => o.m = Vec::new(),
            Optimizer::AdamW8bit(o) => o.release_state(),
            Optimizer::Adafactor(o) => o.set_first_moment_offloaded(),
        }
    }

    /// Sets the update count (AdamW's `t`) when the state is restored elsewhere.
    pub fn set_n_updates(&mut self, n: u64) {
        match self {
            Optimizer::AdamW(o) => o.n_updates = n,
            Optimizer::Sgd(o) => o.n_updates = n,
            Optimizer::Lion(o) => o.n_updates = n,
            Optimizer::AdamW8bit(o) => o.adam.n_updates = n,
            Optimizer::Adafactor(o) => o.n_updates = n,
        }
    }

    /// The same optimizer with fresh state for `len` elements (a shard)
    /// laid out as `runs` (what blockwise and factored state is cut by).
    pub fn for_state(&self, len: usize, runs: &StateRuns) -> Result<Self, EngineError> {
        // Field by field, never `..o.clone()`: cloning would copy `self`'s
        // state for a moment, a transient as large as the state itself.
        Ok(match self {
            Optimizer::AdamW(o) => Optimizer::AdamW(AdamW {
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                weight_decay: o.weight_decay,
                m: vec![0.0; len],
                v: vec![0.0; len],
                n_updates: 0,
            }),
            Optimizer::Sgd(o) => Optimizer::Sgd(Sgd {
                momentum: o.momentum,
                nesterov: o.nesterov,
                weight_decay: o.weight_decay,
                buf: if o.momentum > 0.0 { vec![0.0; len] } else { Vec::new() },
                n_updates: 0,
            }),
            Optimizer::Lion(o) => Optimizer::Lion(Lion {
                beta1: o.beta1,
                beta2: o.beta2,
                weight_decay: o.weight_decay,
                m: vec![0.0; len],
                n_updates: 0,
            }),
            Optimizer::AdamW8bit(o) => Optimizer::AdamW8bit(o.for_state(len, &runs.runs)),
            Optimizer::Adafactor(o) => Optimizer::Adafactor(o.for_state(len, runs)?),
        })
    }

    /// [`Optimizer::for_state`] for a whole flat buffer laid out by
    /// `layout` (what [`Optimizer::update`] updates).
    pub fn for_layout(&self, layout: &ParamLayout) -> Result<Self, EngineError> {
        self.for_state(layout.n_params(), &StateRuns::for_layout(layout))
    }

    /// How this optimizer's state is sized.
    pub fn state_size(&self) -> StateSize {
        match self {
            Optimizer::AdamW(_) => StateSize::Slots(2),
            Optimizer::Sgd(o) => StateSize::Slots(usize::from(o.momentum > 0.0)),
            Optimizer::Lion(_) => StateSize::Slots(1),
            Optimizer::AdamW8bit(_) => StateSize::Blockwise8bit,
            Optimizer::Adafactor(o) => StateSize::Factored { first_moment: o.config.beta1.is_some() },
        }
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> usize {
        match self {
            Optimizer::AdamW8bit(o) => o.state_bytes(),
            Optimizer::Adafactor(o) => o.state_bytes(),
            _ => 4 * self.state_buffers().iter().map(|(_, b)| b.len()).sum::<usize>(),
        }
    }

    /// Largest parameter difference the *first* update can produce from two
    /// gradients that differ by up to `tol_g`, at an element with gradient `g`
    /// and parameter `p` — the gradient tolerance carried through the update.
    ///
    /// AdamW's step 1 moves p by `lr·g/(|g|+ε)` (m̂ = g, √v̂ = |g|), whose
    /// sensitivity to g is `lr·ε/(|g|+ε)²`: negligible where |g| ≫ ε, but
    /// ~lr/ε where a gradient cancels to ≈ ε, so rounding there is amplified
    /// (8-bit AdamW's first step is AdamW's). SGD moves p by `lr·g`. Lion
    /// moves p by `lr·sign(g)`: exact unless `|g| ≤ tol_g`, where the sign
    /// may flip (2·lr). Adafactor's first step is `lr·g/√(g²+ε₁)` divided by
    /// the update's RMS: bounded by `lr·max(1, clip)` and flat where |g| is
    /// large, so a sign flip near 0 is the worst case (2·lr there).
    /// All add 4 ulp of the parameter for rounding.
    pub fn first_step_tolerance(&self, g: f32, p: f32, lr: f32, tol_g: f32) -> f32 {
        let adam = |eps: f32| {
            let d = g.abs() + eps;
            lr * eps / (d * d) * tol_g
        };
        let flip = if g.abs() <= tol_g { 2.0 * lr } else { 0.0 };
        let change = match self {
            Optimizer::AdamW(o) => adam(o.eps),
            Optimizer::AdamW8bit(o) => adam(o.adam.eps),
            Optimizer::Sgd(_) => lr * tol_g,
            Optimizer::Lion(_) => flip,
            Optimizer::Adafactor(_) => flip.max(lr * tol_g / g.abs().max(tol_g)),
        };
        change + 4.0 * f32::EPSILON * p.abs().max(lr)
    }

    /// How many updates have been applied (AdamW's `t`).
    pub fn n_updates(&self) -> u64 {
        match self {
            Optimizer::AdamW(o) => o.n_updates,
            Optimizer::Sgd(o) => o.n_updates,
            Optimizer::Lion(o) => o.n_updates,
            Optimizer::AdamW8bit(o) => o.adam.n_updates,
            Optimizer::Adafactor(o) => o.n_updates,
        }
    }

    /// The state by slot name, f32 per state element, for checkpoints and
    /// offload files (PyTorch's state keys where PyTorch has the optimizer;
    /// 8-bit codes and scales, Adafactor's statistics packed, are made here).
    pub fn state_buffers(&self) -> Vec<(&'static str, Cow<'_, [f32]>)> {
        match self {
            Optimizer::AdamW(o) => vec![("exp_avg", Cow::Borrowed(&o.m[..])), ("exp_avg_sq", Cow::Borrowed(&o.v[..]))],
            Optimizer::Sgd(o) if o.momentum > 0.0 => vec![("momentum_buffer", Cow::Borrowed(&o.buf[..]))],
            Optimizer::Sgd(_) => Vec::new(),
            Optimizer::Lion(o) => vec![("exp_avg", Cow::Borrowed(&o.m[..]))],
            Optimizer::AdamW8bit(o) => o.slots(),
            Optimizer::Adafactor(o) => o.slots(),
        }
    }

    /// Restores the state saved by [`Optimizer::state_buffers`] and the update count.
    pub fn restore(
        &mut self,
        n_updates: u64,
        mut get: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        let mut fetch = |name: &'static str| get(name).ok_or(EngineError::MissingState { name });
        let take = |v: Vec<f32>, dst: &mut Vec<f32>| -> Result<(), EngineError> {
            if v.len() != dst.len() {
                return Err(EngineError::ParamCount { expected: dst.len(), got: v.len() });
            }
            *dst = v;
            Ok(())
        };
        match self {
            Optimizer::AdamW(o) => {
                take(fetch("exp_avg")?, &mut o.m)?;
                take(fetch("exp_avg_sq")?, &mut o.v)?;
            }
            Optimizer::Sgd(o) => {
                if o.momentum > 0.0 {
                    take(fetch("momentum_buffer")?, &mut o.buf)?;
                }
            }
            Optimizer::Lion(o) => take(fetch("exp_avg")?, &mut o.m)?,
            Optimizer::AdamW8bit(o) => o.restore(fetch)?,
            Optimizer::Adafactor(o) => o.restore(fetch)?,
        }
        self.set_n_updates(n_updates);
        Ok(())
    }
}
