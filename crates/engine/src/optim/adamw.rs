//! `torch.optim.AdamW`: decoupled weight decay, bias correction, `eps`
//! added after the square root; elementwise over [`Piece`]s.

use super::{check_non_negative, check_unit, slices_mut, Piece};
use crate::error::EngineError;
use multiversion::multiversion;
use rayon::prelude::*;
use std::ops::Range;

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
    pub(super) m: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) n_updates: u64,
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
    pub(super) fn begin(&mut self, lr: f32, grad_scale: f32) -> AdamStep {
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

    pub(super) fn update(&mut self, pieces: Vec<Piece<'_>>, lr: f32, grad_scale: f32) {
        let c = self.begin(lr, grad_scale);
        adam_apply(&c, pieces, 0, &mut self.m, &mut self.v);
    }
}

/// One AdamW update's constants.
pub(super) struct AdamStep {
    pub(super) b1: f32,
    pub(super) b2: f32,
    pub(super) eps: f32,
    pub(super) wd: f32,
    pub(super) lr: f32,
    pub(super) step_size: f32,
    pub(super) bc2_sqrt: f32,
    pub(super) grad_scale: f32,
}

/// The AdamW update of `pieces` whose state lives in `m`, `v` from state
/// index `base` on (the whole state, or an offloaded window of it).
pub(super) fn adam_apply(c: &AdamStep, pieces: Vec<Piece<'_>>, base: usize, m: &mut [f32], v: &mut [f32]) {
    let states: Vec<Range<usize>> = pieces.iter().map(|p| p.state.start - base..p.state.end - base).collect();
    let work: Vec<_> = pieces.into_iter().zip(slices_mut(m, &states)).zip(slices_mut(v, &states)).collect();
    let &AdamStep { b1, b2, eps, wd, lr, step_size, bc2_sqrt, grad_scale } = c;
    // Elementwise, so splitting across threads cannot change a single bit.
    work.into_par_iter().for_each(|((piece, m), v)| {
        let Piece { params: p, grads: g, decay: decays, .. } = piece;
        let decay = if decays { 1.0 - lr * wd } else { 1.0 };
        adam_loop(p, m, v, g, AdamConsts { b1, b2, eps, decay, step_size, bc2_sqrt, grad_scale });
    });
}

#[derive(Clone, Copy)]
pub(super) struct AdamConsts {
    pub(super) b1: f32,
    pub(super) b2: f32,
    pub(super) eps: f32,
    pub(super) decay: f32,
    pub(super) step_size: f32,
    pub(super) bc2_sqrt: f32,
    pub(super) grad_scale: f32,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ParamLayout;
    use crate::optim::Optimizer;

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
        opt.update(&layout, &mut p, &[0.5, 0.25], 0.1, 1.0).unwrap();
        assert!((p[0] - 0.899).abs() < 1e-6 && (p[1] + 2.098).abs() < 1e-6, "{p:?}");
        // The second gradient arrives pre-scaled: 0.5 · [-2, 0.25] = [-1, 0.125].
        opt.update(&layout, &mut p, &[-2.0, 0.25], 0.1, 0.5).unwrap();
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
        opt.update(&layout, &mut p, &[0.5, 0.25], 0.1, 1.0).unwrap();
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] + 2.1).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn bad_hyper_parameters_are_errors() {
        assert!(AdamW::new(1, 1.0, 0.999, 1e-8, 0.0).is_err());
        assert!(AdamW::new(1, 0.9, 0.999, -1.0, 0.0).is_err());
    }
}
