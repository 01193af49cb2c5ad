//! DoRA (weight-decomposed low-rank adaptation) as PEFT formulates it
//! (`peft.tuners.lora.dora.DoraLinearLayer`): a projection with base
//! weight `W₀ [out, in]` and adapter `s·B·A` computes
//!
//! ```text
//! y = base(x) + (m/‖W₀ + s·B·A‖ − 1) ⊙ base(x) + (m/‖W₀ + s·B·A‖) ⊙ s·B·A·x
//!   = (m/‖W₀ + s·B·A‖) ⊙ (W₀·x + s·B·A·x)        (+ the base's bias, unscaled)
//! ```
//!
//! with `m [out]` a trainable magnitude per output feature and `‖·‖` the
//! L2 norm of each row (PEFT's `weight_norm`: `torch.linalg.norm(W, dim=1)`
//! of the `[out, in]` weight), initialised so that `m = ‖W₀ + s·B·A‖` (the
//! adapted model starts as the base). The norm is recomputed from the
//! current `A` and `B` on every forward and treated as a constant in
//! backward (DoRA §4.3, PEFT's `weight_norm.detach()`), so with
//! `z = W₀·x + s·B·A·x` and `g = ∂L/∂y`:
//!
//! ```text
//! ∂L/∂m_j = Σ_rows g_j · z_j / ‖·‖_j        and z's gradient is (m/‖·‖) ⊙ g
//! ```
//!
//! — the plain LoRA backward on a column-scaled output gradient. These are
//! the kernels; [`crate::proj`] runs them beside a projection.

use crate::{gemm_into, parallelism, GemmDims, GemmOut, Strided};
use std::ops::Range;

/// Rows of `W₀ + s·B·A` formed at a time by [`row_norms`] (a bounded
/// buffer whatever the projection's size).
const ROW_BLOCK: usize = 64;

/// A projection's shape and adapter, as [`row_norms`] reads them.
pub struct Adapted<'a> {
    /// `[out, in]` of the weight.
    pub shape: [usize; 2],
    /// Rank r.
    pub r: usize,
    /// `A [r, in]`.
    pub a: &'a [f32],
    /// `B [out, r]`.
    pub b: &'a [f32],
    /// The update's scale s.
    pub scale: f32,
}

/// `norms[j] = ‖W₀[j, :] + s·(B·A)[j, :]‖₂` for every output row `j`, the
/// base's rows read `ROW_BLOCK` at a time through `w0(rows)` (f32 values
/// of those rows of `W₀`, row-major: the parameters, or a packed base
/// dequantised). Squares are summed in f64.
pub fn row_norms(ad: &Adapted<'_>, w0: &dyn Fn(Range<usize>) -> Vec<f32>, norms: &mut [f32]) {
    let [oc, ic] = ad.shape;
    assert_eq!(norms.len(), oc, "one norm per output row");
    let mut j0 = 0;
    while j0 < oc {
        let j1 = (j0 + ROW_BLOCK).min(oc);
        let mut w = w0(j0..j1);
        assert_eq!(w.len(), (j1 - j0) * ic, "base rows {j0}..{j1}");
        // W[j0..j1] += s · B[j0..j1] · A: (rows, r) @ (r, in) -> (rows, in)
        gemm_into(
            GemmDims { m: j1 - j0, n: ic, k: ad.r },
            &mut w,
            GemmOut { offset: 0, rs: ic, accumulate: true },
            Strided::rows(&ad.b[j0 * ad.r..j1 * ad.r], ad.r),
            Strided::rows(ad.a, ic),
            ad.scale,
            parallelism(false),
        );
        for (nj, row) in norms[j0..j1].iter_mut().zip(w.chunks_exact(ic)) {
            *nj = l2(row);
        }
        j0 = j1;
    }
}

/// `‖row‖₂`, squares summed in f64.
fn l2(row: &[f32]) -> f32 {
    row.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt() as f32
}

/// `m_j / ‖·‖_j`, the factor each output column is scaled by (PEFT's
/// `mag_norm_scale`, one division as it computes it).
pub fn scale_of(m: f32, norm: f32) -> f32 {
    m / norm
}

/// `y[:, col0 + j] *= m_j / norms_j` for the `n` rows of a buffer whose
/// rows are `rs` apart.
pub fn scale_columns(y: &mut [f32], (col0, rs): (usize, usize), n: usize, m: &[f32], norms: &[f32]) {
    let scales: Vec<f32> = m.iter().zip(norms).map(|(&m, &w)| scale_of(m, w)).collect();
    for i in 0..n {
        let row = &mut y[i * rs + col0..i * rs + col0 + scales.len()];
        row.iter_mut().zip(&scales).for_each(|(v, s)| *v *= s);
    }
}

/// `out[i, j] = (m_j / norms_j) · g[i, j]` for the `n` rows of `g` (a
/// strided view, unit column stride) into the `[n, out]` buffer `out`.
pub fn scaled_copy(out: &mut [f32], g: Strided<'_>, n: usize, m: &[f32], norms: &[f32]) {
    let oc = m.len();
    let scales: Vec<f32> = m.iter().zip(norms).map(|(&m, &w)| scale_of(m, w)).collect();
    for i in 0..n {
        let src = &g.data[g.offset + i * g.rs..g.offset + i * g.rs + oc];
        let dst = &mut out[i * oc..(i + 1) * oc];
        for ((d, &v), &s) in dst.iter_mut().zip(src).zip(&scales) {
            *d = s * v;
        }
    }
}

/// The magnitude's gradient `dm_j (+)= Σ_i g[i, j] · z[i, j] / norms_j`
/// (`g`: the projection's output gradient before scaling, a strided view
/// with unit column stride; `z [n, out]`: `W₀·x + s·B·A·x` as the forward
/// saved it). Rows are summed in order per column: deterministic.
pub fn magnitude_grad(dm: crate::grad::ParamGrad<'_>, g: Strided<'_>, z: &[f32], norms: &[f32]) {
    let oc = norms.len();
    let n = z.len() / oc.max(1);
    let mut acc = vec![0.0f32; oc];
    for i in 0..n {
        let gi = &g.data[g.offset + i * g.rs..g.offset + i * g.rs + oc];
        for ((a, &gv), &zv) in acc.iter_mut().zip(gi).zip(&z[i * oc..(i + 1) * oc]) {
            *a += gv * zv;
        }
    }
    for ((d, a), &w) in dm.buf.iter_mut().zip(acc).zip(norms) {
        let v = a / w;
        *d = if dm.accumulate { *d + v } else { v };
    }
}

/// `w[j, :] *= m_j / ‖w[j, :]‖₂` for every row of the `[out, cols]`
/// matrix `w` (PEFT's merge of DoRA into the base: `w` is `W + s·B·A`).
pub fn rescale_rows(w: &mut [f32], m: &[f32], cols: usize) {
    for (row, &mj) in w.chunks_exact_mut(cols).zip(m) {
        let f = scale_of(mj, l2(row));
        row.iter_mut().for_each(|v| *v *= f);
    }
}

/// `m_j = ‖W[j, :]‖₂`: a magnitude that makes DoRA start as the base
/// (B = 0), from the base's rows read through `w0` as [`row_norms`] does.
pub fn initial_magnitude(shape: [usize; 2], w0: &dyn Fn(Range<usize>) -> Vec<f32>, m: &mut [f32]) {
    let [oc, ic] = shape;
    let mut j0 = 0;
    while j0 < oc {
        let j1 = (j0 + ROW_BLOCK).min(oc);
        let w = w0(j0..j1);
        for (mj, row) in m[j0..j1].iter_mut().zip(w.chunks_exact(ic)) {
            *mj = l2(row);
        }
        j0 = j1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_norms_equal_a_direct_computation_in_any_row_block() {
        // 150 rows: two full blocks of 64 and a partial one.
        let (oc, ic, r, s) = (150, 37, 3, 0.7f32);
        let val = |i: usize, k: u64| ((i as u64 * 2654435761 + k) % 1000) as f32 / 500.0 - 1.0;
        let w0: Vec<f32> = (0..oc * ic).map(|i| val(i, 1)).collect();
        let a: Vec<f32> = (0..r * ic).map(|i| val(i, 7)).collect();
        let b: Vec<f32> = (0..oc * r).map(|i| val(i, 3)).collect();
        let mut norms = vec![0.0; oc];
        let ad = Adapted { shape: [oc, ic], r, a: &a, b: &b, scale: s };
        row_norms(&ad, &|rows: Range<usize>| w0[rows.start * ic..rows.end * ic].to_vec(), &mut norms);
        for j in 0..oc {
            let want: f64 = (0..ic)
                .map(|k| {
                    let ba: f64 = (0..r).map(|q| b[j * r + q] as f64 * a[q * ic + k] as f64).sum();
                    let v = w0[j * ic + k] as f64 + s as f64 * ba;
                    v * v
                })
                .sum::<f64>()
                .sqrt();
            // f32 GEMM terms and one f32 rounding of each element: ~1e-7 relative.
            assert!((norms[j] as f64 - want).abs() <= 1e-6 * want, "row {j}: {} vs {want}", norms[j]);
        }
    }

    #[test]
    fn the_magnitude_gradient_is_the_column_sum_of_g_times_z_over_the_norm() {
        let (n, oc, rs) = (5, 4, 6);
        let g: Vec<f32> = (0..n * rs).map(|i| i as f32 * 0.25 - 3.0).collect();
        let z: Vec<f32> = (0..n * oc).map(|i| 1.0 - i as f32 * 0.1).collect();
        let norms = [2.0, 4.0, 0.5, 1.0];
        let view = Strided { data: &g, offset: 1, rs, cs: 1 };
        let mut dm = vec![1.0f32; oc];
        magnitude_grad(crate::grad::ParamGrad { buf: &mut dm, accumulate: true }, view, &z, &norms);
        for j in 0..oc {
            let want: f32 = (0..n).map(|i| g[1 + i * rs + j] * z[i * oc + j]).sum::<f32>() / norms[j];
            assert!((dm[j] - 1.0 - want).abs() <= 1e-5 * want.abs().max(1.0), "{j}");
        }
        // scaled_copy and scale_columns apply the same factor m/‖·‖.
        let m = [1.0, 2.0, 3.0, 4.0];
        let mut out = vec![0.0; n * oc];
        scaled_copy(&mut out, view, n, &m, &norms);
        let mut inplace = g.clone();
        scale_columns(&mut inplace, (1, rs), n, &m, &norms);
        for i in 0..n {
            for j in 0..oc {
                assert_eq!(out[i * oc + j], inplace[1 + i * rs + j]);
                assert_eq!(out[i * oc + j], g[1 + i * rs + j] * (m[j] / norms[j]));
            }
        }
    }
}
