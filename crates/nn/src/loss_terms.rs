//! The LM head's loss with label smoothing and PaLM's z-loss: fused
//! softmax + cross-entropy whose gradient also carries those terms.
//!
//! Per target row with logits x (V of them), lse = log Σⱼ exp(xⱼ),
//! p = softmax(x), ε the label smoothing and c the z-loss coefficient:
//!
//! ```text
//! ce    = lse − x_t                                  (the reported loss)
//! aux   = ε·(x_t − mean(x)) + c·lse²                 (what the terms add)
//! total = ce + aux = (1−ε)(lse − x_t) + ε(lse − mean(x)) + c·lse²
//! ∂total/∂xⱼ = pⱼ·(1 + 2c·lse) − (1−ε)·[j = t] − ε/V
//! ```
//!
//! `(1−ε)(lse − x_t) + ε(lse − mean(x))` is PyTorch's
//! `cross_entropy(x, t, label_smoothing=ε)` per row.

use crate::act::fast_exp;
use crate::loss::{loss_sum, softmax_cross_entropy};
use engine::LossTerms;
use rayon::prelude::*;

/// [`softmax_cross_entropy`] with `terms`: `losses` gets each row's plain
/// cross-entropy (0 for ignored targets), and with `grad_scale = Some(s)`
/// the logits are overwritten by `s · ∂(ce + aux)/∂logits`. Returns the
/// sum of the rows' `aux` over the first `n` rows in row order (f64,
/// deterministic). Plain terms run [`softmax_cross_entropy`] itself, so
/// the bits are those of a run without terms.
pub fn softmax_cross_entropy_with(
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[i32],
    v: usize,
    grad_scale: Option<f32>,
    terms: LossTerms,
) -> f64 {
    if terms.is_plain() {
        softmax_cross_entropy(logits, losses, targets, v, grad_scale);
        return 0.0;
    }
    let mut aux = vec![0.0f32; losses.len()];
    engine::profile::timed(engine::profile::Kind::Loss, || {
        logits.par_chunks_mut(v).zip(losses.par_iter_mut()).zip(aux.par_iter_mut()).zip(targets.par_iter()).for_each(
            |(((row, loss), aux), &tgt)| {
                if tgt < 0 {
                    (*loss, *aux) = (0.0, 0.0);
                    if grad_scale.is_some() {
                        row.fill(0.0);
                    }
                    return;
                }
                (*loss, *aux) = row_with_terms(row, tgt as usize, grad_scale, terms);
            },
        );
    });
    loss_sum(&aux, aux.len())
}

/// One row: (ce, aux), and with a gradient scale the row overwritten by
/// its gradient. Sums run in index order in f64 for the row's
/// statistics (the mean logit, lse), so a long vocabulary loses nothing.
fn row_with_terms(row: &mut [f32], tgt: usize, grad_scale: Option<f32>, terms: LossTerms) -> (f32, f32) {
    let v = row.len();
    let (eps, c) = (terms.label_smoothing as f64, terms.z_loss as f64);
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mean = row.iter().map(|&x| x as f64).sum::<f64>() / v as f64;
    let logit = row[tgt] as f64;
    let sum: f64 = row.iter().map(|&x| fast_exp(x - max) as f64).sum();
    let lse = sum.ln() + max as f64;
    let ce = lse - logit;
    let aux = eps * (logit - mean) + c * lse * lse;
    if let Some(s) = grad_scale {
        let s = s as f64;
        let p_scale = s * (1.0 + 2.0 * c * lse) / sum;
        let floor = s * eps / v as f64;
        row.iter_mut().for_each(|x| *x = (p_scale * fast_exp(*x - max) as f64 - floor) as f32);
        row[tgt] -= (s * (1.0 - eps)) as f32;
    }
    (ce as f32, aux as f32)
}
