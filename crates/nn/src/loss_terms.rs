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
    let rows = |x: &mut [f32], out: (&mut [f32], &mut [f32]), t: &[i32]| {
        cross_entropy_rows(x, out, t, v, grad_scale, terms);
        Ok::<(), std::convert::Infallible>(())
    };
    let Ok(()) = capped((logits, cap), (losses, aux), (targets, v), grad_scale.is_some(), rows);
}

/// `ce(logits, (losses, aux), targets)` over rows of `v` logits capped at
/// `cap`, and with `grad` the gradient it wrote taken back through the
/// cap (see [`capped_cross_entropy_with`]); blocks of rows, the same on
/// every rank of a vocabulary split (whose `v` is the same).
fn capped<E>(
    (logits, cap): (&mut [f32], Option<f32>),
    (losses, aux): (&mut [f32], &mut [f32]),
    (targets, v): (&[i32], usize),
    grad: bool,
    mut ce: impl FnMut(&mut [f32], (&mut [f32], &mut [f32]), &[i32]) -> Result<(), E>,
) -> Result<(), E> {
    let Some(cap) = cap.filter(|_| grad) else {
        return ce(logits, (losses, aux), targets);
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
        ce(block, (loss, aux), tgt)?;
        block.par_chunks_mut(4096).zip(factor.par_chunks(4096)).for_each(|(g, f)| {
            g.iter_mut().zip(f).for_each(|(g, &f)| *g *= f);
        });
    }
    Ok(())
}

/// This rank's slice of a vocabulary split over the `ranks` of a
/// tensor-parallel group: the logits of columns `first .. first + v` of
/// `whole`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabSlice {
    /// The first vocabulary id held here.
    pub first: usize,
    /// The whole vocabulary V.
    pub whole: usize,
    /// This rank's place in the group.
    pub rank: usize,
    /// Ranks in the group.
    pub ranks: usize,
}

/// What each rank tells the others of a row: its slice's max logit, `Σ
/// exp(x − max)` and `Σ x` (f64, each as two f32: the value rounded and
/// its remainder) and the target's logit (0 where another rank holds it);
/// a row's all-reduce holds this many f32 per rank.
pub const SPLIT_STATS: usize = 6;

/// [`capped_cross_entropy_with`] where each rank holds the logits of its
/// slice of the vocabulary only (Megatron-LM's vocab-parallel
/// cross-entropy): each row's max, sum of exponentials, sum of logits and
/// target logit over the slice go into the rank's place of a zeroed
/// `[rows, ranks, 6]` buffer, which `sum` adds over the group (every other
/// place zero: the same bits on every rank), and each rank combines the
/// places in rank order, so all ranks get the same losses and terms. With
/// a gradient scale the slice's logits are overwritten by their gradient.
/// `targets` are ids of the whole vocabulary.
#[allow(clippy::too_many_arguments)]
pub fn split_cross_entropy_with<E>(
    (logits, cap): (&mut [f32], Option<f32>),
    (losses, aux): (&mut [f32], &mut [f32]),
    targets: &[i32],
    slice: VocabSlice,
    v: usize,
    grad_scale: Option<f32>,
    terms: LossTerms,
    sum: &mut dyn FnMut(&mut [f32]) -> Result<(), E>,
) -> Result<(), E> {
    let rows = |x: &mut [f32], out: (&mut [f32], &mut [f32]), t: &[i32]| {
        split_rows(x, out, (t, v), slice, (grad_scale, terms), &mut *sum)
    };
    capped((logits, cap), (losses, aux), (targets, v), grad_scale.is_some(), rows)
}

/// One block of [`split_cross_entropy_with`], without the cap.
fn split_rows<E>(
    logits: &mut [f32],
    (losses, aux): (&mut [f32], &mut [f32]),
    (targets, v): (&[i32], usize),
    slice: VocabSlice,
    (grad_scale, terms): (Option<f32>, LossTerms),
    sum: &mut dyn FnMut(&mut [f32]) -> Result<(), E>,
) -> Result<(), E> {
    let n = losses.len();
    let (t, width) = (slice.ranks, slice.ranks * SPLIT_STATS);
    let mut stats = vec![0.0f32; n * width];
    let here = |tgt: i32| (tgt >= 0).then(|| (tgt as usize).wrapping_sub(slice.first)).filter(|&j| j < v);
    let split = |x: f64| -> [f32; 2] { [x as f32, (x - x as f32 as f64) as f32] };
    engine::profile::timed(engine::profile::Kind::Loss, || {
        stats.par_chunks_mut(width).zip(logits.par_chunks(v)).zip(targets.par_iter()).for_each(|((st, row), &tgt)| {
            if tgt < 0 {
                return;
            }
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let exps: f64 = row.iter().map(|&x| fast_exp(x - max) as f64).sum();
            let xs: f64 = row.iter().map(|&x| x as f64).sum();
            let [e0, e1] = split(exps);
            let [x0, x1] = split(xs);
            let logit = here(tgt).map_or(0.0, |j| row[j]);
            st[slice.rank * SPLIT_STATS..][..SPLIT_STATS].copy_from_slice(&[max, e0, e1, x0, x1, logit]);
        })
    });
    if n > 0 {
        sum(&mut stats)?;
    }
    let (eps, c) = (terms.label_smoothing as f64, terms.z_loss as f64);
    engine::profile::timed(engine::profile::Kind::Loss, || {
        let aux_rows = if aux.is_empty() { None } else { Some(aux) };
        let per_row =
            logits.par_chunks_mut(v).zip(losses.par_iter_mut()).zip(targets.par_iter()).zip(stats.par_chunks(width));
        let out: Vec<f32> = per_row
            .map(|(((row, loss), &tgt), st)| {
                if tgt < 0 {
                    *loss = 0.0;
                    if grad_scale.is_some() {
                        row.fill(0.0);
                    }
                    return 0.0;
                }
                let places = || st.chunks(SPLIT_STATS).take(t);
                let max = places().fold(f32::NEG_INFINITY, |m, p| m.max(p[0]));
                let total: f64 = places().map(|p| (p[1] as f64 + p[2] as f64) * (p[0] as f64 - max as f64).exp()).sum();
                let mean = places().map(|p| p[3] as f64 + p[4] as f64).sum::<f64>() / slice.whole as f64;
                let logit = places().map(|p| p[5] as f64).sum::<f64>();
                let lse = total.ln() + max as f64;
                let ce = lse - logit;
                *loss = ce as f32;
                if let Some(s) = grad_scale {
                    let s = s as f64;
                    let p_scale = s * (1.0 + 2.0 * c * lse) / total;
                    let floor = s * eps / slice.whole as f64;
                    row.iter_mut().for_each(|x| *x = (p_scale * fast_exp(*x - max) as f64 - floor) as f32);
                    if let Some(j) = here(tgt) {
                        row[j] -= (s * (1.0 - eps)) as f32;
                    }
                }
                (eps * (logit - mean) + c * lse * lse) as f32
            })
            .collect();
        if let Some(aux) = aux_rows {
            aux.copy_from_slice(&out);
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Barrier, Mutex};

    /// Logits of `n` rows over `v`, spread as a trained head's are (a few
    /// large, most small), with one ignored target.
    fn rows(n: usize, v: usize) -> (Vec<f32>, Vec<i32>) {
        let mut rng = engine::rng::SplitMix64::new(7);
        let logits = (0..n * v).map(|_| (rng.normal() * 3.0) as f32).collect();
        let targets = (0..n).map(|i| if i == 2 { -100 } else { ((i * 7 + 3) % v) as i32 }).collect();
        (logits, targets)
    }

    /// The vocabulary cut into `t` slices, one thread per rank whose
    /// statistics are summed through a shared buffer (as the group's
    /// all-reduce sums them): each rank's losses, terms and gradient slice.
    fn split_run(
        (logits, targets): (&[f32], &[i32]),
        (v, t): (usize, usize),
        cap: Option<f32>,
        terms: LossTerms,
    ) -> Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let n = targets.len();
        let (total, barrier) = (Mutex::new(Vec::<f32>::new()), Barrier::new(t));
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..t)
                .map(|rank| {
                    let (total, barrier) = (&total, &barrier);
                    sc.spawn(move || {
                        let w = v / t;
                        let mut mine: Vec<f32> = logits.chunks(v).flat_map(|r| r[rank * w..][..w].to_vec()).collect();
                        if let Some(c) = cap {
                            soft_cap(&mut mine, c);
                        }
                        let (mut losses, mut aux) = (vec![0.0; n], vec![0.0; n]);
                        let slice = VocabSlice { first: rank * w, whole: v, rank, ranks: t };
                        let mut sum = |stats: &mut [f32]| {
                            {
                                let mut acc = total.lock().expect("one rank at a time");
                                acc.resize(stats.len(), 0.0);
                                acc.iter_mut().zip(stats.iter()).for_each(|(a, s)| *a += s);
                            }
                            barrier.wait();
                            stats.copy_from_slice(&total.lock().expect("read"));
                            if barrier.wait().is_leader() {
                                total.lock().expect("reset").clear();
                            }
                            barrier.wait();
                            Ok::<(), ()>(())
                        };
                        let out = (&mut losses[..], &mut aux[..]);
                        split_cross_entropy_with((&mut mine, cap), out, targets, slice, w, Some(0.5), terms, &mut sum)
                            .expect("no failing sum");
                        (losses, aux, mine)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
        })
    }

    /// The softmax cross-entropy over a vocabulary split into 1, 2 and 4
    /// slices equals the whole one's (losses, label smoothing and z-loss
    /// terms, gradient; soft-capped or not; an ignored row zero): each
    /// rank gets the same losses, and its slice of the gradient. Against
    /// the whole row's f64 sums, a split one combines f64 per-slice sums
    /// rescaled by exp(max_t − max) and sent as two f32 (48 bits), and its
    /// gradient takes exp(x − max) / Σ in one f64 product where the whole
    /// one multiplies by an f32 reciprocal: a few f32 ulps, so 1e-6
    /// relative on losses (|ce| ≥ 0.1 here) and 1e-6 of the scale on the
    /// gradient. A missing slice moves a loss by O(1).
    #[test]
    fn a_split_vocabulary_gives_the_whole_cross_entropy() {
        let (n, v) = (5, 48);
        let (logits, targets) = rows(n, v);
        let plain = LossTerms::default();
        let smooth = LossTerms { label_smoothing: 0.1, z_loss: 1e-3 };
        for (cap, terms) in [(None, plain), (None, smooth), (Some(2.5), smooth)] {
            let mut whole = logits.clone();
            if let Some(c) = cap {
                soft_cap(&mut whole, c);
            }
            let (mut losses, mut aux) = (vec![0.0; n], vec![0.0; if terms.is_plain() { 0 } else { n }]);
            capped_cross_entropy_with((&mut whole, cap), (&mut losses, &mut aux), &targets, v, Some(0.5), terms);
            for t in [1, 2, 4] {
                for (rank, (l, a, g)) in split_run((&logits, &targets), (v, t), cap, terms).into_iter().enumerate() {
                    let what = format!("{cap:?} {terms:?}, rank {rank} of {t}");
                    for (i, (x, y)) in l.iter().zip(&losses).enumerate() {
                        assert!((x - y).abs() <= 1e-6 * y.abs(), "{what}: row {i} loss {x} vs {y}");
                    }
                    for (i, (x, y)) in a.iter().zip(&aux).enumerate() {
                        assert!((x - y).abs() <= 1e-6 * y.abs().max(1e-3), "{what}: row {i} aux {x} vs {y}");
                    }
                    let w = v / t;
                    let want = whole.chunks(v).flat_map(|r| r[rank * w..][..w].to_vec());
                    for (j, (x, y)) in g.iter().zip(want).enumerate() {
                        assert!((x - y).abs() <= 1e-6 * 0.5, "{what}: gradient element {j}: {x} vs {y}");
                    }
                    assert!(l[2] == 0.0 && g[2 * w..3 * w].iter().all(|&x| x == 0.0), "{what}: the ignored row");
                }
            }
        }
    }
}
