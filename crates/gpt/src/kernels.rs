//! Forward and backward kernels over row-major f32 slices.
//!
//! Conventions: `n_rows` = B·T rows of width `c`. Backward kernels *add*
//! into parameter gradients (`dw`, `db`: the flat buffer accumulates across
//! micro-steps) and *overwrite* activation gradients (`dinp`), except
//! [`layernorm_backward`], which adds into the residual-stream gradient.
//! Every reduction has a fixed order, so results do not depend on the
//! number of threads.

pub use linalg::{gemm_into, gemm_raw, parallelism, Operands, Par, Strided};
use multiversion::multiversion;
use rayon::prelude::*;

/// LayerNorm epsilon of GPT-2.
pub const LN_EPS: f32 = 1e-5;

/// Rows per task for reductions over rows (parameter gradients).
const ROWS_PER_TASK: usize = 32;

/// The GEMM operands a training precision asks for: bf16 in `bf16` mode, f32
/// otherwise (f16 mode computes in f32: no f16 dot-product instructions are
/// used). [`Par::with`] turns bf16 into f32 on a CPU without AVX512-BF16.
pub fn operands(prec: engine::Precision) -> Operands {
    match prec {
        engine::Precision::Bf16 => Operands::Bf16,
        engine::Precision::F32 | engine::Precision::F16 => Operands::F32,
    }
}

/// A raw pointer that may cross threads; each user writes a disjoint block.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only for writes to disjoint regions (see call sites).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// `out[r] = wte[tokens[r]] + wpe[r mod t]`.
pub fn encoder_forward(out: &mut [f32], tokens: &[u32], wte: &[f32], wpe: &[f32], t: usize, c: usize) {
    out.par_chunks_mut(c).zip(tokens.par_iter()).enumerate().for_each(|(r, (o, &tok))| {
        let (e, p) = (&wte[tok as usize * c..][..c], &wpe[(r % t) * c..][..c]);
        for i in 0..c {
            o[i] = e[i] + p[i];
        }
    });
}

/// Adds the gradients of [`encoder_forward`] into `dwte` and `dwpe` (either
/// may be absent: a frozen tensor).
pub fn encoder_backward(
    mut dwte: Option<&mut [f32]>,
    mut dwpe: Option<&mut [f32]>,
    dout: &[f32],
    tokens: &[u32],
    t: usize,
    c: usize,
) {
    // Serial scatter-add in row order: deterministic, and O(B·T·C) is small.
    for (r, (d, &tok)) in dout.chunks(c).zip(tokens).enumerate() {
        if let Some(dwte) = dwte.as_deref_mut() {
            let e = &mut dwte[tok as usize * c..][..c];
            for i in 0..c {
                e[i] += d[i];
            }
        }
        if let Some(dwpe) = dwpe.as_deref_mut() {
            let p = &mut dwpe[(r % t) * c..][..c];
            for i in 0..c {
                p[i] += d[i];
            }
        }
    }
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
    out.par_chunks_mut(c)
        .zip(inp.par_chunks(c))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .for_each(|((o, x), (mu, rs))| (*mu, *rs) = layernorm_row(o, x, w, b));
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

/// A parameter gradient for a backward kernel: the buffer and whether to
/// add into it (`false`: overwrite every element); `None` skips the
/// computation (a frozen tensor).
pub type ParamGrad<'a> = Option<(&'a mut [f32], bool)>;

/// Sums per-task partial results of width `Σ targets' widths` over fixed
/// chunks of rows, in chunk order, and adds them into each target (or
/// writes them, where its flag says overwrite). Absent targets are skipped;
/// with none present nothing is computed.
fn reduce_rows(
    n_rows: usize,
    targets: &mut [ParamGrad<'_>],
    widths: &[usize],
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    if targets.iter().all(Option::is_none) {
        return;
    }
    let width: usize = widths.iter().sum();
    let partials: Vec<Vec<f32>> = (0..n_rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|chunk| {
            let mut acc = vec![0.0f32; width];
            f(chunk * ROWS_PER_TASK..((chunk + 1) * ROWS_PER_TASK).min(n_rows), &mut acc);
            acc
        })
        .collect();
    for (t, &w) in targets.iter_mut().zip(widths) {
        if let Some((t, false)) = t {
            assert_eq!(t.len(), w, "gradient target length");
            t.fill(0.0);
        }
    }
    for p in &partials {
        let mut off = 0;
        for (t, &w) in targets.iter_mut().zip(widths) {
            if let Some((t, _)) = t {
                for (d, s) in t.iter_mut().zip(&p[off..off + w]) {
                    *d += s;
                }
            }
            off += w;
        }
    }
}

/// Backward of [`layernorm_forward`]: adds into `dinp`; `dw`, `db` as
/// their [`ParamGrad`] flags say.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dinp: &mut [f32],
    dw: ParamGrad<'_>,
    db: ParamGrad<'_>,
    dout: &[f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    w: &[f32],
    c: usize,
) {
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
}

/// `out[r×oc] = residual + inp[r×ic] · w[ic×oc] + bias` (HF `Conv1D` layout).
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    n_rows: usize,
    ic: usize,
    oc: usize,
    ops: Operands,
) {
    let init = bias.is_some() || residual.is_some();
    if init {
        out.par_chunks_mut(oc).enumerate().for_each(|(r, o)| {
            match residual {
                Some(res) => o.copy_from_slice(&res[r * oc..][..oc]),
                None => o.fill(0.0),
            }
            if let Some(b) = bias {
                o.iter_mut().zip(b).for_each(|(o, b)| *o += b);
            }
        });
    }
    let par = parallelism(false).with(ops);
    gemm_into(n_rows, oc, ic, out, 0, oc, init, Strided::rows(inp, ic), Strided::rows(w, oc), 1.0, par);
}

/// Backward of [`matmul_forward`]: overwrites `dinp`; `dw` and `db` as
/// their [`ParamGrad`] flags say (absent: not computed).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: &mut [f32],
    dw: ParamGrad<'_>,
    db: ParamGrad<'_>,
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    n_rows: usize,
    ic: usize,
    oc: usize,
    ops: Operands,
) {
    let par = parallelism(false).with(ops);
    // dinp = dout · wᵀ
    gemm_into(n_rows, ic, oc, dinp, 0, ic, false, Strided::rows(dout, oc), Strided::transposed(w, oc), 1.0, par);
    // dw (+)= inpᵀ · dout
    if let Some((dw, accumulate)) = dw {
        assert_eq!(dw.len(), ic * oc, "dw length");
        gemm_into(
            ic,
            oc,
            n_rows,
            dw,
            0,
            oc,
            accumulate,
            Strided::transposed(inp, ic),
            Strided::rows(dout, oc),
            1.0,
            par,
        );
    }
    if let Some((db, accumulate)) = db {
        bias_backward(db, dout, oc, accumulate);
    }
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

/// `db (+)= Σ_rows dout`, parallel over columns, rows summed in order.
pub fn bias_backward(db: &mut [f32], dout: &[f32], oc: usize, accumulate: bool) {
    const COLS: usize = 64;
    db.par_chunks_mut(COLS).enumerate().for_each(|(j, acc)| {
        if !accumulate {
            acc.fill(0.0);
        }
        for row in dout.chunks(oc) {
            for (a, d) in acc.iter_mut().zip(&row[j * COLS..]) {
                *a += d;
            }
        }
    });
}

const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2/π)

/// `e^x` for f32 without a libm call, so loops over it vectorise: Cody–Waite
/// range reduction `x = n·ln2 + r` and Cephes' degree-6 polynomial for `e^r`
/// (max relative error ≈ 2 ulp on [-87, 88]; tested against `f32::exp`).
/// Inputs are clamped to [-87.3, 88.7]: below, the result flushes to ~0.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding and subtracting rounds to an integer
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5; // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32
    let er = p * r * r + r + 1.0;
    // 2ⁿ by building the exponent bits; n ∈ [-126, 128] after the clamp.
    let two_n = f32::from_bits(((n as i32 + 127).clamp(0, 255) as u32) << 23);
    er * two_n
}

/// `tanh(x) = 1 − 2/(e^{2x} + 1)` on [`fast_exp`]: absolute error ≤ 3e-7
/// (relative accuracy near 0 is not needed: GELU multiplies by x).
#[inline(always)]
pub fn fast_tanh(x: f32) -> f32 {
    1.0 - 2.0 / (fast_exp(2.0 * x) + 1.0)
}

/// GELU, tanh approximation (`gelu_new` in Hugging Face).
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    out.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(o, x)| gelu_forward_chunk(o, x));
}

/// The elementwise loops below are compiled for AVX-512 and AVX2 as well as
/// the baseline and picked at run time (`multiversion`): the same IEEE
/// operations in the same order (Rust never contracts `a·b + c` into an FMA
/// by itself), so every path gives the same bits, only wider.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn gelu_forward_chunk(o: &mut [f32], x: &[f32]) {
    for (o, &x) in o.iter_mut().zip(x) {
        let cube = 0.044715 * x * x * x;
        *o = 0.5 * x * (1.0 + fast_tanh(GELU_SCALE * (x + cube)));
    }
}

/// In place: `d ← d · gelu'(inp)`.
pub fn gelu_backward_inplace(d: &mut [f32], inp: &[f32]) {
    d.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(d, x)| gelu_backward_chunk(d, x));
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn gelu_backward_chunk(d: &mut [f32], x: &[f32]) {
    for (d, &x) in d.iter_mut().zip(x) {
        let cube = 0.044715 * x * x * x;
        let th = fast_tanh(GELU_SCALE * (x + cube));
        let sech2 = 1.0 - th * th;
        let grad = 0.5 * (1.0 + th) + 0.5 * x * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x);
        *d *= grad;
    }
}

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Sequences.
    pub b: usize,
    /// Sequence length.
    pub t: usize,
    /// Width C.
    pub c: usize,
    /// Heads.
    pub n_head: usize,
    /// Operands of the per-head GEMMs.
    pub ops: Operands,
}

impl AttnShape {
    /// Panics unless the shape is usable and every slice has exactly the
    /// length it implies (`name`, factors): the attention kernels write
    /// through raw pointers from one task per `T×T` block of `att`, so the
    /// lengths are what makes them sound. Products are checked, so an
    /// overflowing shape cannot pass.
    fn check(&self, kernel: &str, slices: &[(&str, usize, &[usize])]) {
        assert!(
            self.n_head > 0 && self.t > 0 && self.c > 0 && self.c.is_multiple_of(self.n_head),
            "{kernel}: invalid shape {self:?} (n_head must be > 0 and divide c; t, c > 0)"
        );
        for (name, len, factors) in slices {
            let want = factors.iter().try_fold(1usize, |acc, &f| acc.checked_mul(f));
            assert!(
                want == Some(*len),
                "{kernel}: `{name}` has {len} elements but shape {self:?} needs {want:?} (product of {factors:?})"
            );
        }
    }
}

/// Causal softmax of a `t × t` score matrix, in place, row by row: row `i`
/// becomes softmax over its first `i + 1` entries (max-subtracted, summed
/// in f32 in order), and the masked entries become 0. Shared by every
/// family's attention, so they round alike.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
pub fn causal_softmax_rows(a: &mut [f32], t: usize) {
    for (ti, row) in a.chunks_mut(t).enumerate() {
        let valid = &mut row[..=ti];
        let max = valid.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        // The exponentials first (vectorised), then their sum in index order.
        valid.iter_mut().for_each(|x| *x = fast_exp(*x - max));
        let sum = valid.iter().fold(0.0f32, |acc, &x| acc + x);
        let inv = 1.0 / sum;
        valid.iter_mut().for_each(|x| *x *= inv);
        row[ti + 1..].fill(0.0);
    }
}

/// Backward of [`causal_softmax_rows`], in place: `d` holds the gradient of
/// the probabilities `a` and becomes that of the scores,
/// `a ⊙ (d − Σ a·d)` per row; the masked entries become 0.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
pub fn causal_softmax_backward_rows(d: &mut [f32], a: &[f32], t: usize) {
    for ti in 0..t {
        let (ar, dr) = (&a[ti * t..][..=ti], &mut d[ti * t..][..t]);
        let dot: f32 = ar.iter().zip(dr.iter()).map(|(x, y)| x * y).sum();
        for j in 0..=ti {
            dr[j] = ar[j] * (dr[j] - dot);
        }
        dr[ti + 1..].fill(0.0);
    }
}

/// Causal multi-head attention. `qkv` is `[B, T, 3C]` (q | k | v), `att`
/// receives the softmax probabilities `[B, NH, T, T]` (zero above the
/// diagonal), `out` the `[B, T, C]` head outputs.
///
/// # Panics
/// Unless `out`, `att` and `qkv` have exactly these lengths.
pub fn attention_forward(out: &mut [f32], att: &mut [f32], qkv: &[f32], s: AttnShape) {
    let AttnShape { b, t, c, n_head, ops } = s;
    let par = Par::ONE.with(ops);
    s.check(
        "attention_forward",
        &[("out", out.len(), &[b, t, c]), ("att", att.len(), &[b, n_head, t, t]), ("qkv", qkv.len(), &[b, t, 3, c])],
    );
    let hd = c / n_head;
    let scale = 1.0 / (hd as f32).sqrt();
    let out_ptr = SendPtr(out.as_mut_ptr());
    att.par_chunks_mut(t * t).enumerate().for_each(|(bh, a)| {
        let (bi, h) = (bh / n_head, bh % n_head);
        let base = bi * t * 3 * c + h * hd;
        let q = Strided { data: qkv, offset: base, rs: 3 * c, cs: 1 };
        let k_t = Strided { data: qkv, offset: base + c, rs: 1, cs: 3 * c };
        let v = Strided { data: qkv, offset: base + 2 * c, rs: 3 * c, cs: 1 };
        gemm_into(t, t, hd, a, 0, t, false, q, k_t, scale, par);
        causal_softmax_rows(a, t);
        let att_view = Strided::rows(a, t);
        // SAFETY: head (bi, h) writes rows bi·T.. of columns h·hd..(h+1)·hd of
        // `out` only; no two tasks share a (bi, h), and `out` is large enough.
        unsafe {
            let dst = { out_ptr }.0.add(bi * t * c + h * hd);
            gemm_raw(t, hd, t, dst, c, false, att_view, v, 1.0, par);
        }
    });
}

/// Backward of [`attention_forward`]: overwrites `dqkv`; `datt` is scratch
/// of the size of `att`.
///
/// # Panics
/// Unless every slice has exactly the length the shape implies.
pub fn attention_backward(dqkv: &mut [f32], datt: &mut [f32], dout: &[f32], qkv: &[f32], att: &[f32], s: AttnShape) {
    let AttnShape { b, t, c, n_head, ops } = s;
    let par = Par::ONE.with(ops);
    s.check(
        "attention_backward",
        &[
            ("dqkv", dqkv.len(), &[b, t, 3, c]),
            ("datt", datt.len(), &[b, n_head, t, t]),
            ("dout", dout.len(), &[b, t, c]),
            ("qkv", qkv.len(), &[b, t, 3, c]),
            ("att", att.len(), &[b, n_head, t, t]),
        ],
    );
    let hd = c / n_head;
    let scale = 1.0 / (hd as f32).sqrt();
    let dqkv_ptr = SendPtr(dqkv.as_mut_ptr());
    datt.par_chunks_mut(t * t).enumerate().for_each(|(bh, da)| {
        let (bi, h) = (bh / n_head, bh % n_head);
        let base = bi * t * 3 * c + h * hd;
        let a = &att[bh * t * t..][..t * t];
        let dout_h = Strided { data: dout, offset: bi * t * c + h * hd, rs: c, cs: 1 };
        let v_t = Strided { data: qkv, offset: base + 2 * c, rs: 1, cs: 3 * c };
        // datt = dout · vᵀ
        gemm_into(t, t, hd, da, 0, t, false, dout_h, v_t, 1.0, par);
        causal_softmax_backward_rows(da, a, t);
        let dpre = Strided::rows(da, t);
        let dpre_t = Strided::transposed(da, t);
        let q = Strided { data: qkv, offset: base, rs: 3 * c, cs: 1 };
        let k = Strided { data: qkv, offset: base + c, rs: 3 * c, cs: 1 };
        // SAFETY: head (bi, h) writes the q, k and v columns of head h in the
        // rows of sequence bi only; tasks are disjoint and `dqkv` is large enough.
        unsafe {
            let p = { dqkv_ptr }.0.add(base);
            // dq = scale · dpre · k ; dk = scale · dpreᵀ · q ; dv = attᵀ · dout
            gemm_raw(t, hd, t, p, 3 * c, false, dpre, k, scale, par);
            gemm_raw(t, hd, t, p.add(c), 3 * c, false, dpre_t, q, scale, par);
            gemm_raw(t, hd, t, p.add(2 * c), 3 * c, false, Strided::transposed(a, t), dout_h, 1.0, par);
        }
    });
}

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
}

/// One row of [`softmax_cross_entropy`]: the loss, and with a gradient
/// scale the row overwritten by its gradient. The exponentials are computed
/// in place first (vectorised) and summed in index order.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn cross_entropy_row(row: &mut [f32], tgt: usize, grad_scale: Option<f32>) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let logit = row[tgt];
    match grad_scale {
        None => {
            let sum = row.iter().fold(0.0f32, |acc, &x| acc + fast_exp(x - max));
            sum.ln() - (logit - max)
        }
        Some(s) => {
            row.iter_mut().for_each(|x| *x = fast_exp(*x - max));
            let sum = row.iter().fold(0.0f32, |acc, &x| acc + x);
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|x| *x = s * *x * inv);
            row[tgt] -= s;
            sum.ln() - (logit - max)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Safe code must not be able to make the attention kernels write out of
    /// bounds: a longer `att` (more tasks) or a shorter `qkv`/`out` panics
    /// before any write.
    #[test]
    fn attention_kernels_reject_slices_of_the_wrong_length() {
        let s = AttnShape { b: 1, t: 4, c: 8, n_head: 2, ops: Operands::F32 };
        let (bt, att_len) = (4, 2 * 16);
        let ok = |out: usize, att: usize, qkv: usize| {
            std::panic::catch_unwind(|| {
                let (mut o, mut a, q) = (vec![0.0f32; out], vec![0.0f32; att], vec![0.1f32; qkv]);
                attention_forward(&mut o, &mut a, &q, s);
            })
            .is_ok()
        };
        assert!(ok(bt * 8, att_len, bt * 24));
        assert!(!ok(bt * 8, 4 * att_len, bt * 24), "longer att: more tasks than out has rows");
        assert!(!ok(bt * 8, att_len, bt * 24 - 1), "short qkv");
        assert!(!ok(bt * 8 - 1, att_len, bt * 24), "short out");
        let back = |dqkv: usize, datt: usize, dout: usize, qkv: usize, att: usize| {
            std::panic::catch_unwind(|| {
                let (mut dq, mut da) = (vec![0.0f32; dqkv], vec![0.0f32; datt]);
                attention_backward(&mut dq, &mut da, &vec![0.1; dout], &vec![0.1; qkv], &vec![0.1; att], s);
            })
            .is_ok()
        };
        assert!(back(bt * 24, att_len, bt * 8, bt * 24, att_len));
        assert!(!back(bt * 24, 4 * att_len, bt * 8, bt * 24, 4 * att_len), "longer datt/att");
        assert!(!back(bt * 24 - 1, att_len, bt * 8, bt * 24, att_len), "short dqkv");
        assert!(!back(bt * 24, att_len, bt * 8 - 1, bt * 24, att_len), "short dout");
        let huge = AttnShape { b: usize::MAX / 2 + 1, t: 1, c: 2, n_head: 1, ops: Operands::F32 };
        let overflow = std::panic::catch_unwind(|| attention_forward(&mut [], &mut [], &[], huge));
        assert!(overflow.is_err(), "a shape whose sizes overflow must not pass as empty");
    }

    #[test]
    fn fast_exp_and_tanh_match_libm() {
        let (mut worst_exp, mut worst_tanh) = (0.0f64, 0.0f64);
        let mut x = -87.0f32;
        while x < 88.0 {
            let rel = ((fast_exp(x) as f64 - (x as f64).exp()) / (x as f64).exp()).abs();
            worst_exp = worst_exp.max(rel);
            x += 0.0137;
        }
        let mut x = -12.0f32;
        while x < 12.0 {
            worst_tanh = worst_tanh.max((fast_tanh(x) as f64 - (x as f64).tanh()).abs());
            x += 0.000_731;
        }
        // 2.5e-7 ≈ 2 ulp relative for exp; 3e-7 absolute for tanh.
        assert!(worst_exp < 2.5e-7, "exp relative error {worst_exp:e}");
        assert!(worst_tanh < 3e-7, "tanh absolute error {worst_tanh:e}");
        assert_eq!(fast_exp(-1000.0), fast_exp(-87.3));
        assert!(fast_exp(-1000.0) < 1.3e-38, "e^-87.3 ≈ 1.25e-38");
        assert_eq!(fast_tanh(50.0), 1.0);
        assert_eq!(fast_tanh(-50.0), -1.0);
    }
}
