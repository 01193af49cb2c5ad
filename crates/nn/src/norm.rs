//! LayerNorm (GPT-2) and RMSNorm (Llama) over rows, forward and backward.
//! The backward kernels *add* into the input gradient: it is the residual
//! stream's gradient, to which the norm's branch contributes.

use crate::assert_len;
use crate::grad::{column_sums, reduce_rows, ParamGrad};
use multiversion::multiversion;
use rayon::prelude::*;

/// LayerNorm epsilon of GPT-2.
pub const LN_EPS: f32 = 1e-5;

/// LayerNorm over rows of width `c`; saves mean and 1/std for backward.
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    w: &[f32],
    b: &[f32],
    c: usize,
) {
    engine::profile::timed(engine::profile::Kind::Norm, || {
        out.par_chunks_mut(c)
            .zip(inp.par_chunks(c))
            .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
            .for_each(|((o, x), (mu, rs))| (*mu, *rs) = layernorm_row(o, x, w, b));
    })
}

/// One row of [`layernorm_forward`]: returns (mean, 1/std).
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn layernorm_row(o: &mut [f32], x: &[f32], w: &[f32], b: &[f32]) -> (f32, f32) {
    let c = x.len();
    let m = x.iter().sum::<f32>() / c as f32;
    let var = x.iter().map(|&v| (v - m) * (v - m)).sum::<f32>() / c as f32;
    let s = 1.0 / (var + LN_EPS).sqrt();
    for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
        *o = (x - m) * s * w + b;
    }
    (m, s)
}

/// What a norm's forward saw and saved, as its backward reads it: the
/// input rows and the per-row statistics (LayerNorm: mean and 1/std;
/// RMSNorm: `mean` empty, 1/rms).
#[derive(Debug, Clone, Copy)]
pub struct NormSaved<'a> {
    /// The norm's input `[n, c]`.
    pub inp: &'a [f32],
    /// Per-row mean (LayerNorm only).
    pub mean: &'a [f32],
    /// Per-row 1/std (LayerNorm) or 1/rms (RMSNorm).
    pub rstd: &'a [f32],
}

/// Backward of [`layernorm_forward`]: adds into `dinp`; `dw`, `db` as
/// their [`ParamGrad`]s say. `w` is the gain (its length is the width).
pub fn layernorm_backward(
    dinp: &mut [f32],
    dw: Option<ParamGrad<'_>>,
    db: Option<ParamGrad<'_>>,
    dout: &[f32],
    saved: NormSaved<'_>,
    w: &[f32],
) {
    engine::profile::timed(engine::profile::Kind::Norm, || {
        let NormSaved { inp, mean, rstd } = saved;
        let c = w.len();
        dinp.par_chunks_mut(c)
            .zip(dout.par_chunks(c))
            .zip(inp.par_chunks(c))
            .zip(mean.par_iter().zip(rstd.par_iter()))
            .for_each(|(((di, d), x), (&m, &s))| layernorm_backward_row(di, d, x, w, m, s));
        let n_rows = mean.len();
        reduce_rows(n_rows, &mut [dw, db], &[c, c], |rows, acc| {
            let (aw, ab) = acc.split_at_mut(c);
            for r in rows {
                let (d, x, m, s) = (&dout[r * c..][..c], &inp[r * c..][..c], mean[r], rstd[r]);
                for i in 0..c {
                    aw[i] += (x[i] - m) * s * d[i];
                    ab[i] += d[i];
                }
            }
        });
    })
}

/// One row of [`layernorm_backward`]'s input gradient.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn layernorm_backward_row(di: &mut [f32], d: &[f32], x: &[f32], w: &[f32], m: f32, s: f32) {
    let c = x.len();
    let mut dnorm_mean = 0.0f32;
    let mut dnorm_norm_mean = 0.0f32;
    for i in 0..c {
        let dn = w[i] * d[i];
        dnorm_mean += dn;
        dnorm_norm_mean += dn * (x[i] - m) * s;
    }
    dnorm_mean /= c as f32;
    dnorm_norm_mean /= c as f32;
    for (((di, &d), &x), &w) in di.iter_mut().zip(d).zip(x).zip(w) {
        let norm = (x - m) * s;
        *di += (w * d - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
}

/// RMSNorm over rows of width `c`, as transformers' `LlamaRMSNorm` in f32:
/// `out = w · x / sqrt(mean(x²) + eps)`; saves `1/sqrt(mean(x²) + eps)`.
pub fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], c: usize, eps: f32) {
    engine::profile::timed(engine::profile::Kind::Norm, || {
        let n = rstd.len();
        assert_len("rmsnorm_forward", "out", out.len(), &[n, c]);
        assert_len("rmsnorm_forward", "inp", inp.len(), &[n, c]);
        assert_len("rmsnorm_forward", "w", w.len(), &[c]);
        out.par_chunks_mut(c).zip(inp.par_chunks(c)).zip(rstd.par_iter_mut()).for_each(|((o, x), rs)| {
            let ms = x.iter().map(|&v| v * v).sum::<f32>() / c as f32;
            let r = 1.0 / (ms + eps).sqrt();
            for i in 0..c {
                o[i] = w[i] * (x[i] * r);
            }
            *rs = r;
        });
    })
}

/// Backward of [`rmsnorm_forward`]: *adds* into `dinp` (the residual
/// stream's gradient); `dw` as its [`ParamGrad`] says; `saved.mean` unused.
///
/// With `r = rstd`: `dx_i = r·w_i·dy_i − r³·x_i·(Σ_j w_j·dy_j·x_j)/c`,
/// `dw_i = Σ_rows dy_i·x_i·r`.
pub fn rmsnorm_backward(dinp: &mut [f32], dw: Option<ParamGrad<'_>>, dout: &[f32], saved: NormSaved<'_>, w: &[f32]) {
    engine::profile::timed(engine::profile::Kind::Norm, || {
        let NormSaved { inp, rstd, .. } = saved;
        let (n, c) = (rstd.len(), w.len());
        for (name, len) in [("dinp", dinp.len()), ("dout", dout.len()), ("inp", inp.len())] {
            assert_len("rmsnorm_backward", name, len, &[n, c]);
        }
        dinp.par_chunks_mut(c).zip(dout.par_chunks(c)).zip(inp.par_chunks(c)).zip(rstd.par_iter()).for_each(
            |(((di, d), x), &r)| {
                let dot: f32 = (0..c).map(|i| w[i] * d[i] * x[i]).sum();
                let k = r * r * r * dot / c as f32;
                for i in 0..c {
                    di[i] += r * w[i] * d[i] - k * x[i];
                }
            },
        );
        let Some(dw) = dw else { return };
        assert_len("rmsnorm_backward", "dw", dw.buf.len(), &[c]);
        column_sums(dw, n, |r, cols, acc| {
            let (d, x, s) = (&dout[r * c + cols.start..], &inp[r * c + cols.start..], rstd[r]);
            for ((a, d), x) in acc.iter_mut().zip(d).zip(x) {
                *a += d * x * s;
            }
        });
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_fd, randn};

    #[test]
    fn rmsnorm_backward_matches_central_differences() {
        let (n, c) = (3, 8);
        let (x, w, dout) = (randn(n * c, 1), randn(c, 2), randn(n * c, 3));
        let fwd = |x: &[f32]| {
            let (mut o, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut o, &mut r, x, &w, c, 1e-5);
            o
        };
        let mut rstd = vec![0.0; n];
        rmsnorm_forward(&mut vec![0.0; n * c], &mut rstd, &x, &w, c, 1e-5);
        let mut dx = vec![0.0; n * c];
        let mut dw = vec![7.0; c]; // overwritten: the flag says so
        let saved = NormSaved { inp: &x, mean: &[], rstd: &rstd };
        rmsnorm_backward(&mut dx, Some(ParamGrad { buf: &mut dw, accumulate: false }), &dout, saved, &w);
        check_fd("rmsnorm dx", &fwd, &x, &dout, &dx);
        let fw = |w: &[f32]| {
            let (mut o, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut o, &mut r, &x, w, c, 1e-5);
            o
        };
        check_fd("rmsnorm dw", &fw, &w, &dout, &dw);
    }

    #[test]
    fn layernorm_backward_matches_central_differences() {
        let (n, c) = (3, 8);
        let (x, w, b, dout) = (randn(n * c, 4), randn(c, 5), randn(c, 6), randn(n * c, 7));
        let fwd = |x: &[f32]| {
            let (mut o, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm_forward(&mut o, &mut m, &mut r, x, &w, &b, c);
            o
        };
        let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut vec![0.0; n * c], &mut mean, &mut rstd, &x, &w, &b, c);
        let (mut dx, mut dw, mut db) = (vec![0.0; n * c], vec![1.0; c], vec![0.0; c]);
        let saved = NormSaved { inp: &x, mean: &mean, rstd: &rstd };
        let (gw, gb) = (ParamGrad { buf: &mut dw, accumulate: true }, ParamGrad { buf: &mut db, accumulate: false });
        layernorm_backward(&mut dx, Some(gw), Some(gb), &dout, saved, &w);
        check_fd("layernorm dx", &fwd, &x, &dout, &dx);
        // dw was added to 1.0; db overwritten: Σ_rows dout.
        let fw = |w: &[f32]| {
            let (mut o, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm_forward(&mut o, &mut m, &mut r, &x, w, &b, c);
            o
        };
        let dw1: Vec<f32> = dw.iter().map(|v| v - 1.0).collect();
        check_fd("layernorm dw", &fw, &w, &dout, &dw1);
        for j in 0..c {
            let want: f32 = (0..n).map(|r| dout[r * c + j]).sum();
            assert!((db[j] - want).abs() < 1e-5, "db[{j}]");
        }
    }
}
