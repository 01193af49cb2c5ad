//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
//! Algorithms", Algorithm 2), elementwise over [`Piece`]s:
//!
//! ```text
//! c = β₁·m + (1 − β₁)·g
//! p = p·(1 − lr·λ) − lr·sign(c)        (decoupled weight decay, decaying tensors)
//! m = β₂·m + (1 − β₂)·g
//! ```
//!
//! `sign(0) = 0` as `torch.sign`. One state slot, the momentum `exp_avg`.

use super::{check_non_negative, check_unit, slices_mut, Piece};
use crate::error::EngineError;
use rayon::prelude::*;
use std::ops::Range;

/// Lion with decoupled weight decay. The paper's defaults are β₁ 0.9,
/// β₂ 0.99, and a learning rate 3–10× below AdamW's with a weight decay
/// 3–10× above it (the same `lr·λ` product).
#[derive(Debug, Clone, PartialEq)]
pub struct Lion {
    /// β₁: interpolation of momentum and gradient for the update's sign.
    pub beta1: f32,
    /// β₂: the momentum's decay.
    pub beta2: f32,
    /// Decoupled weight decay λ (applied as `p *= 1 - lr·λ` to decaying tensors).
    pub weight_decay: f32,
    pub(super) m: Vec<f32>,
    pub(super) n_updates: u64,
}

impl Lion {
    /// A fresh optimizer for `n_params` parameters.
    pub fn new(n_params: usize, beta1: f32, beta2: f32, weight_decay: f32) -> Result<Self, EngineError> {
        check_unit("optim.beta1", beta1)?;
        check_unit("optim.beta2", beta2)?;
        check_non_negative("optim.weight_decay", weight_decay)?;
        Ok(Self { beta1, beta2, weight_decay, m: vec![0.0; n_params], n_updates: 0 })
    }

    /// The momentum.
    pub fn momentum(&self) -> &[f32] {
        &self.m
    }

    pub(super) fn begin(&mut self, lr: f32, grad_scale: f32) -> LionStep {
        self.n_updates += 1;
        LionStep { b1: self.beta1, b2: self.beta2, wd: self.weight_decay, lr, grad_scale }
    }

    pub(super) fn update(&mut self, pieces: Vec<Piece<'_>>, lr: f32, grad_scale: f32) {
        let c = self.begin(lr, grad_scale);
        lion_apply(&c, pieces, 0, &mut self.m);
    }
}

/// One Lion update's constants.
pub(super) struct LionStep {
    b1: f32,
    b2: f32,
    wd: f32,
    lr: f32,
    grad_scale: f32,
}

/// The Lion update of `pieces` whose momentum lives in `m` from state index
/// `base` on (the whole state, or an offloaded window of it).
pub(super) fn lion_apply(c: &LionStep, pieces: Vec<Piece<'_>>, base: usize, m: &mut [f32]) {
    let states: Vec<Range<usize>> = pieces.iter().map(|p| p.state.start - base..p.state.end - base).collect();
    let work: Vec<_> = pieces.into_iter().zip(slices_mut(m, &states)).collect();
    let &LionStep { b1, b2, wd, lr, grad_scale } = c;
    // Elementwise: splitting across threads cannot change a bit.
    work.into_par_iter().for_each(|(piece, m)| {
        let Piece { params: p, grads: g, decay, .. } = piece;
        let decay = if decay { 1.0 - lr * wd } else { 1.0 };
        for ((p, m), &g) in p.iter_mut().zip(m.iter_mut()).zip(g) {
            let gi = g * grad_scale;
            let c = b1 * *m + (1.0 - b1) * gi;
            *p *= decay;
            *p -= lr * sign(c);
            *m = b2 * *m + (1.0 - b2) * gi;
        }
    });
}

/// `torch.sign`: −1, 0 or 1 (NaN stays NaN).
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ParamLayout;
    use crate::optim::Optimizer;

    /// The paper's pseudo-code (Algorithm 2) in f64, one parameter at a time.
    fn reference(p: &mut [f64], m: &mut [f64], g: &[f64], (lr, b1, b2, wd): (f64, f64, f64, f64), decay: bool) {
        for i in 0..p.len() {
            let c = b1 * m[i] + (1.0 - b1) * g[i];
            let s = if c > 0.0 {
                1.0
            } else if c < 0.0 {
                -1.0
            } else {
                0.0
            };
            let lam = if decay { wd } else { 0.0 };
            p[i] -= lr * (s + lam * p[i]);
            m[i] = b2 * m[i] + (1.0 - b2) * g[i];
        }
    }

    /// Four steps on fixed gradients (one tensor with decay, one without,
    /// the second gradient arriving pre-scaled, a zero gradient whose sign
    /// is 0) against the pseudo-code. Tolerance 1e-6: each step is one
    /// rounding of `p·(1 − lr·λ)` and one of the subtraction in f32
    /// (≤ 2 ulp of |p| ≤ 2, so ≈ 5e-7 per step at most); the signs agree
    /// because no `c` is within rounding of 0.
    #[test]
    fn updates_equal_the_papers_pseudo_code() {
        let mut layout = ParamLayout::new();
        layout.push("w", &[3], true);
        layout.push("b", &[2], false);
        let (lr, b1, b2, wd) = (0.01, 0.9, 0.99, 0.5);
        let mut p = vec![1.0f32, -2.0, 0.5, 0.25, -0.75];
        let mut p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let mut m64 = [0.0f64; 5];
        let grads = [
            [0.5, -0.25, 0.0, 1.0, -1.0],
            [-2.0, 0.5, 0.125, -0.5, 0.25],
            [0.1, 0.1, -0.3, 0.2, 0.0],
            [-0.05, 0.3, 0.2, -0.1, 0.4],
        ];
        let mut opt = Optimizer::Lion(Lion::new(5, b1 as f32, b2 as f32, wd as f32).unwrap());
        for (k, g) in grads.iter().enumerate() {
            // The engine reads grad_scale · g; step 2 passes 2g with scale 0.5.
            let (gin, scale): (Vec<f32>, f32) = if k == 1 {
                (g.iter().map(|&x| 2.0 * x as f32).collect(), 0.5)
            } else {
                (g.map(|x| x as f32).to_vec(), 1.0)
            };
            opt.update(&layout, &mut p, &gin, lr as f32, scale).unwrap();
            let (pw, pb) = p64.split_at_mut(3);
            let (mw, mb) = m64.split_at_mut(3);
            reference(pw, mw, &g[..3], (lr, b1, b2, wd), true);
            reference(pb, mb, &g[3..], (lr, b1, b2, wd), false);
            for (i, (&a, &b)) in p.iter().zip(&p64).enumerate() {
                assert!((a as f64 - b).abs() < 1e-6, "step {k} element {i}: {a} vs {b}");
            }
        }
        // The zero gradient of step 1 left element 2 alone but for decay.
        assert_eq!(opt.n_updates(), 4);
    }
}
