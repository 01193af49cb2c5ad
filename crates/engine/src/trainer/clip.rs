//! Gradient norm and clipping with `torch.nn.utils.clip_grad_norm_`'s
//! semantics, summed in f64 in a fixed order.

use crate::optim::CHUNK;
use rayon::prelude::*;

fn scale(buf: &mut [f32], factor: f32) {
    buf.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x *= factor));
}

/// `torch.nn.utils.clip_grad_norm_`'s factor: `max_norm / (norm + 1e-6)`, capped at 1.
pub(super) fn clip_coefficient(norm: f64, max_norm: f32) -> f64 {
    (max_norm as f64 / (norm + 1e-6)).min(1.0)
}

/// L2 norm of a flat buffer, accumulated in f64 over fixed chunks summed in
/// order, so the result does not depend on the number of threads.
pub fn grad_norm(grads: &[f32]) -> f64 {
    chunked_sum_of_squares(grads).sqrt()
}

/// Σ x² of a flat buffer in f64 over fixed chunks summed in order (the
/// square of [`grad_norm`]).
pub(super) fn chunked_sum_of_squares(grads: &[f32]) -> f64 {
    let partial: Vec<f64> = grads.par_chunks(CHUNK).map(sum_of_squares).collect();
    partial.iter().sum::<f64>()
}

/// Σ x² in f64 over 8 interleaved accumulators: a fixed summation order (so
/// the result is the same on every run and thread count) that vectorises.
pub(super) fn sum_of_squares(xs: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] += c[i] as f64 * c[i] as f64;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&x| x as f64 * x as f64).sum();
    acc.iter().sum::<f64>() + tail
}

/// `torch.nn.utils.clip_grad_norm_`: scale by `max_norm / (norm + 1e-6)` when
/// that factor is below 1. Returns the pre-clip norm and whether it clipped.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> (f64, bool) {
    let norm = grad_norm(grads);
    let coef = clip_coefficient(norm, max_norm);
    if coef < 1.0 {
        scale(grads, coef as f32);
        (norm, true)
    } else {
        (norm, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_matches_torch_semantics() {
        // norm of [3, 4] is 5; clip to 1 → factor 1/(5+1e-6).
        let mut g = vec![3.0f32, 4.0];
        let (norm, clipped) = clip_grad_norm(&mut g, 1.0);
        assert_eq!(norm, 5.0);
        assert!(clipped);
        assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
        let mut g = vec![0.3f32, 0.4];
        assert_eq!(clip_grad_norm(&mut g, 1.0), (0.500_000_011_920_929, false));
        assert_eq!(g, vec![0.3, 0.4]);
    }
}
