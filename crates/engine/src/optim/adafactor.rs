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
//! Row and column means and the two RMS values need whole tensors, so the
//! state must hold every tensor whole: no ZeRO sharding of the state, no
//! disk offload, no tensor-parallel slices (refused with the fix).
//! Reductions are summed in f64 in element order (torch sums in f32 in its
//! own order: results agree to f32 rounding, not to the bit).

use super::{check_non_negative, split, Piece, StateRun};
use crate::error::EngineError;
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

/// Where one tensor's state lives.
#[derive(Debug, Clone, PartialEq)]
struct TensorState {
    /// Its elements in the state space.
    state: Range<usize>,
    /// Last dimension C (1 for an unfactored tensor).
    cols: usize,
    /// Second-to-last dimension R (0: unfactored).
    rows: usize,
    /// Its second-moment statistics in `v`: L·R row means then L·C column
    /// means (L = the product of the leading dimensions), or one per element.
    stats: Range<usize>,
}

/// Second-moment values kept for the tensors of `runs`.
pub fn second_moment_len(runs: &[StateRun]) -> usize {
    runs.iter().map(|r| stats_len(&r.shape)).sum()
}

fn stats_len(shape: &[usize]) -> usize {
    let n: usize = shape.iter().product();
    match shape.len() {
        0 | 1 => n,
        d => {
            let lead: usize = shape[..d - 2].iter().product();
            lead * (shape[d - 2] + shape[d - 1])
        }
    }
}

/// transformers' Adafactor over whole tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct Adafactor {
    /// The hyper-parameters.
    pub config: AdafactorConfig,
    /// Weight decay (decaying tensors only), `p -= wd·lr_t·p`.
    pub weight_decay: f32,
    tensors: Vec<TensorState>,
    v: Vec<f32>,
    m: Vec<f32>,
    len: usize,
    pub(super) n_updates: u64,
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
        Ok(Self { config, weight_decay, tensors: Vec::new(), v: Vec::new(), m: Vec::new(), len: 0, n_updates: 0 })
    }

    /// The same hyper-parameters with zero state for `len` elements laid
    /// out as `runs`, each of which must be a whole tensor.
    pub(super) fn for_state(&self, len: usize, runs: &[StateRun]) -> Result<Self, EngineError> {
        if let Some(r) = runs.iter().find(|r| !r.is_whole()) {
            return Err(EngineError::Optimizer(format!(
                "adafactor needs whole tensors, but this rank's optimizer state holds elements {}..{} of a tensor of shape {:?} (ZeRO sharding of the state or tensor parallelism); set dist.zero_stage = 0 and dist.tensor_parallel = 1, or use another optim.name",
                r.at,
                r.at + r.state.len(),
                r.shape
            )));
        }
        let mut tensors = Vec::with_capacity(runs.len());
        let mut at = 0;
        for r in runs {
            let d = r.shape.len();
            let (rows, cols) = if d >= 2 { (r.shape[d - 2], r.shape[d - 1]) } else { (0, 1) };
            let n = stats_len(&r.shape);
            tensors.push(TensorState { state: r.state.clone(), rows, cols, stats: at..at + n });
            at += n;
        }
        if at > len {
            return Err(EngineError::Optimizer(format!(
                "adafactor: the factored statistics ({at} values) do not fit the {len}-value checkpoint slot (many tensors with a dimension of 1); use another optim.name"
            )));
        }
        let m = if self.config.beta1.is_some() { vec![0.0; len] } else { Vec::new() };
        Ok(Self { tensors, v: vec![0.0; at], m, len, n_updates: 0, ..self.clone() })
    }

    /// Bytes of state held.
    pub fn state_bytes(&self) -> usize {
        4 * (self.v.len() + self.m.len())
    }

    pub(super) fn update(&mut self, pieces: Vec<Piece<'_>>, lr: f32, grad_scale: f32) {
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
        // Group the pieces (ascending, each inside one tensor) by tensor.
        let mut groups: Vec<Vec<Piece<'_>>> = self.tensors.iter().map(|_| Vec::new()).collect();
        for p in pieces {
            let k = self.tensors.partition_point(|t| t.state.end <= p.state.start);
            if let Some(g) = groups.get_mut(k) {
                g.push(p);
            }
        }
        let stats: Vec<Range<usize>> = self.tensors.iter().map(|t| t.stats.clone()).collect();
        let firsts: Vec<Range<usize>> =
            if self.m.is_empty() { Vec::new() } else { self.tensors.iter().map(|t| t.state.clone()).collect() };
        let mut ms: Vec<Option<&mut [f32]>> = split(&mut self.m, &firsts).into_iter().map(Some).collect();
        ms.resize_with(self.tensors.len(), || None);
        let wd = self.weight_decay;
        let work: Vec<_> = self.tensors.iter().zip(groups).zip(split(&mut self.v, &stats)).zip(ms).collect();
        // Tensors are independent; within one, every sum runs in element order.
        work.into_par_iter().for_each(|(((ts, pieces), v), m)| {
            if pieces.is_empty() {
                return;
            }
            let c = TensorStep { cfg, lr, beta2t, wd, grad_scale };
            tensor_update(&c, ts, pieces, v, m);
        });
    }

    /// The checkpoint slots: `exp_avg_sq` (the second-moment statistics
    /// back to back in tensor order, zero-padded to the state length) and,
    /// with `beta1`, `exp_avg`.
    pub(super) fn slots(&self) -> Vec<(&'static str, Cow<'_, [f32]>)> {
        let mut v = self.v.clone();
        v.resize(self.len, 0.0);
        let mut out = vec![("exp_avg_sq", Cow::Owned(v))];
        if self.config.beta1.is_some() {
            out.push(("exp_avg", Cow::Borrowed(&self.m[..])));
        }
        out
    }

    /// Restores the slots written by [`Adafactor::slots`].
    pub(super) fn restore(
        &mut self,
        mut get: impl FnMut(&'static str) -> Result<Vec<f32>, EngineError>,
    ) -> Result<(), EngineError> {
        let v = get("exp_avg_sq")?;
        if v.len() != self.len {
            return Err(EngineError::ParamCount { expected: self.len, got: v.len() });
        }
        let n = self.v.len();
        self.v.copy_from_slice(&v[..n]);
        if self.config.beta1.is_some() {
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

/// One update's constants for one tensor.
struct TensorStep {
    cfg: AdafactorConfig,
    /// Step size before the parameter scale.
    lr: f64,
    beta2t: f32,
    wd: f32,
    grad_scale: f32,
}

/// Visits every element of a tensor given as pieces, in order: `f(index, p, g)`.
fn each(pieces: &[Piece<'_>], mut f: impl FnMut(usize, f32, f32)) {
    let mut e = 0;
    for piece in pieces {
        for (&p, &g) in piece.params.iter().zip(piece.grads) {
            f(e, p, g);
            e += 1;
        }
    }
}

/// transformers' `Adafactor.step` for one parameter.
fn tensor_update(c: &TensorStep, ts: &TensorState, mut pieces: Vec<Piece<'_>>, v: &mut [f32], m: Option<&mut [f32]>) {
    let (cfg, gs, b2) = (c.cfg, c.grad_scale, c.beta2t);
    let n = ts.state.len();
    let mut sq = 0.0f64;
    each(&pieces, |_, p, _| sq += p as f64 * p as f64);
    // RMS(p) = ‖p‖ / √n.
    let rms_p = (sq.sqrt() / (n as f64).sqrt()) as f32;
    let mut lr = c.lr as f32;
    if cfg.scale_parameter {
        lr *= cfg.eps2.max(rms_p);
    }
    // The per-element factor: 1/√v̂ (factored: rsqrt(row/mean(row))·rsqrt(col)).
    let factor: Box<dyn Fn(usize) -> f32 + Sync> = if ts.rows > 0 {
        let (r, cols) = (ts.rows, ts.cols);
        let lead = n / (r * cols);
        let (mut row_sum, mut col_sum) = (vec![0.0f64; lead * r], vec![0.0f64; lead * cols]);
        each(&pieces, |e, _, g| {
            let gi = g * gs;
            let u = (gi * gi + cfg.eps1) as f64;
            row_sum[e / cols] += u;
            col_sum[(e / (r * cols)) * cols + e % cols] += u;
        });
        let (row, col) = v.split_at_mut(lead * r);
        for (x, s) in row.iter_mut().zip(&row_sum) {
            *x = *x * b2 + (1.0 - b2) * (s / cols as f64) as f32;
        }
        for (x, s) in col.iter_mut().zip(&col_sum) {
            *x = *x * b2 + (1.0 - b2) * (s / r as f64) as f32;
        }
        let r_factor: Vec<f32> = row
            .chunks(r)
            .flat_map(|rows| {
                let mean = (rows.iter().map(|&x| x as f64).sum::<f64>() / r as f64) as f32;
                rows.iter().map(move |&x| 1.0 / (x / mean).sqrt())
            })
            .collect();
        let c_factor: Vec<f32> = col.iter().map(|&x| 1.0 / x.sqrt()).collect();
        Box::new(move |e| r_factor[e / cols] * c_factor[(e / (r * cols)) * cols + e % cols])
    } else {
        each(&pieces, |e, _, g| {
            let gi = g * gs;
            v[e] = v[e] * b2 + (1.0 - b2) * (gi * gi + cfg.eps1);
        });
        let v: &[f32] = v;
        let inv: Vec<f32> = v.iter().map(|&x| 1.0 / x.sqrt()).collect();
        Box::new(move |e| inv[e])
    };
    let mut usq = 0.0f64;
    each(&pieces, |e, _, g| {
        let u = factor(e) * (g * gs);
        usq += u as f64 * u as f64;
    });
    let rms_u = (usq.sqrt() / (n as f64).sqrt()) as f32;
    let clip = (rms_u / cfg.clip_threshold).max(1.0);
    let decay = if pieces.first().is_some_and(|p| p.decay) { c.wd * lr } else { 0.0 };
    let mut m = m;
    let mut e = 0;
    for piece in pieces.iter_mut() {
        for (p, &g) in piece.params.iter_mut().zip(piece.grads) {
            let mut u = factor(e) * (g * gs) / clip * lr;
            if let (Some(m), Some(b1)) = (m.as_deref_mut(), cfg.beta1) {
                m[e] = m[e] * b1 + (1.0 - b1) * u;
                u = m[e];
            }
            if decay != 0.0 {
                *p += *p * -decay;
            }
            *p -= u;
            e += 1;
        }
    }
}
