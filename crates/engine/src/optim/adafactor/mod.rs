//! Adafactor as transformers' `transformers.optimization.Adafactor`
//! (Shazeer & Stern 2018): for a tensor of two or more dimensions the second
//! moment is factored into running means of `g² + eps1` over its last
//! dimension (one per row) and over its second-to-last (one per column);
//! other tensors keep it per element. The update `g / √v̂` is divided by
//! `max(1, RMS(update) / clip_threshold)`, scaled by the step size (the
//! schedule's learning rate, or with `relative_step` transformers'
//! `min(1e-2, 1/√t)` — `min(1e-6·t, 1/√t)` with `warmup_init` —, times
//! `max(eps2, RMS(p))` with `scale_parameter`), optionally averaged into a
//! first moment (`beta1`), and subtracted after the weight decay
//! `p -= wd·lr_t·p` (decaying tensors only). β₂ at step t is `1 − t^decay_rate`.
//!
//! Row and column means and the two RMS values are sums over whole
//! tensors. Every rank keeps the second-moment statistics of every tensor
//! (4 bytes per matrix row and column, per vector element), identical on
//! all ranks; the first moment is per element and shards like AdamW's. When
//! this rank's state holds only parts of tensors (ZeRO ≥ 1), it adds its
//! parts of every sum as an [`exact`](super::exact) integer and the ranks
//! sum those ([`SumOverRanks`]): exact sums do not depend on how a tensor
//! is cut, so any ZeRO stage and world size gives the unsharded bits. Sums
//! are exact and rounded once to f64 (torch sums in f32 in its own order:
//! results agree to f32 rounding, not to the bit).
//!
//! One update runs in two parts: `prepare` (the statistics, both
//! collectives, the per-tensor step sizes and clip divisors) and `apply`
//! (the elementwise update, also through windows of an offloaded first
//! moment).

mod geometry;
mod partial;
#[cfg(test)]
mod tests;

use super::exact::SumSq;
use super::{check_non_negative, slices_mut, Piece, StateRuns, SumOverRanks};
use crate::error::EngineError;
pub use geometry::second_moment_len;
use geometry::{factored_dims, row_segments, stats_len, RunState, TensorState};
use partial::{sum_over_ranks, sums, task_sums, tasks, Partial, TaskSums};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// Adafactor's hyper-parameters beyond the learning rate and weight decay
/// (`[optim.adafactor]`), named as transformers' `Adafactor` arguments.
/// Defaults are those Hugging Face `Trainer` uses for `optim="adafactor"`:
/// transformers' own, except `scale_parameter` and `relative_step` off,
/// so the configured learning rate and schedule apply as given.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdafactorConfig {
    /// First-moment decay (`None`: no first moment, transformers' default).
    pub beta1: Option<f32>,
    /// Added to `g²` (transformers' `eps[0]`).
    pub eps1: f32,
    /// Floor of the parameter RMS in `scale_parameter` (`eps[1]`).
    pub eps2: f32,
    /// The update's RMS is clipped to this.
    pub clip_threshold: f32,
    /// β₂ at step t is `1 − t^decay_rate`.
    pub decay_rate: f32,
    /// Scale the step size by `max(eps2, RMS(p))`.
    pub scale_parameter: bool,
    /// Ignore the learning rate and use `min(1e-2, 1/√t)` (transformers' time-dependent step).
    pub relative_step: bool,
    /// With `relative_step`: `min(1e-6·t, 1/√t)` instead.
    pub warmup_init: bool,
}

impl Default for AdafactorConfig {
    fn default() -> Self {
        Self {
            beta1: None,
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            scale_parameter: false,
            relative_step: false,
            warmup_init: false,
        }
    }
}

/// The checkpoint slot of the second-moment statistics (transformers keeps
/// `exp_avg_sq_row`, `exp_avg_sq_col` and, unfactored, `exp_avg_sq`).
pub const STATS_SLOT: &str = "exp_avg_sq_factored";

/// transformers' Adafactor.
#[derive(Debug, Clone, PartialEq)]
pub struct Adafactor {
    /// The hyper-parameters.
    pub config: AdafactorConfig,
    /// Weight decay (decaying tensors only), `p -= wd·lr_t·p`.
    pub weight_decay: f32,
    tensors: Vec<TensorState>,
    runs: Vec<RunState>,
    /// Whether other ranks hold parts of the tensors (sums are then added over ranks).
    shared: bool,
    /// Every tensor's statistics (the same on every rank).
    v: Vec<f32>,
    /// The first moment, per state element of this rank (empty while offloaded).
    m: Vec<f32>,
    len: usize,
    /// Elements of every tensor: the length of a checkpoint's statistics slot.
    full_len: usize,
    m_offloaded: bool,
    pub(super) n_updates: u64,
}

/// What [`Adafactor::prepare`] found for one tensor this rank updates.
pub(super) struct TensorUpdate {
    /// 1/√(row statistic / its mean) per row (L·R), or 1/√v per element.
    row_factor: Vec<f32>,
    /// 1/√(column statistic) per column (L·C); empty when unfactored.
    col_factor: Vec<f32>,
    /// The step size (with the parameter scale).
    lr: f32,
    /// The update's RMS clip divisor.
    clip: f32,
}

/// One update's per-tensor results ([`Adafactor::prepare`]), by tensor.
pub(super) struct Prepared {
    tensors: Vec<Option<TensorUpdate>>,
    grad_scale: f32,
}

impl Adafactor {
    /// A fresh optimizer without state ([`super::Optimizer::for_state`] sizes it).
    pub fn new(config: AdafactorConfig, weight_decay: f32) -> Result<Self, EngineError> {
        if let Some(b1) = config.beta1 {
            super::check_unit("optim.adafactor.beta1", b1)?;
        }
        check_non_negative("optim.adafactor.eps1", config.eps1)?;
        check_non_negative("optim.adafactor.eps2", config.eps2)?;
        check_non_negative("optim.weight_decay", weight_decay)?;
        if !(config.clip_threshold > 0.0 && config.clip_threshold.is_finite()) {
            let value = config.clip_threshold as f64;
            return Err(EngineError::InvalidHyperParameter {
                field: "optim.adafactor.clip_threshold",
                value,
                rule: "must be finite and > 0",
            });
        }
        if config.decay_rate >= 0.0 || config.decay_rate.is_nan() {
            let value = config.decay_rate as f64;
            let rule = "must be < 0 (β₂ = 1 − t^decay_rate must approach 1)";
            return Err(EngineError::InvalidHyperParameter { field: "optim.adafactor.decay_rate", value, rule });
        }
        Ok(Self {
            config,
            weight_decay,
            tensors: Vec::new(),
            runs: Vec::new(),
            shared: false,
            v: Vec::new(),
            m: Vec::new(),
            len: 0,
            full_len: 0,
            m_offloaded: false,
            n_updates: 0,
        })
    }

    /// The same hyper-parameters with zero state for `len` elements laid
    /// out as `runs`.
    pub(super) fn for_state(&self, len: usize, runs: &StateRuns) -> Result<Self, EngineError> {
        let mut tensors = Vec::with_capacity(runs.tensors.len());
        let (mut at, mut offset) = (0, 0);
        for shape in &runs.tensors {
            let (rows, cols) = factored_dims(shape).unwrap_or((0, 1));
            if rows.max(cols) >= super::exact::TERMS_BETWEEN_CARRIES {
                return Err(EngineError::Optimizer(format!(
                    "adafactor: a tensor of shape {shape:?} has a row or column of 2^31 or more elements, more than its exact sums take; use another optim.name"
                )));
            }
            let (n, k) = (shape.iter().product::<usize>(), stats_len(shape));
            tensors.push(TensorState { n, rows, cols, stats: at..at + k, offset });
            at += k;
            offset += n;
        }
        let full_len = offset;
        let whole = runs.runs.len() == tensors.len()
            && runs.runs.iter().enumerate().all(|(i, r)| r.tensor == i && r.is_whole());
        let runs: Vec<RunState> =
            runs.runs.iter().map(|r| RunState { state: r.state.clone(), tensor: r.tensor, at: r.at }).collect();
        let m = if self.config.beta1.is_some() { vec![0.0; len] } else { Vec::new() };
        Ok(Self {
            config: self.config,
            weight_decay: self.weight_decay,
            tensors,
            runs,
            shared: !whole,
            v: vec![0.0; at],
            m,
            len,
            full_len,
            m_offloaded: false,
            n_updates: 0,
        })
    }

    /// Bytes of state held in memory.
    pub fn state_bytes(&self) -> usize {
        4 * (self.v.len() + self.m.len())
    }

    /// The tensor and the index within it of a piece's first element.
    fn locate(&self, piece: &Piece<'_>) -> (usize, usize) {
        let k = self.runs.partition_point(|r| r.state.end <= piece.state.start);
        let r = &self.runs[k.min(self.runs.len().saturating_sub(1))];
        (r.tensor, r.at + (piece.state.start - r.state.start))
    }

    /// The first part of an update: the statistics of `pieces` (this
    /// rank's, ascending), summed over the ranks by `reduce` when other
    /// ranks hold parts of the tensors; updates the second moment and
    /// returns what [`Adafactor::apply`] needs.
    pub(super) fn prepare(
        &mut self,
        pieces: &[Piece<'_>],
        lr: f32,
        grad_scale: f32,
        mut reduce: Option<SumOverRanks<'_>>,
    ) -> Result<Prepared, EngineError> {
        if self.shared && reduce.is_none() {
            return Err(EngineError::Optimizer(
                "adafactor: this rank holds parts of tensors, so its statistics must be summed over the ranks; update through the trainer".into(),
            ));
        }
        self.n_updates += 1;
        let t = self.n_updates as f64;
        let cfg = self.config;
        // transformers' _get_lr without the parameter scale (per tensor below).
        let lr = if cfg.relative_step {
            let min_step = if cfg.warmup_init { 1e-6 * t } else { 1e-2 };
            min_step.min(1.0 / t.sqrt())
        } else {
            lr as f64
        };
        let beta2t = (1.0 - t.powf(cfg.decay_rate as f64)) as f32;
        let gs = grad_scale;
        // This rank's pieces of each tensor: (piece, first element).
        let mut mine: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.tensors.len()];
        for (i, p) in pieces.iter().enumerate() {
            let (t, at) = self.locate(p);
            if let Some(m) = mine.get_mut(t) {
                m.push((i, at));
            }
        }

        // 1. This rank's parts of the row, column and parameter sums, in
        // parallel tasks of whole pieces (exact sums: how they are grouped
        // does not change the bits).
        let tasks = tasks(&mine, pieces);
        let scale_parameter = cfg.scale_parameter;
        let task_sums: Vec<TaskSums> = tasks
            .par_iter()
            .map(|&(t, ref own)| task_sums(&self.tensors[t], &mine[t][own.clone()], pieces, gs, &cfg))
            .collect();
        let mut partials: Vec<Partial> = self.tensors.iter().map(|_| Partial::default()).collect();
        for (&(t, _), task) in tasks.iter().zip(task_sums) {
            partials[t].absorb(&self.tensors[t], task);
        }
        if let (true, Some(r)) = (self.shared, reduce.as_mut()) {
            sum_over_ranks(&self.tensors, &mut partials, cfg.scale_parameter, &mut **r)?;
        }

        // 2. The second moment (every tensor, the same on every rank), and
        // each of this rank's tensors' factors and step size.
        let (b2, eps2) = (beta2t, cfg.eps2);
        let stats: Vec<Range<usize>> = self.tensors.iter().map(|t| t.stats.clone()).collect();
        let work: Vec<_> = self.tensors.iter().zip(slices_mut(&mut self.v, &stats)).zip(&partials).zip(&mine).collect();
        let mut updates: Vec<Option<TensorUpdate>> = work
            .into_par_iter()
            .map(|(((ts, v), part), own)| {
                let n = ts.n as f64;
                if ts.factored() {
                    let (r, cols) = (ts.rows, ts.cols);
                    let (row, col) = v.split_at_mut(ts.all_rows());
                    for (x, s) in row.iter_mut().zip(sums(&part.rows, ts.all_rows())) {
                        *x = *x * b2 + (1.0 - b2) * (s / cols as f64) as f32;
                    }
                    for (x, s) in col.iter_mut().zip(sums(&part.cols, ts.all_cols())) {
                        *x = *x * b2 + (1.0 - b2) * (s / r as f64) as f32;
                    }
                } else {
                    for (x, &u) in v.iter_mut().zip(part.elems.iter().chain(std::iter::repeat(&0.0))) {
                        *x = *x * b2 + (1.0 - b2) * u;
                    }
                }
                if own.is_empty() {
                    return None;
                }
                let rms_p = (part.sq.get().sqrt() / n.sqrt()) as f32;
                let mut lr = lr as f32;
                if scale_parameter {
                    lr *= eps2.max(rms_p);
                }
                let v: &[f32] = v;
                Some(if ts.factored() {
                    let (row, col) = v.split_at(ts.all_rows());
                    let r = ts.rows;
                    let row_factor = row
                        .chunks(r)
                        .flat_map(|rows| {
                            let mean = (rows.iter().map(|&x| x as f64).sum::<f64>() / r as f64) as f32;
                            rows.iter().map(move |&x| 1.0 / (x / mean).sqrt())
                        })
                        .collect();
                    let col_factor = col.iter().map(|&x| 1.0 / x.sqrt()).collect();
                    TensorUpdate { row_factor, col_factor, lr, clip: 1.0 }
                } else {
                    let row_factor = v.iter().map(|&x| 1.0 / x.sqrt()).collect();
                    TensorUpdate { row_factor, col_factor: Vec::new(), lr, clip: 1.0 }
                })
            })
            .collect();
        drop(partials);

        // 3. Σ u² of the unclipped update, for its RMS.
        let task_usq: Vec<SumSq> = tasks
            .par_iter()
            .map(|&(t, ref own)| {
                let mut s = SumSq::default();
                if let Some(up) = &updates[t] {
                    for &(i, at) in &mine[t][own.clone()] {
                        let p = &pieces[i];
                        let mut u = vec![0.0f32; p.grads.len()];
                        for_each_factor(&self.tensors[t], up, at, p.grads.len(), |k, f| u[k] = f * (p.grads[k] * gs));
                        s.merge(&SumSq::of_squares(&u));
                    }
                }
                s
            })
            .collect();
        let mut usq = vec![SumSq::default(); self.tensors.len()];
        for (&(t, _), s) in tasks.iter().zip(&task_usq) {
            usq[t].merge(s);
        }
        if self.shared {
            let w = SumSq::WIRE;
            let mut buf = vec![0.0f64; usq.len() * w];
            usq.iter().zip(buf.chunks_mut(w)).for_each(|(s, b)| s.write(b));
            if let Some(r) = reduce.as_mut() {
                r(&mut buf)?;
            }
            usq = buf.chunks(w).map(SumSq::read).collect();
        }
        for ((up, ts), s) in updates.iter_mut().zip(&self.tensors).zip(&usq) {
            if let Some(up) = up {
                let rms_u = (s.get().sqrt() / (ts.n as f64).sqrt()) as f32;
                up.clip = (rms_u / cfg.clip_threshold).max(1.0);
            }
        }
        Ok(Prepared { tensors: updates, grad_scale })
    }

    /// The second part of an update: `pieces` (a subsequence of those
    /// prepared) moved by the prepared step, with the first moment `m`
    /// (state element `base + i` at `m[i]`) when there is one.
    pub(super) fn apply(&self, prep: &Prepared, pieces: Vec<Piece<'_>>, m: Option<(&mut [f32], usize)>) {
        let cfg = self.config;
        let (gs, wd) = (prep.grad_scale, self.weight_decay);
        let (m, base) = match m {
            Some((m, base)) => (Some(m), base),
            None => (None, 0),
        };
        let ranges: Vec<Range<usize>> = pieces.iter().map(|p| p.state.start - base..p.state.end - base).collect();
        let mut ms: Vec<Option<&mut [f32]>> = match m {
            Some(m) => slices_mut(m, &ranges).into_iter().map(Some).collect(),
            None => Vec::new(),
        };
        ms.resize_with(pieces.len(), || None);
        let located: Vec<(usize, usize)> = pieces.iter().map(|p| self.locate(p)).collect();
        pieces.into_par_iter().zip(ms).zip(located).for_each(|((piece, mut m), (t, at))| {
            let (Some(Some(up)), Some(ts)) = (prep.tensors.get(t), self.tensors.get(t)) else { return };
            let decay = if piece.decay { wd * up.lr } else { 0.0 };
            let (params, grads) = (piece.params, piece.grads);
            for_each_factor(ts, up, at, grads.len(), |k, f| {
                let p = &mut params[k];
                let mut u = f * (grads[k] * gs) / up.clip * up.lr;
                if let (Some(m), Some(b1)) = (m.as_deref_mut(), cfg.beta1) {
                    m[k] = m[k] * b1 + (1.0 - b1) * u;
                    u = m[k];
                }
                if decay != 0.0 {
                    *p += *p * -decay;
                }
                *p -= u;
            });
        });
    }

    /// [`Adafactor::prepare`] then [`Adafactor::apply`] with the first moment in memory.
    pub(super) fn update(
        &mut self,
        pieces: Vec<Piece<'_>>,
        lr: f32,
        grad_scale: f32,
        reduce: Option<SumOverRanks<'_>>,
    ) -> Result<(), EngineError> {
        let prep = self.prepare(&pieces, lr, grad_scale, reduce)?;
        let mut m = std::mem::take(&mut self.m);
        let first = (!m.is_empty()).then_some((&mut m[..], 0));
        self.apply(&prep, pieces, first);
        self.m = m;
        Ok(())
    }

    /// Whether the first moment is kept on disk instead.
    pub(super) fn set_first_moment_offloaded(&mut self) {
        self.m = Vec::new();
        self.m_offloaded = true;
    }

    /// The checkpoint slots: [`STATS_SLOT`] (every tensor's second-moment
    /// statistics at the start of the tensor's own elements, zeros after:
    /// the same on every rank, the same buffer at any ZeRO stage, and
    /// placed with its tensor by any pipeline cut) and, with `beta1`,
    /// `exp_avg` (per state element).
    pub(super) fn slots(&self) -> Vec<(&'static str, Cow<'_, [f32]>)> {
        let mut out = vec![self.stats_slot()];
        out.extend(self.first_moment_slot());
        out
    }

    /// The [`STATS_SLOT`] slot, built from the statistics.
    pub(super) fn stats_slot(&self) -> (&'static str, Cow<'_, [f32]>) {
        let mut v = vec![0.0; self.full_len];
        for t in &self.tensors {
            v[t.offset..t.offset + t.stats.len()].copy_from_slice(&self.v[t.stats.clone()]);
        }
        (STATS_SLOT, Cow::Owned(v))
    }

    /// The `exp_avg` slot (with `beta1`, unless offloaded), without
    /// building the statistics slot.
    pub(super) fn first_moment_slot(&self) -> Option<(&'static str, Cow<'_, [f32]>)> {
        (self.config.beta1.is_some() && !self.m_offloaded).then(|| ("exp_avg", Cow::Borrowed(&self.m[..])))
    }

    /// Restores the slots written by [`Adafactor::slots`] (the statistics
    /// whole, `exp_avg` this rank's; not the first moment while offloaded).
    pub(super) fn restore(
        &mut self,
        mut get: impl FnMut(&'static str) -> Result<Vec<f32>, EngineError>,
    ) -> Result<(), EngineError> {
        let v = match get(STATS_SLOT) {
            Ok(v) => v,
            // The layout before this one: statistics back to back, per rank.
            Err(_) if get("exp_avg_sq").is_ok() => {
                return Err(EngineError::Optimizer(format!(
                    "this checkpoint holds adafactor's statistics in an earlier layout (`exp_avg_sq`, back to back), which this version does not read (it keeps each tensor's inside the tensor's range, `{STATS_SLOT}`); finish the run with the version that wrote it, or start a new run from its weights with --init-from CHECKPOINT_DIR"
                )))
            }
            Err(e) => return Err(e),
        };
        if v.len() != self.full_len {
            return Err(EngineError::ParamCount { expected: self.full_len, got: v.len() });
        }
        for t in &self.tensors {
            self.v[t.stats.clone()].copy_from_slice(&v[t.offset..t.offset + t.stats.len()]);
        }
        if self.config.beta1.is_some() && !self.m_offloaded {
            let m = get("exp_avg")?;
            if m.len() != self.len {
                return Err(EngineError::ParamCount { expected: self.len, got: m.len() });
            }
            self.m = m;
        }
        Ok(())
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

/// Calls `f(k, factor)` for elements `at..at + n` of a tensor (k from 0):
/// 1/√v̂ of each, from a prepared update's factors.
#[inline(always)]
fn for_each_factor(ts: &TensorState, up: &TensorUpdate, at: usize, n: usize, mut f: impl FnMut(usize, f32)) {
    if ts.factored() {
        row_segments(ts, at, n, |k, row, cols| {
            let rf = up.row_factor[row];
            for (j, &cf) in up.col_factor[cols].iter().enumerate() {
                f(k + j, rf * cf);
            }
        });
    } else {
        for (k, &x) in up.row_factor[at..at + n].iter().enumerate() {
            f(k, x);
        }
    }
}
