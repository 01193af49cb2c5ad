//! Optimizers with PyTorch semantics, updating a flat buffer in place.
//!
//! Both are elementwise, so they update any contiguous range of the flat
//! buffer independently — the property ZeRO sharding relies on.

use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::offload::OffloadedState;
use multiversion::multiversion;
use rayon::prelude::*;
use std::ops::Range;

/// Elements per parallel task of an elementwise update.
pub const CHUNK: usize = 1 << 14;

/// `torch.optim.AdamW`: decoupled weight decay, bias correction, `eps` added
/// after the square root.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    /// β₁.
    pub beta1: f32,
    /// β₂.
    pub beta2: f32,
    /// ε, added to `sqrt(v̂)`.
    pub eps: f32,
    /// Decoupled weight decay λ (applied as `p *= 1 - lr·λ` to decaying tensors).
    pub weight_decay: f32,
    m: Vec<f32>,
    v: Vec<f32>,
    n_updates: u64,
}

impl AdamW {
    /// A fresh optimizer for `n_params` parameters.
    pub fn new(n_params: usize, beta1: f32, beta2: f32, eps: f32, weight_decay: f32) -> Result<Self, EngineError> {
        check_unit("optim.beta1", beta1)?;
        check_unit("optim.beta2", beta2)?;
        check_non_negative("optim.eps", eps)?;
        check_non_negative("optim.weight_decay", weight_decay)?;
        Ok(Self { beta1, beta2, eps, weight_decay, m: vec![0.0; n_params], v: vec![0.0; n_params], n_updates: 0 })
    }

    /// First and second moments.
    pub fn moments(&self) -> (&[f32], &[f32]) {
        (&self.m, &self.v)
    }

    /// Counts the update and fixes its constants.
    fn begin(&mut self, lr: f32, grad_scale: f32) -> AdamStep {
        self.n_updates += 1;
        let t = self.n_updates as i32;
        // Same arithmetic as torch's single-tensor AdamW (foreach=False):
        // step_size = lr / bc1; denom = sqrt(v) / sqrt(bc2) + eps.
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2_sqrt = (1.0 - self.beta2.powi(t)).sqrt();
        AdamStep {
            b1: self.beta1,
            b2: self.beta2,
            eps: self.eps,
            wd: self.weight_decay,
            lr,
            step_size: lr / bc1,
            bc2_sqrt,
            grad_scale,
        }
    }

    fn update(&mut self, pieces: Vec<Piece<'_>>, lr: f32, grad_scale: f32) {
        let c = self.begin(lr, grad_scale);
        adam_apply(&c, pieces, 0, &mut self.m, &mut self.v);
    }
}

/// One AdamW update's constants.
struct AdamStep {
    b1: f32,
    b2: f32,
    eps: f32,
    wd: f32,
    lr: f32,
    step_size: f32,
    bc2_sqrt: f32,
    grad_scale: f32,
}

/// The AdamW update of `pieces` whose state lives in `m`, `v` from state
/// index `base` on (the whole state, or an offloaded window of it).
fn adam_apply(c: &AdamStep, pieces: Vec<Piece<'_>>, base: usize, m: &mut [f32], v: &mut [f32]) {
    let states: Vec<Range<usize>> = pieces.iter().map(|p| p.state.start - base..p.state.end - base).collect();
    let work: Vec<_> = pieces.into_iter().zip(split(m, &states)).zip(split(v, &states)).collect();
    let &AdamStep { b1, b2, eps, wd, lr, step_size, bc2_sqrt, grad_scale } = c;
    // Elementwise, so splitting across threads cannot change a single bit.
    work.into_par_iter().for_each(|((piece, m), v)| {
        let Piece { params: p, grads: g, decay: decays, .. } = piece;
        let decay = if decays { 1.0 - lr * wd } else { 1.0 };
        adam_loop(p, m, v, g, AdamConsts { b1, b2, eps, decay, step_size, bc2_sqrt, grad_scale });
    });
}

#[derive(Clone, Copy)]
struct AdamConsts {
    b1: f32,
    b2: f32,
    eps: f32,
    decay: f32,
    step_size: f32,
    bc2_sqrt: f32,
    grad_scale: f32,
}

/// One piece's AdamW update. Zipped iterators (no bounds checks) so the
/// loop vectorises; compiled for AVX-512 and AVX2 too and picked at run
/// time — the same IEEE operations in the same order (no FMA contraction),
/// so every path gives the same bits.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn adam_loop(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], c: AdamConsts) {
    let AdamConsts { b1, b2, eps, decay, step_size, bc2_sqrt, grad_scale } = c;
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let gi = g * grad_scale;
        *p *= decay;
        *m = b1 * *m + (1.0 - b1) * gi;
        *v = b2 * *v + (1.0 - b2) * gi * gi;
        let denom = v.sqrt() / bc2_sqrt + eps;
        *p -= step_size * *m / denom;
    }
}

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

/// `torch.optim.SGD` with momentum, dampening 0, optional Nesterov, and L2
/// weight decay added to the gradient (PyTorch's SGD semantics).
#[derive(Debug, Clone, PartialEq)]
pub struct Sgd {
    /// Momentum μ (0 disables the buffer).
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient of decaying tensors.
    pub weight_decay: f32,
    buf: Vec<f32>,
    n_updates: u64,
}

impl Sgd {
    /// A fresh optimizer for `n_params` parameters.
    pub fn new(n_params: usize, momentum: f32, nesterov: bool, weight_decay: f32) -> Result<Self, EngineError> {
        check_unit("optim.momentum", momentum)?;
        check_non_negative("optim.weight_decay", weight_decay)?;
        if nesterov && momentum == 0.0 {
            return Err(EngineError::InvalidHyperParameter {
                field: "optim.momentum",
                value: 0.0,
                rule: "Nesterov momentum needs momentum > 0",
            });
        }
        let buf = if momentum > 0.0 { vec![0.0; n_params] } else { Vec::new() };
        Ok(Self { momentum, nesterov, weight_decay, buf, n_updates: 0 })
    }

    /// Counts the update and fixes its constants.
    fn begin(&mut self, lr: f32, grad_scale: f32) -> SgdStep {
        let first = self.n_updates == 0;
        self.n_updates += 1;
        SgdStep { first, mu: self.momentum, nesterov: self.nesterov, wd_all: self.weight_decay, lr, grad_scale }
    }

    fn update(&mut self, pieces: Vec<Piece<'_>>, lr: f32, grad_scale: f32) {
        let c = self.begin(lr, grad_scale);
        let buf = (c.mu > 0.0).then_some(self.buf.as_mut_slice());
        sgd_apply(&c, pieces, 0, buf);
    }
}

/// One SGD update's constants.
struct SgdStep {
    first: bool,
    mu: f32,
    nesterov: bool,
    wd_all: f32,
    lr: f32,
    grad_scale: f32,
}

/// The SGD update of `pieces`; the momentum buffer (if any) holds state
/// from index `base` on (the whole state, or an offloaded window of it).
fn sgd_apply(c: &SgdStep, pieces: Vec<Piece<'_>>, base: usize, buf: Option<&mut [f32]>) {
    let &SgdStep { first, mu, nesterov, wd_all, lr, grad_scale } = c;
    let bufs: Vec<Option<&mut [f32]>> = match buf {
        Some(buf) => {
            let states: Vec<Range<usize>> = pieces.iter().map(|p| p.state.start - base..p.state.end - base).collect();
            split(buf, &states).into_iter().map(Some).collect()
        }
        None => pieces.iter().map(|_| None).collect(),
    };
    let work: Vec<_> = pieces.into_iter().zip(bufs).collect();
    work.into_par_iter().for_each(|(piece, b)| {
        let Piece { params: p, grads: g, decay, .. } = piece;
        let wd = if decay { wd_all } else { 0.0 };
        match b {
            None => {
                for i in 0..p.len() {
                    p[i] -= lr * (g[i] * grad_scale + wd * p[i]);
                }
            }
            Some(b) => {
                for i in 0..p.len() {
                    let d = g[i] * grad_scale + wd * p[i];
                    // torch: the buffer starts as a clone of the first gradient.
                    b[i] = if first { d } else { mu * b[i] + d };
                    let step = if nesterov { d + mu * b[i] } else { b[i] };
                    p[i] -= lr * step;
                }
            }
        }
    });
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
                    (Some(m), Some(v)) => adam_apply(c, group, base, m, v),
                    _ => return Err(EngineError::MissingState { name: "exp_avg" }),
                },
                Step::Sgd(c) => sgd_apply(c, group, base, bufs.next()),
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

fn check_unit(field: &'static str, value: f32) -> Result<(), EngineError> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(EngineError::InvalidHyperParameter { field, value: value as f64, rule: "must be in [0, 1)" })
    }
}

fn check_non_negative(field: &'static str, value: f32) -> Result<(), EngineError> {
    if value >= 0.0 && value.is_finite() {
        Ok(())
    } else {
        Err(EngineError::InvalidHyperParameter { field, value: value as f64, rule: "must be finite and >= 0" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_tensor(decay: bool) -> ParamLayout {
        let mut l = ParamLayout::new();
        l.push("w", &[2], decay);
        l
    }

    /// Reference: PyTorch 2.x
    /// ```python
    /// p = torch.tensor([1.0, -2.0], requires_grad=True)
    /// opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    /// for g in ([0.5, 0.25], [-1.0, 0.125]):
    ///     p.grad = torch.tensor(g); opt.step(); print(p.tolist())
    /// ```
    /// Hand-derived (f64): step 1: m̂ = g, v̂ = g², so p = p(1 - 0.001) - 0.1·sign(g)
    /// → [0.899, -2.098]. Step 2 for p₀: m = 0.9·0.05 + 0.1·(-1) = -0.055,
    /// v = 0.999·0.00025 + 0.001·1 = 0.00124975, m̂ = -0.055/0.19 = -0.289474,
    /// v̂ = 0.00124975/0.001999 = 0.625188, √v̂ = 0.790688;
    /// p = 0.899·0.999 + 0.1·0.289474/0.790688 = 0.898101 + 0.036610 = 0.934711.
    /// For p₁: m = 0.9·0.025 + 0.0125 = 0.035, v = 0.999·0.0000625 + 0.001·0.015625
    /// = 0.0000780625, m̂ = 0.184211, v̂ = 0.0390508, √v̂ = 0.197613;
    /// p = -2.098·0.999 - 0.1·0.184211/0.197613 = -2.095902 - 0.093218 = -2.189120.
    #[test]
    fn adamw_matches_hand_computed_pytorch_steps() {
        let layout = one_tensor(true);
        let mut p = vec![1.0f32, -2.0];
        let mut opt = Optimizer::AdamW(AdamW::new(2, 0.9, 0.999, 1e-8, 0.01).unwrap());
        opt.update(&layout, &mut p, &[0.5, 0.25], 0.1, 1.0);
        assert!((p[0] - 0.899).abs() < 1e-6 && (p[1] + 2.098).abs() < 1e-6, "{p:?}");
        // The second gradient arrives pre-scaled: 0.5 · [-2, 0.25] = [-1, 0.125].
        opt.update(&layout, &mut p, &[-2.0, 0.25], 0.1, 0.5);
        // 1e-5: the hand derivation above is rounded to 6 decimals.
        assert!((p[0] - 0.934711).abs() < 1e-5, "{p:?}");
        assert!((p[1] + 2.189_12).abs() < 1e-5, "{p:?}");
        assert_eq!(opt.n_updates(), 2);
    }

    #[test]
    fn adamw_skips_decay_on_non_decaying_tensors() {
        let layout = one_tensor(false);
        let mut p = vec![1.0f32, -2.0];
        let mut opt = Optimizer::AdamW(AdamW::new(2, 0.9, 0.999, 1e-8, 0.5).unwrap());
        opt.update(&layout, &mut p, &[0.5, 0.25], 0.1, 1.0);
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] + 2.1).abs() < 1e-6, "{p:?}");
    }

    /// torch.optim.SGD(lr=0.1, momentum=0.9, nesterov=...) on grads 1.0 then 2.0 from p=0:
    /// plain momentum: buf=1 → p=-0.1; buf=0.9+2=2.9 → p=-0.39.
    /// Nesterov: step = g + μ·buf: 1+0.9 = 1.9 → p=-0.19; buf=2.9, step=2+2.61=4.61 → p=-0.651.
    #[test]
    fn sgd_momentum_and_nesterov_match_pytorch() {
        let mut l = ParamLayout::new();
        l.push("w", &[1], true);
        for (nesterov, want) in [(false, [-0.1f32, -0.39]), (true, [-0.19, -0.651])] {
            let mut p = vec![0.0f32];
            let mut opt = Optimizer::Sgd(Sgd::new(1, 0.9, nesterov, 0.0).unwrap());
            opt.update(&l, &mut p, &[1.0], 0.1, 1.0);
            assert!((p[0] - want[0]).abs() < 1e-6, "{nesterov} {p:?}");
            opt.update(&l, &mut p, &[2.0], 0.1, 1.0);
            assert!((p[0] - want[1]).abs() < 1e-6, "{nesterov} {p:?}");
        }
    }

    #[test]
    fn bad_hyper_parameters_are_errors() {
        assert!(AdamW::new(1, 1.0, 0.999, 1e-8, 0.0).is_err());
        assert!(AdamW::new(1, 0.9, 0.999, -1.0, 0.0).is_err());
        assert!(Sgd::new(1, 0.0, true, 0.0).is_err());
    }
}
