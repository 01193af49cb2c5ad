//! Llama's forward and backward kernels over row-major f32 slices: token
//! embedding, RMSNorm, rotary embeddings (Hugging Face's `rotate_half`),
//! causal grouped-query attention, SwiGLU, and linear layers in `nn.Linear`
//! layout (`[out, in]`) on gpt's `gemm` wrapper.
//!
//! Conventions as in gpt's kernels: `n` = B·T rows; backward kernels
//! overwrite activation gradients unless their doc says they add (RMSNorm
//! adds into the residual stream), and treat each parameter gradient as a
//! [`ParamGrad`] (add, overwrite, or `None`: frozen, skipped). Every
//! reduction has a fixed order, so results do not depend on the number of
//! threads. All kernels here are safe code; each `pub` one asserts the
//! lengths its shapes imply.

use gpt::kernels::{fast_exp, gemm_into, parallelism, Operands, Strided};
use rayon::prelude::*;

pub use gpt::kernels::ParamGrad;

/// Columns `col0..` of a row-major matrix whose rows are `row_width` apart.
pub fn columns(data: &[f32], col0: usize, row_width: usize) -> Strided<'_> {
    Strided { data, offset: col0, rs: row_width, cs: 1 }
}

fn assert_len(kernel: &str, name: &str, len: usize, factors: &[usize]) {
    let want = factors.iter().try_fold(1usize, |acc, &f| acc.checked_mul(f));
    assert!(want == Some(len), "{kernel}: `{name}` has {len} elements, expected {want:?} (product of {factors:?})");
}

/// `out[r] = table[tokens[r]]`: `out` is `[n, c]`, `table` `[V, c]`.
pub fn embedding_forward(out: &mut [f32], tokens: &[u32], table: &[f32], c: usize) {
    assert_len("embedding_forward", "out", out.len(), &[tokens.len(), c]);
    out.par_chunks_mut(c).zip(tokens.par_iter()).for_each(|(o, &tok)| {
        o.copy_from_slice(&table[tok as usize * c..][..c]);
    });
}

/// Adds the gradient of [`embedding_forward`] into `dtable` (GPT-2's
/// encoder backward without positions: a serial scatter-add in row order).
pub fn embedding_backward(dtable: Option<&mut [f32]>, dout: &[f32], tokens: &[u32], c: usize) {
    assert_len("embedding_backward", "dout", dout.len(), &[tokens.len(), c]);
    // t only indexes the (absent) position table.
    gpt::kernels::encoder_backward(dtable, None, dout, tokens, 1, c);
}

/// `y[:, col0..col0+oc] (+)= alpha · x · wᵀ`: x `[n, ic]`, w `[oc, ic]`
/// (`nn.Linear`), y rows `y_rs` apart. Also LoRA's two halves: `x·Aᵀ` and
/// `s·(x·Aᵀ)·Bᵀ`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward(
    y: &mut [f32],
    y_col0: usize,
    y_rs: usize,
    accumulate: bool,
    x: &[f32],
    w: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
    alpha: f32,
    ops: Operands,
) {
    assert_len("linear_forward", "x", x.len(), &[n, ic]);
    assert_len("linear_forward", "w", w.len(), &[oc, ic]);
    assert!(y_col0 + oc <= y_rs, "linear_forward: columns {y_col0}+{oc} exceed the row width {y_rs}");
    let (xv, wt) = (Strided::rows(x, ic), Strided::transposed(w, ic));
    gemm_into(n, oc, ic, y, y_col0, y_rs, accumulate, xv, wt, alpha, parallelism(false).with(ops));
}

/// Input gradient of [`linear_forward`]: `dx[n, ic] (+)= alpha · dy · w`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_input(
    dx: &mut [f32],
    accumulate: bool,
    dy: Strided<'_>,
    w: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
    alpha: f32,
    ops: Operands,
) {
    assert_len("linear_backward_input", "dx", dx.len(), &[n, ic]);
    assert_len("linear_backward_input", "w", w.len(), &[oc, ic]);
    gemm_into(n, ic, oc, dx, 0, ic, accumulate, dy, Strided::rows(w, ic), alpha, parallelism(false).with(ops));
}

/// Weight gradient of [`linear_forward`]: `dw[oc, ic] (+)= alpha · dyᵀ · x`
/// (skipped when `dw` is `None`: a frozen weight).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_weight(
    dw: ParamGrad<'_>,
    dy: Strided<'_>,
    x: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
    alpha: f32,
    ops: Operands,
) {
    let Some((dw, accumulate)) = dw else { return };
    assert_len("linear_backward_weight", "dw", dw.len(), &[oc, ic]);
    assert_len("linear_backward_weight", "x", x.len(), &[n, ic]);
    gemm_into(oc, ic, n, dw, 0, ic, accumulate, dy.t(), Strided::rows(x, ic), alpha, parallelism(false).with(ops));
}

/// RMSNorm over rows of width `c`, as transformers' `LlamaRMSNorm` in f32:
/// `out = w · x / sqrt(mean(x²) + eps)`; saves `1/sqrt(mean(x²) + eps)`.
pub fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], c: usize, eps: f32) {
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
}

/// Backward of [`rmsnorm_forward`]: *adds* into `dinp` (the residual
/// stream's gradient); `dw` as its [`ParamGrad`] says.
///
/// With `r = rstd`: `dx_i = r·w_i·dy_i − r³·x_i·(Σ_j w_j·dy_j·x_j)/c`,
/// `dw_i = Σ_rows dy_i·x_i·r`.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dw: ParamGrad<'_>,
    dout: &[f32],
    inp: &[f32],
    rstd: &[f32],
    w: &[f32],
    c: usize,
) {
    let n = rstd.len();
    for (name, len) in [("dinp", dinp.len()), ("dout", dout.len()), ("inp", inp.len())] {
        assert_len("rmsnorm_backward", name, len, &[n, c]);
    }
    assert_len("rmsnorm_backward", "w", w.len(), &[c]);
    dinp.par_chunks_mut(c).zip(dout.par_chunks(c)).zip(inp.par_chunks(c)).zip(rstd.par_iter()).for_each(
        |(((di, d), x), &r)| {
            let dot: f32 = (0..c).map(|i| w[i] * d[i] * x[i]).sum();
            let k = r * r * r * dot / c as f32;
            for i in 0..c {
                di[i] += r * w[i] * d[i] - k * x[i];
            }
        },
    );
    let Some((dw, accumulate)) = dw else { return };
    assert_len("rmsnorm_backward", "dw", dw.len(), &[c]);
    // Parallel over columns, rows summed in order: deterministic.
    const COLS: usize = 64;
    dw.par_chunks_mut(COLS).enumerate().for_each(|(j, acc)| {
        if !accumulate {
            acc.fill(0.0);
        }
        let c0 = j * COLS;
        for ((d, x), &r) in dout.chunks(c).zip(inp.chunks(c)).zip(rstd) {
            for (k, a) in acc.iter_mut().enumerate() {
                *a += d[c0 + k] * x[c0 + k] * r;
            }
        }
    });
}

/// Rotary tables for positions `0..t`: `cos`/`sin` `[t, head_dim/2]`,
/// computed as transformers does (f32 inverse frequencies `1/θ^(2j/d)`,
/// f32 angles `pos·inv_freq`), so long positions round the same way.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rope {
    /// Positions covered.
    pub t: usize,
    /// Half the head width.
    pub half: usize,
    /// `cos(pos · inv_freq[j])`, row-major `[t, half]`.
    pub cos: Vec<f32>,
    /// `sin(pos · inv_freq[j])`.
    pub sin: Vec<f32>,
}

impl Rope {
    /// Tables for `t` positions of heads `head_dim` wide (even).
    pub fn new(t: usize, head_dim: usize, theta: f64) -> Self {
        let half = head_dim / 2;
        let theta = theta as f32;
        let inv_freq: Vec<f32> = (0..half).map(|j| 1.0 / theta.powf((2 * j) as f32 / head_dim as f32)).collect();
        let angles: Vec<f32> = (0..t).flat_map(|p| inv_freq.iter().map(move |&f| p as f32 * f)).collect();
        Rope {
            t,
            half,
            cos: angles.iter().map(|&a| (a as f64).cos() as f32).collect(),
            sin: angles.iter().map(|&a| (a as f64).sin() as f32).collect(),
        }
    }
}

/// Rotates, in place, the first `n_heads` heads of every row of `x` (rows
/// `row_width` apart; row `r` at position `r mod t`) with HF's
/// `rotate_half` pairing `(j, j + d/2)`:
/// `x'_j = x_j·cos − x_{j+d/2}·sin`, `x'_{j+d/2} = x_{j+d/2}·cos + x_j·sin`.
/// `inverse` applies the transpose rotation (−sin): the backward pass.
pub fn rope_apply(x: &mut [f32], rope: &Rope, row_width: usize, n_heads: usize, inverse: bool) {
    let (t, half) = (rope.t, rope.half);
    assert!(n_heads * 2 * half <= row_width, "rope_apply: {n_heads} heads of {} exceed the row width", 2 * half);
    assert!(x.len().is_multiple_of(row_width), "rope_apply: {} values are not rows of {row_width}", x.len());
    assert!(x.is_empty() || t > 0, "rope_apply: empty tables");
    let sign = if inverse { -1.0 } else { 1.0 };
    x.par_chunks_mut(row_width).enumerate().for_each(|(r, row)| {
        let pos = r % t;
        let (cos, sin) = (&rope.cos[pos * half..][..half], &rope.sin[pos * half..][..half]);
        for head in row[..n_heads * 2 * half].chunks_mut(2 * half) {
            let (a, b) = head.split_at_mut(half);
            for j in 0..half {
                let (s, c) = (sign * sin[j], cos[j]);
                let (x1, x2) = (a[j], b[j]);
                a[j] = x1 * c - x2 * s;
                b[j] = x2 * c + x1 * s;
            }
        }
    });
}

/// Shapes of one grouped-query attention call. Rows of `qkv` hold the
/// query heads, then the key heads, then the value heads:
/// `[q: n_head·d | k: n_kv_head·d | v: n_kv_head·d]`; query head `h` reads
/// key/value head `h / (n_head / n_kv_head)` (transformers' `repeat_kv`).
#[derive(Debug, Clone, Copy)]
pub struct GqaShape {
    /// Sequences.
    pub b: usize,
    /// Sequence length.
    pub t: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (divides `n_head`).
    pub n_kv_head: usize,
    /// Head width.
    pub head_dim: usize,
}

impl GqaShape {
    /// Width of the query heads together.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of one `qkv` row.
    pub fn qkv_width(&self) -> usize {
        (self.n_head + 2 * self.n_kv_head) * self.head_dim
    }

    /// Panics unless the shape is usable and every slice has the length it implies.
    fn check(&self, kernel: &str, slices: &[(&str, usize, &[usize])]) {
        assert!(
            self.t > 0 && self.head_dim > 0 && self.n_kv_head > 0 && self.n_head.is_multiple_of(self.n_kv_head),
            "{kernel}: invalid shape {self:?}"
        );
        for (name, len, factors) in slices {
            assert_len(kernel, name, *len, factors);
        }
    }
}

/// Causal grouped-query attention. `qkv` `[B·T, qkv_width]` (q and k
/// already rotated), `att` receives the softmax probabilities
/// `[B, n_head, T, T]` (zero above the diagonal), `y` the head outputs
/// `[B·T, n_head·d]`; `heads` is scratch of `y`'s size (head-major outputs,
/// so every task writes a contiguous block).
pub fn attention_forward(y: &mut [f32], att: &mut [f32], heads: &mut [f32], qkv: &[f32], s: GqaShape) {
    let GqaShape { b, t, n_head, n_kv_head, head_dim: d } = s;
    let (qd, w) = (s.q_dim(), s.qkv_width());
    s.check(
        "attention_forward",
        &[
            ("y", y.len(), &[b, t, qd]),
            ("att", att.len(), &[b, n_head, t, t]),
            ("heads", heads.len(), &[b, t, qd]),
            ("qkv", qkv.len(), &[b, t, w]),
        ],
    );
    let group = n_head / n_kv_head;
    let scale = 1.0 / (d as f32).sqrt();
    let par = parallelism(true);
    att.par_chunks_mut(t * t).zip(heads.par_chunks_mut(t * d)).enumerate().for_each(|(bh, (a, yh))| {
        let (bi, h) = (bh / n_head, bh % n_head);
        let row0 = bi * t * w;
        let kv = qd + (h / group) * d;
        let q = Strided { data: qkv, offset: row0 + h * d, rs: w, cs: 1 };
        let k_t = Strided { data: qkv, offset: row0 + kv, rs: 1, cs: w };
        let v = Strided { data: qkv, offset: row0 + kv + n_kv_head * d, rs: w, cs: 1 };
        gemm_into(t, t, d, a, 0, t, false, q, k_t, scale, par);
        gpt::kernels::causal_softmax_rows(a, t);
        gemm_into(t, d, t, yh, 0, d, false, Strided::rows(a, t), v, 1.0, par);
    });
    // Head-major [B, H, T, d] → rows [B·T, H·d].
    y.par_chunks_mut(qd).enumerate().for_each(|(r, row)| {
        let (bi, ti) = (r / t, r % t);
        for (h, dst) in row.chunks_mut(d).enumerate() {
            dst.copy_from_slice(&heads[((bi * n_head + h) * t + ti) * d..][..d]);
        }
    });
}

/// Backward of [`attention_forward`]: overwrites `dqkv` (gradients of the
/// rotated q and k, and of v); `datt` is scratch of `att`'s size, `heads`
/// scratch of `dqkv`'s size. One task per (sequence, key/value head) runs
/// its query heads in order and sums their key/value gradients in that
/// order, so the result does not depend on scheduling.
pub fn attention_backward(
    dqkv: &mut [f32],
    datt: &mut [f32],
    heads: &mut [f32],
    dy: &[f32],
    qkv: &[f32],
    att: &[f32],
    s: GqaShape,
) {
    let GqaShape { b, t, n_head, n_kv_head, head_dim: d } = s;
    let (qd, w) = (s.q_dim(), s.qkv_width());
    let kvd = n_kv_head * d;
    s.check(
        "attention_backward",
        &[
            ("dqkv", dqkv.len(), &[b, t, w]),
            ("datt", datt.len(), &[b, n_head, t, t]),
            ("heads", heads.len(), &[b, t, w]),
            ("dy", dy.len(), &[b, t, qd]),
            ("qkv", qkv.len(), &[b, t, w]),
            ("att", att.len(), &[b, n_head, t, t]),
        ],
    );
    let group = n_head / n_kv_head;
    let scale = 1.0 / (d as f32).sqrt();
    let par = parallelism(true);
    // Head-major scratch: dq [B, H, T, d], dk [B, KV, T, d], dv [B, KV, T, d].
    let (dq_h, dkv_h) = heads.split_at_mut(b * t * qd);
    let (dk_h, dv_h) = dkv_h.split_at_mut(b * t * kvd);
    datt.par_chunks_mut(group * t * t)
        .zip(dq_h.par_chunks_mut(group * t * d))
        .zip(dk_h.par_chunks_mut(t * d).zip(dv_h.par_chunks_mut(t * d)))
        .enumerate()
        .for_each(|(bkv, ((da_g, dq_g), (dk, dv)))| {
            let (bi, kvh) = (bkv / n_kv_head, bkv % n_kv_head);
            let row0 = bi * t * w;
            let k = Strided { data: qkv, offset: row0 + qd + kvh * d, rs: w, cs: 1 };
            let v_t = Strided { data: qkv, offset: row0 + qd + kvd + kvh * d, rs: 1, cs: w };
            for g in 0..group {
                let h = kvh * group + g;
                let a = &att[(bi * n_head + h) * t * t..][..t * t];
                let da = &mut da_g[g * t * t..][..t * t];
                let dy_h = Strided { data: dy, offset: bi * t * qd + h * d, rs: qd, cs: 1 };
                let q = Strided { data: qkv, offset: row0 + h * d, rs: w, cs: 1 };
                // datt = dy · vᵀ, then softmax backward in place: dpre = att ⊙ (datt − Σ att·datt).
                gemm_into(t, t, d, da, 0, t, false, dy_h, v_t, 1.0, par);
                gpt::kernels::causal_softmax_backward_rows(da, a, t);
                let first = g == 0;
                // dq = scale · dpre · k ; dk (+)= scale · dpreᵀ · q ; dv (+)= attᵀ · dy
                let dq = &mut dq_g[g * t * d..][..t * d];
                gemm_into(t, d, t, dq, 0, d, false, Strided::rows(da, t), k, scale, par);
                gemm_into(t, d, t, dk, 0, d, !first, Strided::transposed(da, t), q, scale, par);
                gemm_into(t, d, t, dv, 0, d, !first, Strided::transposed(a, t), dy_h, 1.0, par);
            }
        });
    // Head-major back to rows [B·T, q | k | v].
    dqkv.par_chunks_mut(w).enumerate().for_each(|(r, row)| {
        let (bi, ti) = (r / t, r % t);
        let (rq, rkv) = row.split_at_mut(qd);
        let (rk, rv) = rkv.split_at_mut(kvd);
        for (h, dst) in rq.chunks_mut(d).enumerate() {
            dst.copy_from_slice(&dq_h[((bi * n_head + h) * t + ti) * d..][..d]);
        }
        for (kvh, (dk, dv)) in rk.chunks_mut(d).zip(rv.chunks_mut(d)).enumerate() {
            let at = ((bi * n_kv_head + kvh) * t + ti) * d;
            dk.copy_from_slice(&dk_h[at..][..d]);
            dv.copy_from_slice(&dv_h[at..][..d]);
        }
    });
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fast_exp(-x))
}

/// SwiGLU: `m = silu(g) · u` where rows of `gu` are `[g: f | u: f]`
/// (gate_proj's and up_proj's outputs side by side), `m` `[n, f]`.
pub fn swiglu_forward(m: &mut [f32], gu: &[f32], f: usize) {
    let n = m.len() / f.max(1);
    assert_len("swiglu_forward", "m", m.len(), &[n, f]);
    assert_len("swiglu_forward", "gu", gu.len(), &[n, 2, f]);
    m.par_chunks_mut(f).zip(gu.par_chunks(2 * f)).for_each(|(m, gu)| {
        let (g, u) = gu.split_at(f);
        for i in 0..f {
            m[i] = g[i] * sigmoid(g[i]) * u[i];
        }
    });
}

/// Backward of [`swiglu_forward`]: overwrites `dgu` `[n, 2f]` with
/// `dg = dm·u·σ(g)·(1 + g·(1 − σ(g)))` and `du = dm·silu(g)`.
pub fn swiglu_backward(dgu: &mut [f32], dm: &[f32], gu: &[f32], f: usize) {
    let n = dm.len() / f.max(1);
    assert_len("swiglu_backward", "dm", dm.len(), &[n, f]);
    assert_len("swiglu_backward", "gu", gu.len(), &[n, 2, f]);
    assert_len("swiglu_backward", "dgu", dgu.len(), &[n, 2, f]);
    dgu.par_chunks_mut(2 * f).zip(gu.par_chunks(2 * f)).zip(dm.par_chunks(f)).for_each(|((dgu, gu), dm)| {
        let (g, u) = gu.split_at(f);
        let (dg, du) = dgu.split_at_mut(f);
        for i in 0..f {
            let sg = sigmoid(g[i]);
            dg[i] = dm[i] * u[i] * sg * (1.0 + g[i] * (1.0 - sg));
            du[i] = dm[i] * g[i] * sg;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::rng::SplitMix64;

    fn randn(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// `Σ dout · f(x)` as a function of x in f64, for central differences.
    fn probe(f: &dyn Fn(&[f32]) -> Vec<f32>, x: &[f32], dout: &[f32]) -> f64 {
        f(x).iter().zip(dout).map(|(&a, &b)| a as f64 * b as f64).sum()
    }

    /// Checks a backward `dx` against central differences of `Σ dout·f(x)`
    /// at every element. h = 1e-2 on O(1) inputs: f32 rounding of the
    /// probe (~1e-6 · its magnitude ~10) / h ≈ 1e-3, truncation O(h²)·f''' ≈ 1e-4;
    /// hence |error| ≤ 2e-3 + 1e-2·|fd|.
    fn check(name: &str, f: &dyn Fn(&[f32]) -> Vec<f32>, x: &[f32], dout: &[f32], dx: &[f32]) {
        let h = 1e-2f32;
        for i in 0..x.len() {
            let (mut up, mut down) = (x.to_vec(), x.to_vec());
            up[i] += h;
            down[i] -= h;
            let fd = (probe(f, &up, dout) - probe(f, &down, dout)) / (up[i] as f64 - down[i] as f64);
            let err = (dx[i] as f64 - fd).abs();
            assert!(err <= 2e-3 + 1e-2 * fd.abs(), "{name}[{i}]: backward {} vs central difference {fd}", dx[i]);
        }
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
        rmsnorm_backward(&mut dx, Some((&mut dw, false)), &dout, &x, &rstd, &w, c);
        check("rmsnorm dx", &fwd, &x, &dout, &dx);
        let fw = |w: &[f32]| {
            let (mut o, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut o, &mut r, &x, w, c, 1e-5);
            o
        };
        check("rmsnorm dw", &fw, &w, &dout, &dw);
    }

    #[test]
    fn rope_inverse_undoes_it_and_matches_rotate_half() {
        let (t, d, heads, w) = (5, 8, 3, 30);
        let rope = Rope::new(t, d, 10000.0);
        let x = randn(2 * t * w, 4);
        let mut y = x.clone();
        rope_apply(&mut y, &rope, w, heads, false);
        // Position 3, head 1, pair j = 1: the rotate_half formula by hand.
        let (r, j, half) = (3, 1, d / 2);
        let inv = 1.0 / 10000f64.powf(2.0 * j as f64 / d as f64);
        let (c, s) = ((3.0 * inv).cos(), (3.0 * inv).sin());
        let at = |v: &[f32], k: usize| v[r * w + d + k] as f64;
        assert!((at(&y, j) - (at(&x, j) * c - at(&x, j + half) * s)).abs() < 1e-6);
        assert!((at(&y, j + half) - (at(&x, j + half) * c + at(&x, j) * s)).abs() < 1e-6);
        // Columns past the rotated heads are untouched; the inverse restores x.
        assert_eq!(y[w - 6..w], x[w - 6..w]);
        rope_apply(&mut y, &rope, w, heads, true);
        let err = y.iter().zip(&x).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(err < 1e-5, "rotation then inverse differs by {err}");
    }

    #[test]
    fn gqa_attention_backward_matches_central_differences() {
        let s = GqaShape { b: 2, t: 4, n_head: 4, n_kv_head: 2, head_dim: 2 };
        let (qd, w) = (s.q_dim(), s.qkv_width());
        let n = s.b * s.t;
        let qkv = randn(n * w, 5);
        let dy = randn(n * qd, 6);
        let fwd = |qkv: &[f32]| {
            let (mut y, mut att, mut heads) = (vec![0.0; n * qd], vec![0.0; s.b * 4 * 16], vec![0.0; n * qd]);
            attention_forward(&mut y, &mut att, &mut heads, qkv, s);
            y
        };
        let (mut y, mut att, mut heads) = (vec![0.0; n * qd], vec![0.0; s.b * 4 * 16], vec![0.0; n * qd]);
        attention_forward(&mut y, &mut att, &mut heads, &qkv, s);
        let (mut dqkv, mut datt, mut hb) = (vec![0.0; n * w], vec![0.0; att.len()], vec![0.0; n * w]);
        attention_backward(&mut dqkv, &mut datt, &mut hb, &dy, &qkv, &att, s);
        check("attention dqkv", &fwd, &qkv, &dy, &dqkv);
        // Position 0 attends to itself only, so query head h outputs the value
        // of key/value head h / 2 there: the grouping of transformers' repeat_kv.
        for h in 0..s.n_head {
            let v0 = qd + s.n_kv_head * s.head_dim + (h / 2) * s.head_dim;
            assert_eq!(y[h * 2..h * 2 + 2], qkv[v0..v0 + 2], "head {h}");
        }
    }

    #[test]
    fn swiglu_backward_matches_central_differences() {
        let (n, f) = (3, 5);
        let (gu, dm) = (randn(n * 2 * f, 7), randn(n * f, 8));
        let fwd = |gu: &[f32]| {
            let mut m = vec![0.0; n * f];
            swiglu_forward(&mut m, gu, f);
            m
        };
        let mut dgu = vec![0.0; n * 2 * f];
        swiglu_backward(&mut dgu, &dm, &gu, f);
        check("swiglu dgu", &fwd, &gu, &dm, &dgu);
    }

    #[test]
    fn kernels_reject_slices_of_the_wrong_length() {
        let s = GqaShape { b: 1, t: 2, n_head: 2, n_kv_head: 1, head_dim: 2 };
        let bad = std::panic::catch_unwind(|| {
            attention_forward(&mut [0.0; 8], &mut [0.0; 8], &mut [0.0; 8], &[0.0; 15], s);
        });
        assert!(bad.is_err(), "short qkv");
        let bad = std::panic::catch_unwind(|| swiglu_forward(&mut [0.0; 4], &[0.0; 7], 2));
        assert!(bad.is_err(), "short gu");
        let bad = std::panic::catch_unwind(|| {
            linear_forward(&mut [0.0; 4], 1, 2, false, &[0.0; 2], &[0.0; 4], 1, 2, 2, 1.0, Operands::F32)
        });
        assert!(bad.is_err(), "columns past the row");
    }
}
