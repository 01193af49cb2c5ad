//! LayerNorm (GPT-2) and RMSNorm (Llama) over rows, forward and backward.
//! The backward kernels *add* into the input gradient: it is the residual
//! stream's gradient, to which the norm's branch contributes.

use crate::assert_len;
use crate::grad::{column_sums, reduce_rows, ParamGrad};
use multiversion::multiversion;
use rayon::prelude::*;

/// LayerNorm epsilon of GPT-2.
pub const LN_EPS: f32 = 1e-5;

/// Rows whose sums run side by side: a row's sum is a chain of dependent
/// additions in index order (the order every result's bits depend on), so
/// one row at a time waits on the adder's latency; `GROUP` rows' chains
/// interleaved keep it busy, each row's additions in the same order.
const GROUP: usize = 8;

/// `sums[r] = init + f(r, 0) + f(r, 1) + … + f(r, c − 1)`, added in index
/// order for each of `R` rows, the rows' chains interleaved (so the bits
/// are those of summing each row alone, as `Iterator::sum` does from −0.0).
#[inline(always)]
fn ordered_sums<const R: usize>(c: usize, init: f32, f: impl Fn(usize, usize) -> f32) -> [f32; R] {
    let mut acc = [init; R];
    for i in 0..c {
        for (r, a) in acc.iter_mut().enumerate() {
            *a += f(r, i);
        }
    }
    acc
}

/// `R` consecutive rows of width `c` of `x` (the caller passes `R·c` values).
#[inline(always)]
fn rows<const R: usize>(x: &[f32], c: usize) -> [&[f32]; R] {
    std::array::from_fn(|r| &x[r * c..(r + 1) * c])
}

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
        out.par_chunks_mut(GROUP * c)
            .zip(inp.par_chunks(GROUP * c))
            .zip(mean.par_chunks_mut(GROUP).zip(rstd.par_chunks_mut(GROUP)))
            .for_each(|((o, x), (mu, rs))| {
                if mu.len() == GROUP {
                    return layernorm_rows::<GROUP>(o, x, w, b, mu, rs);
                }
                for (((o, x), mu), rs) in o.chunks_mut(c).zip(x.chunks(c)).zip(mu.chunks_mut(1)).zip(rs.chunks_mut(1)) {
                    layernorm_rows::<1>(o, x, w, b, mu, rs);
                }
            });
    })
}

/// `R` rows of [`layernorm_forward`].
#[inline(always)]
fn layernorm_rows<const R: usize>(o: &mut [f32], x: &[f32], w: &[f32], b: &[f32], mean: &mut [f32], rstd: &mut [f32]) {
    let c = w.len();
    let xr = rows::<R>(x, c);
    let sums = ordered_sums::<R>(c, -0.0, |r, i| xr[r][i]);
    let m: [f32; R] = std::array::from_fn(|r| sums[r] / c as f32);
    let vars = ordered_sums::<R>(c, -0.0, |r, i| (xr[r][i] - m[r]) * (xr[r][i] - m[r]));
    for r in 0..R {
        let s = 1.0 / (vars[r] / c as f32 + LN_EPS).sqrt();
        layernorm_apply(&mut o[r * c..(r + 1) * c], xr[r], w, b, m[r], s);
        (mean[r], rstd[r]) = (m[r], s);
    }
}

/// One row of LayerNorm's output from its statistics.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn layernorm_apply(o: &mut [f32], x: &[f32], w: &[f32], b: &[f32], m: f32, s: f32) {
    for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
        *o = (x - m) * s * w + b;
    }
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
        dinp.par_chunks_mut(GROUP * c)
            .zip(dout.par_chunks(GROUP * c))
            .zip(inp.par_chunks(GROUP * c))
            .zip(mean.par_chunks(GROUP).zip(rstd.par_chunks(GROUP)))
            .for_each(|(((di, d), x), (m, s))| {
                if m.len() == GROUP {
                    return layernorm_backward_rows::<GROUP>(di, d, x, w, m, s);
                }
                for r in 0..m.len() {
                    let rc = r * c..(r + 1) * c;
                    let (di, d, x) = (&mut di[rc.clone()], &d[rc.clone()], &x[rc]);
                    layernorm_backward_rows::<1>(di, d, x, w, &m[r..r + 1], &s[r..r + 1]);
                }
            });
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

/// `R` rows of [`layernorm_backward`]'s input gradient.
#[inline(always)]
fn layernorm_backward_rows<const R: usize>(di: &mut [f32], d: &[f32], x: &[f32], w: &[f32], m: &[f32], s: &[f32]) {
    let c = w.len();
    let (dr, xr) = (rows::<R>(d, c), rows::<R>(x, c));
    let dnorm_mean = ordered_sums::<R>(c, 0.0, |r, i| w[i] * dr[r][i]);
    let dnorm_norm_mean = ordered_sums::<R>(c, 0.0, |r, i| w[i] * dr[r][i] * (xr[r][i] - m[r]) * s[r]);
    for r in 0..R {
        let (dm, dnm) = (dnorm_mean[r] / c as f32, dnorm_norm_mean[r] / c as f32);
        layernorm_backward_apply(&mut di[r * c..(r + 1) * c], dr[r], xr[r], w, (m[r], s[r]), (dm, dnm));
    }
}

/// One row of LayerNorm's input gradient from its statistics and means.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn layernorm_backward_apply(
    di: &mut [f32],
    d: &[f32],
    x: &[f32],
    w: &[f32],
    (m, s): (f32, f32),
    (dm, dnm): (f32, f32),
) {
    for (((di, &d), &x), &w) in di.iter_mut().zip(d).zip(x).zip(w) {
        let norm = (x - m) * s;
        *di += (w * d - dm - norm * dnm) * s;
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
        out.par_chunks_mut(GROUP * c).zip(inp.par_chunks(GROUP * c)).zip(rstd.par_chunks_mut(GROUP)).for_each(
            |((o, x), rs)| {
                if rs.len() == GROUP {
                    return rmsnorm_rows::<GROUP>(o, x, w, rs, eps);
                }
                for ((o, x), rs) in o.chunks_mut(c).zip(x.chunks(c)).zip(rs.chunks_mut(1)) {
                    rmsnorm_rows::<1>(o, x, w, rs, eps);
                }
            },
        );
    })
}

/// `R` rows of [`rmsnorm_forward`].
#[inline(always)]
fn rmsnorm_rows<const R: usize>(o: &mut [f32], x: &[f32], w: &[f32], rstd: &mut [f32], eps: f32) {
    let c = w.len();
    let xr = rows::<R>(x, c);
    let ms = ordered_sums::<R>(c, -0.0, |r, i| xr[r][i] * xr[r][i]);
    for r in 0..R {
        let s = 1.0 / (ms[r] / c as f32 + eps).sqrt();
        rmsnorm_apply(&mut o[r * c..(r + 1) * c], xr[r], w, s);
        rstd[r] = s;
    }
}

/// One row of RMSNorm's output from its 1/rms.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn rmsnorm_apply(o: &mut [f32], x: &[f32], w: &[f32], s: f32) {
    for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
        *o = w * (x * s);
    }
}

/// `R` rows of [`rmsnorm_backward`]'s input gradient.
#[inline(always)]
fn rmsnorm_backward_rows<const R: usize>(di: &mut [f32], d: &[f32], x: &[f32], w: &[f32], rstd: &[f32]) {
    let c = w.len();
    let (dr, xr) = (rows::<R>(d, c), rows::<R>(x, c));
    let dot = ordered_sums::<R>(c, -0.0, |r, i| w[i] * dr[r][i] * xr[r][i]);
    for r in 0..R {
        let s = rstd[r];
        let k = s * s * s * dot[r] / c as f32;
        rmsnorm_backward_apply(&mut di[r * c..(r + 1) * c], dr[r], xr[r], w, (s, k));
    }
}

/// One row of RMSNorm's input gradient: `di += r·w·d − k·x`.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn rmsnorm_backward_apply(di: &mut [f32], d: &[f32], x: &[f32], w: &[f32], (s, k): (f32, f32)) {
    for (((di, &d), &x), &w) in di.iter_mut().zip(d).zip(x).zip(w) {
        *di += s * w * d - k * x;
    }
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
        let g = GROUP * c;
        dinp.par_chunks_mut(g).zip(dout.par_chunks(g)).zip(inp.par_chunks(g)).zip(rstd.par_chunks(GROUP)).for_each(
            |(((di, d), x), rs)| {
                if rs.len() == GROUP {
                    return rmsnorm_backward_rows::<GROUP>(di, d, x, w, rs);
                }
                for r in 0..rs.len() {
                    let rc = r * c..(r + 1) * c;
                    rmsnorm_backward_rows::<1>(&mut di[rc.clone()], &d[rc.clone()], &x[rc], w, &rs[r..r + 1]);
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

/// RMSNorm of each head of a fused projection's output, over the head's
/// width with one gain for every head (Qwen3's `q_norm` and `k_norm`): in
/// each row of a `[n, rs]` buffer, the `heads` heads of width `d` that
/// start at column `col0`. The heads are gathered into `[n·heads, d]` rows
/// (which the caller keeps for the backward) and run through
/// [`rmsnorm_forward`] / [`rmsnorm_backward`] as rows of their own, so each
/// head's bits are those of a row of the residual stream's norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadNorm {
    /// First column of the heads in each row.
    pub col0: usize,
    /// Heads in each row.
    pub heads: usize,
    /// Width of one head (the gain's length).
    pub d: usize,
    /// Row stride of the fused buffer.
    pub rs: usize,
}

impl HeadNorm {
    fn width(&self) -> usize {
        self.heads * self.d
    }

    /// Values the heads of `n` rows hold: the length of [`HeadNorm::gather`]'s output.
    pub fn len(&self, n: usize) -> usize {
        n * self.width()
    }

    /// Whether the heads hold no values.
    pub fn is_empty(&self) -> bool {
        self.width() == 0
    }

    /// Copies the heads of every row of `src` into `dst` (`[n·heads, d]`).
    pub fn gather(&self, dst: &mut [f32], src: &[f32]) {
        let (w, c0) = (self.width(), self.col0);
        dst.par_chunks_mut(w).zip(src.par_chunks(self.rs)).for_each(|(d, s)| d.copy_from_slice(&s[c0..c0 + w]));
    }

    /// Copies `src` (`[n·heads, d]`) into the heads of every row of `dst`.
    fn scatter(&self, dst: &mut [f32], src: &[f32]) {
        let (w, c0) = (self.width(), self.col0);
        dst.par_chunks_mut(self.rs).zip(src.par_chunks(w)).for_each(|(d, s)| d[c0..c0 + w].copy_from_slice(s));
    }

    /// The heads of `buf` become `w · x / sqrt(mean(x²) + eps)` of `inp`
    /// (their values gathered, as the caller keeps them); 1/rms of each
    /// head into `rstd` (`[n·heads]`); `out` (`[n·heads, d]`) is scratch.
    pub fn forward(&self, buf: &mut [f32], out: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], eps: f32) {
        let n = rstd.len() / self.heads.max(1);
        let out = &mut out[..self.len(n)];
        rmsnorm_forward(out, rstd, inp, w, self.d, eps);
        self.scatter(buf, out);
    }

    /// Backward of [`HeadNorm::forward`]: the heads of `grad` (the
    /// gradient of the normalised values) become the gradient of the
    /// values before the norm; the gain's gradient as `dw` says.
    /// `(dout, dinp)` are scratch of [`HeadNorm::len`] values each.
    pub fn backward(
        &self,
        grad: &mut [f32],
        (dout, dinp): (&mut [f32], &mut [f32]),
        saved: NormSaved<'_>,
        w: &[f32],
        dw: Option<ParamGrad<'_>>,
    ) {
        let len = saved.inp.len();
        let (dout, dinp) = (&mut dout[..len], &mut dinp[..len]);
        self.gather(dout, grad);
        dinp.fill(0.0);
        rmsnorm_backward(dinp, dw, dout, saved, w);
        self.scatter(grad, dinp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_fd, randn};

    /// Heads in the middle of a fused row (other columns untouched) against
    /// central differences, input and gain; each head's values are those of
    /// [`rmsnorm_forward`] on it as a row, to the bit.
    #[test]
    fn head_norm_matches_central_differences_and_the_row_norm() {
        let (n, d, heads, rs, col0) = (3, 4, 2, 13, 3);
        let hn = HeadNorm { col0, heads, d, rs };
        let (x, w, dout) = (randn(n * rs, 8), randn(d, 9), randn(n * rs, 10));
        let fwd = |x: &[f32], w: &[f32]| {
            let mut inp = vec![0.0; hn.len(n)];
            hn.gather(&mut inp, x);
            let (mut buf, mut out, mut rstd) = (x.to_vec(), vec![0.0; hn.len(n)], vec![0.0; n * heads]);
            hn.forward(&mut buf, &mut out, &mut rstd, &inp, w, 1e-6);
            (buf, inp, rstd)
        };
        let (y, inp, rstd) = fwd(&x, &w);
        for i in 0..n {
            assert_eq!(y[i * rs..i * rs + col0], x[i * rs..i * rs + col0], "columns before the heads");
            assert_eq!(y[i * rs + col0 + heads * d..(i + 1) * rs], x[i * rs + col0 + heads * d..(i + 1) * rs]);
            for h in 0..heads {
                let at = i * rs + col0 + h * d;
                let (mut o, mut r) = (vec![0.0; d], vec![0.0]);
                rmsnorm_forward(&mut o, &mut r, &x[at..at + d], &w, d, 1e-6);
                assert_eq!(y[at..at + d], o[..], "row {i} head {h}");
            }
        }
        let mut grad = dout.clone();
        let (mut a, mut b) = (vec![0.0; hn.len(n)], vec![0.0; hn.len(n)]);
        let mut dw = vec![0.5; d];
        let saved = NormSaved { inp: &inp, mean: &[], rstd: &rstd };
        hn.backward(&mut grad, (&mut a, &mut b), saved, &w, Some(ParamGrad { buf: &mut dw, accumulate: true }));
        check_fd("head norm dx", &|x| fwd(x, &w).0, &x, &dout, &grad);
        let dw: Vec<f32> = dw.iter().map(|g| g - 0.5).collect();
        check_fd("head norm dw", &|w| fwd(&x, w).0, &w, &dout, &dw);
    }

    /// Rows summed side by side in groups give the bits of each row alone
    /// (the reference: one row at a time, `Iterator::sum` in index order),
    /// for full groups and a short last one.
    #[test]
    fn grouped_rows_give_the_bits_of_one_row_at_a_time() {
        let (n, c) = (2 * GROUP + 5, 37);
        let (x, w, b, d) = (randn(n * c, 11), randn(c, 12), randn(c, 13), randn(n * c, 14));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (mut o, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut o, &mut mean, &mut rstd, &x, &w, &b, c);
        let (mut di, mut dr) = (randn(n * c, 15), randn(n * c, 15));
        layernorm_backward(&mut di, None, None, &d, NormSaved { inp: &x, mean: &mean, rstd: &rstd }, &w);
        let (mut ro, mut rrs) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut ro, &mut rrs, &x, &w, c, 1e-6);
        let mut rdi = randn(n * c, 16);
        rmsnorm_backward(&mut rdi, None, &d, NormSaved { inp: &x, mean: &[], rstd: &rrs }, &w);
        let mut want = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n], vec![0.0; n * c], vec![0.0; n]);
        let mut rdr = randn(n * c, 16);
        for r in 0..n {
            let rc = r * c..(r + 1) * c;
            let (xr, dd) = (&x[rc.clone()], &d[rc.clone()]);
            let m = xr.iter().sum::<f32>() / c as f32;
            let var = xr.iter().map(|&v| (v - m) * (v - m)).sum::<f32>() / c as f32;
            let s = 1.0 / (var + LN_EPS).sqrt();
            (want.1[r], want.2[r]) = (m, s);
            for i in 0..c {
                want.0[r * c + i] = (xr[i] - m) * s * w[i] + b[i];
            }
            let (mut dm, mut dnm) = (0.0f32, 0.0f32);
            for i in 0..c {
                let dn = w[i] * dd[i];
                dm += dn;
                dnm += dn * (xr[i] - m) * s;
            }
            (dm, dnm) = (dm / c as f32, dnm / c as f32);
            for i in 0..c {
                dr[r * c + i] += (w[i] * dd[i] - dm - (xr[i] - m) * s * dnm) * s;
            }
            let ms = xr.iter().map(|&v| v * v).sum::<f32>() / c as f32;
            let q = 1.0 / (ms + 1e-6).sqrt();
            want.4[r] = q;
            for i in 0..c {
                want.3[r * c + i] = w[i] * (xr[i] * q);
            }
            let dot: f32 = (0..c).map(|i| w[i] * dd[i] * xr[i]).sum();
            let k = q * q * q * dot / c as f32;
            for i in 0..c {
                rdr[r * c + i] += q * w[i] * dd[i] - k * xr[i];
            }
        }
        assert_eq!(bits(&o), bits(&want.0), "layernorm output");
        assert_eq!((bits(&mean), bits(&rstd)), (bits(&want.1), bits(&want.2)), "layernorm statistics");
        assert_eq!(bits(&di), bits(&dr), "layernorm input gradient");
        assert_eq!((bits(&ro), bits(&rrs)), (bits(&want.3), bits(&want.4)), "rmsnorm output, 1/rms");
        assert_eq!(bits(&rdi), bits(&rdr), "rmsnorm input gradient");
    }

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
