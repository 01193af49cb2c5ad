//! The LM head's fused softmax cross-entropy.

use crate::act::fast_exp;
use multiversion::multiversion;
use rayon::prelude::*;

/// Fused softmax + cross-entropy over rows of `v` logits. Writes each row's
/// loss (0 for ignored targets, `target < 0`) into `losses`. With
/// `grad_scale = Some(s)` the logits are overwritten by
/// `s · (softmax − onehot)` (zero rows for ignored targets).
pub fn softmax_cross_entropy(
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[i32],
    v: usize,
    grad_scale: Option<f32>,
) {
    engine::profile::timed(engine::profile::Kind::Loss, || {
        logits.par_chunks_mut(v).zip(losses.par_iter_mut()).zip(targets.par_iter()).for_each(|((row, loss), &tgt)| {
            if tgt < 0 {
                *loss = 0.0;
                if grad_scale.is_some() {
                    row.fill(0.0);
                }
                return;
            }
            *loss = cross_entropy_row(row, tgt as usize, grad_scale);
        });
    })
}

/// One row of [`softmax_cross_entropy`]: the loss, and with a gradient
/// scale the row overwritten by its gradient. The exponentials are summed
/// in f64 ([`sum_f64`]): an f32 running sum over a vocabulary of ~50k loses
/// ~1e-4 of the sum (of the loss, in nats) where many terms are small.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn cross_entropy_row(row: &mut [f32], tgt: usize, grad_scale: Option<f32>) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let logit = row[tgt];
    let sum = match grad_scale {
        None => sum_f64(row, |x| fast_exp(x - max)),
        Some(s) => {
            row.iter_mut().for_each(|x| *x = fast_exp(*x - max));
            let sum = sum_f64(row, |x| x);
            let inv = (1.0 / sum) as f32;
            row.iter_mut().for_each(|x| *x = s * *x * inv);
            row[tgt] -= s;
            sum
        }
    };
    (sum.ln() - (logit - max) as f64) as f32
}

/// Lanes of [`sum_f64`]: one 512-bit register of f64.
const LANES: usize = 8;

/// `Σ f(x)` over `row` in f64: element i into lane i mod [`LANES`], the
/// lanes added in order, so the bits do not depend on the machine.
#[inline(always)]
fn sum_f64(row: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x) as f64;
        }
    }
    for (a, &x) in acc.iter_mut().zip(tail) {
        *a += f(x) as f64;
    }
    acc.iter().sum()
}

/// The per-row losses of the first `n` rows summed in row order (f64,
/// deterministic).
pub fn loss_sum(losses: &[f32], n: usize) -> f64 {
    losses[..n].iter().map(|&l| l as f64).sum()
}
