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
/// sum of the rows' `aux` over the rows in row order (f64,
/// deterministic).
pub fn softmax_cross_entropy_with(
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[i32],
    v: usize,
    grad_scale: Option<f32>,
    terms: LossTerms,
) -> f64 {
    let mut aux = vec![0.0f32; if terms.is_plain() { 0 } else { losses.len() }];
    cross_entropy_rows(logits, (losses, &mut aux), targets, v, grad_scale, terms);
    loss_sum(&aux, aux.len())
}

/// [`softmax_cross_entropy_with`] writing each row's `aux` into `aux`
/// (0 for ignored targets; left empty, and untouched, for plain terms).
/// Plain terms run [`softmax_cross_entropy`] itself, so the bits are those
/// of a run without terms.
pub fn cross_entropy_rows(
    logits: &mut [f32],
    (losses, aux): (&mut [f32], &mut [f32]),
    targets: &[i32],
    v: usize,
    grad_scale: Option<f32>,
    terms: LossTerms,
) {
    if terms.is_plain() {
        return softmax_cross_entropy(logits, losses, targets, v, grad_scale);
    }
    assert_eq!(aux.len(), losses.len(), "cross_entropy_rows: one aux per row");
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

/// Soft-caps logits in place: `z ← cap · tanh(z / cap)` (Gemma 2's
/// `final_logit_softcapping`, as transformers computes it in f32: divide,
/// tanh, multiply).
pub fn soft_cap(logits: &mut [f32], cap: f32) {
    logits.par_chunks_mut(4096).for_each(|xs| xs.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap));
}

/// [`cross_entropy_rows`] of logits that [`soft_cap`] capped at `cap`
/// (`None`: not capped, and the very same call): the same losses and
/// terms, and with a gradient scale the gradient with respect to the
/// logits before the cap, `∂/∂x · (1 − (x/cap)²)` with `x` the capped
/// logit (`tanh' = 1 − tanh²`). Rows run in blocks whose factors wait in a
/// scratch of at most 2²² values.
pub fn capped_cross_entropy_with(
    (logits, cap): (&mut [f32], Option<f32>),
    (losses, aux): (&mut [f32], &mut [f32]),
    targets: &[i32],
    v: usize,
    grad_scale: Option<f32>,
    terms: LossTerms,
) {
    let Some(cap) = cap.filter(|_| grad_scale.is_some()) else {
        return cross_entropy_rows(logits, (losses, aux), targets, v, grad_scale, terms);
    };
    let rows = ((1usize << 22) / v.max(1)).max(1);
    let mut factor = vec![0.0f32; rows.min(losses.len()) * v];
    let aux_rows = if aux.is_empty() { 0 } else { rows };
    let mut aux = aux.chunks_mut(aux_rows.max(1));
    let blocks = logits.chunks_mut(rows * v).zip(losses.chunks_mut(rows)).zip(targets.chunks(rows));
    for ((block, loss), tgt) in blocks {
        let factor = &mut factor[..block.len()];
        factor.par_chunks_mut(4096).zip(block.par_chunks(4096)).for_each(|(f, x)| {
            f.iter_mut().zip(x).for_each(|(f, &x)| *f = 1.0 - (x / cap) * (x / cap));
        });
        let aux = if aux_rows == 0 { &mut [][..] } else { aux.next().expect("one aux block per block of rows") };
        cross_entropy_rows(block, (loss, aux), tgt, v, grad_scale, terms);
        block.par_chunks_mut(4096).zip(factor.par_chunks(4096)).for_each(|(g, f)| {
            g.iter_mut().zip(f).for_each(|(g, &f)| *g *= f);
        });
    }
}
