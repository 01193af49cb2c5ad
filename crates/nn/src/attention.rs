//! Causal grouped-query attention: one kernel for every family. Multi-head
//! attention (GPT-2) is the case `n_kv_head == n_head`.
//!
//! Rows of `qkv` hold the query heads, then the key heads, then the value
//! heads: `[q: n_head·d | k: n_kv_head·d | v: n_kv_head·d]` (GPT-2's
//! `c_attn` output, `[q | k | v]` of width C each, is this layout); query
//! head `h` reads key/value head `h / (n_head / n_kv_head)` (transformers'
//! `repeat_kv`). Each task computes one head into a head-major scratch
//! block of its own, which is then copied into rows: safe code, and a
//! head's GEMMs are the same calls wherever their output lands.

use crate::act::fast_exp;
use crate::{assert_len, gemm_into, GemmDims, GemmOut, Operands, Par, Strided};
use multiversion::multiversion;
use rayon::prelude::*;

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Sequences.
    pub b: usize,
    /// Sequence length.
    pub t: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (divides `n_head`; equal to it for multi-head attention).
    pub n_kv_head: usize,
    /// Head width.
    pub head_dim: usize,
    /// Operands of the per-head GEMMs.
    pub ops: Operands,
}

impl AttnShape {
    /// Width of the query heads together.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of one `qkv` row.
    pub fn qkv_width(&self) -> usize {
        (self.n_head + 2 * self.n_kv_head) * self.head_dim
    }

    /// Elements of the attention probabilities `[B, n_head, T, T]`.
    pub fn att_len(&self) -> usize {
        self.b * self.n_head * self.t * self.t
    }

    /// Panics unless the shape is usable and every slice has exactly the
    /// length it implies (products checked: an overflowing shape cannot pass).
    pub(crate) fn check(&self, kernel: &str, slices: &[(&str, usize, &[usize])]) {
        assert!(
            self.t > 0 && self.head_dim > 0 && self.n_kv_head > 0 && self.n_head.is_multiple_of(self.n_kv_head),
            "{kernel}: invalid shape {self:?}"
        );
        for (name, len, factors) in slices {
            assert_len(kernel, name, *len, factors);
        }
    }
}

/// Causal softmax of a `t × t` score matrix, in place, row by row: row `i`
/// becomes softmax over its first `i + 1` entries (max-subtracted, summed
/// in f32 in order), and the masked entries become 0.
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

/// Causal attention forward. `qkv` `[B·T, qkv_width]` (q and k already
/// rotated where the family rotates them), `att` receives the softmax
/// probabilities `[B, n_head, T, T]` (zero above the diagonal), `y` the
/// head outputs `[B·T, n_head·d]`; `heads` is scratch of `y`'s size.
///
/// # Panics
/// Unless every slice has exactly the length the shape implies.
pub fn attention_forward(y: &mut [f32], att: &mut [f32], heads: &mut [f32], qkv: &[f32], s: AttnShape) {
    engine::profile::timed(engine::profile::Kind::Attention, || {
        let AttnShape { b, t, n_head, n_kv_head, head_dim: d, ops } = s;
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
        // One task per (sequence, head): its GEMMs run on one thread.
        let par = Par::ONE.with(ops);
        att.par_chunks_mut(t * t).zip(heads.par_chunks_mut(t * d)).enumerate().for_each(|(bh, (a, yh))| {
            let (bi, h) = (bh / n_head, bh % n_head);
            let row0 = bi * t * w;
            let kv = qd + (h / group) * d;
            let q = Strided { data: qkv, offset: row0 + h * d, rs: w, cs: 1 };
            let k_t = Strided { data: qkv, offset: row0 + kv, rs: 1, cs: w };
            let v = Strided { data: qkv, offset: row0 + kv + n_kv_head * d, rs: w, cs: 1 };
            // scores = scale · q · kᵀ: (T, d) @ (d, T) -> (T, T)
            gemm_into(GemmDims { m: t, n: t, k: d }, a, GemmOut::overwrite(t), q, k_t, scale, par);
            causal_softmax_rows(a, t);
            // y_h = att · v: (T, T) @ (T, d) -> (T, d)
            gemm_into(GemmDims { m: t, n: d, k: t }, yh, GemmOut::overwrite(d), Strided::rows(a, t), v, 1.0, par);
        });
        // Head-major [B, H, T, d] → rows [B·T, H·d].
        y.par_chunks_mut(qd).enumerate().for_each(|(r, row)| {
            let (bi, ti) = (r / t, r % t);
            for (h, dst) in row.chunks_mut(d).enumerate() {
                dst.copy_from_slice(&heads[((bi * n_head + h) * t + ti) * d..][..d]);
            }
        });
    })
}

/// Backward of [`attention_forward`]: overwrites `dqkv` (gradients of the
/// rotated q and k, and of v); `datt` is scratch of `att`'s size, `heads`
/// scratch of `dqkv`'s size. One task per (sequence, key/value head) runs
/// its query heads in order and sums their key/value gradients in that
/// order, so the result does not depend on scheduling.
///
/// # Panics
/// Unless every slice has exactly the length the shape implies.
pub fn attention_backward(
    dqkv: &mut [f32],
    datt: &mut [f32],
    heads: &mut [f32],
    dy: &[f32],
    saved: (&[f32], &[f32]),
    s: AttnShape,
) {
    engine::profile::timed(engine::profile::Kind::Attention, || {
        let (qkv, att) = saved;
        let AttnShape { b, t, n_head, n_kv_head, head_dim: d, ops } = s;
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
        let par = Par::ONE.with(ops);
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
                    // datt = dy · vᵀ: (T, d) @ (d, T) -> (T, T); then softmax
                    // backward in place: dpre = att ⊙ (datt − Σ att·datt).
                    gemm_into(GemmDims { m: t, n: t, k: d }, da, GemmOut::overwrite(t), dy_h, v_t, 1.0, par);
                    causal_softmax_backward_rows(da, a, t);
                    let first = g == 0;
                    // dq = scale · dpre · k: (T, T) @ (T, d) -> (T, d)
                    let dq = &mut dq_g[g * t * d..][..t * d];
                    gemm_into(
                        GemmDims { m: t, n: d, k: t },
                        dq,
                        GemmOut::overwrite(d),
                        Strided::rows(da, t),
                        k,
                        scale,
                        par,
                    );
                    // dk (+)= scale · dpreᵀ · q: (T, T) @ (T, d) -> (T, d)
                    gemm_into(
                        GemmDims { m: t, n: d, k: t },
                        dk,
                        GemmOut { offset: 0, rs: d, accumulate: !first },
                        Strided::transposed(da, t),
                        q,
                        scale,
                        par,
                    );
                    // dv (+)= attᵀ · dy: (T, T) @ (T, d) -> (T, d)
                    gemm_into(
                        GemmDims { m: t, n: d, k: t },
                        dv,
                        GemmOut { offset: 0, rs: d, accumulate: !first },
                        Strided::transposed(a, t),
                        dy_h,
                        1.0,
                        par,
                    );
                }
            });
        qkv_heads_to_rows(dqkv, heads, s);
    })
}

/// Copies head-major gradients `heads` (dq `[B, H, T, d]`, then dk and dv
/// `[B, KV, T, d]` each) into rows `[B·T, q | k | v]` of `dqkv`.
pub(crate) fn qkv_heads_to_rows(dqkv: &mut [f32], heads: &[f32], s: AttnShape) {
    let AttnShape { b, t, n_head, n_kv_head, head_dim: d, .. } = s;
    let (qd, w, kvd) = (s.q_dim(), s.qkv_width(), n_kv_head * d);
    let (dq_h, dkv_h) = heads.split_at(b * t * qd);
    let (dk_h, dv_h) = dkv_h.split_at(b * t * kvd);
    heads_to_rows((dqkv, w, 0), dq_h, (b, n_head, t, d));
    heads_to_rows((dqkv, w, qd), dk_h, (b, n_kv_head, t, d));
    heads_to_rows((dqkv, w, qd + kvd), dv_h, (b, n_kv_head, t, d));
}

/// Copies head-major `src` (`[B, heads, rows, d]`) into the rows of `dst`
/// (`[B·rows, width]`), head `h` at column `col + h·d`.
pub(crate) fn heads_to_rows(
    (dst, width, col): (&mut [f32], usize, usize),
    src: &[f32],
    (b, heads, rows, d): (usize, usize, usize, usize),
) {
    dst.par_chunks_mut(width).enumerate().for_each(|(r, row)| {
        let (bi, ti) = (r / rows, r % rows);
        for (h, out) in row[col..][..heads * d].chunks_mut(d).enumerate() {
            out.copy_from_slice(&src[((bi * heads + h) * rows + ti) * d..][..d]);
        }
    });
    debug_assert_eq!(dst.len(), b * rows * width);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_fd, randn};

    fn shape(b: usize, t: usize, n_head: usize, n_kv_head: usize, head_dim: usize) -> AttnShape {
        AttnShape { b, t, n_head, n_kv_head, head_dim, ops: Operands::F32 }
    }

    #[test]
    fn gqa_attention_backward_matches_central_differences() {
        for s in [shape(2, 4, 4, 2, 2), shape(1, 5, 3, 3, 4)] {
            let (qd, w, att_len) = (s.q_dim(), s.qkv_width(), s.att_len());
            let n = s.b * s.t;
            let qkv = randn(n * w, 5);
            let dy = randn(n * qd, 6);
            let fwd = |qkv: &[f32]| {
                let (mut y, mut att, mut heads) = (vec![0.0; n * qd], vec![0.0; att_len], vec![0.0; n * qd]);
                attention_forward(&mut y, &mut att, &mut heads, qkv, s);
                y
            };
            let (mut y, mut att, mut heads) = (vec![0.0; n * qd], vec![0.0; att_len], vec![0.0; n * qd]);
            attention_forward(&mut y, &mut att, &mut heads, &qkv, s);
            let (mut dqkv, mut datt, mut hb) = (vec![0.0; n * w], vec![0.0; att_len], vec![0.0; n * w]);
            attention_backward(&mut dqkv, &mut datt, &mut hb, &dy, (&qkv, &att), s);
            check_fd("attention dqkv", &fwd, &qkv, &dy, &dqkv);
            // Position 0 attends to itself only, so query head h outputs the
            // value of key/value head h / group there (transformers' repeat_kv).
            let (d, group) = (s.head_dim, s.n_head / s.n_kv_head);
            for h in 0..s.n_head {
                let v0 = qd + s.n_kv_head * d + (h / group) * d;
                assert_eq!(y[h * d..(h + 1) * d], qkv[v0..v0 + d], "head {h}");
            }
        }
    }

    /// Safe code cannot make the kernels index out of their slices: a
    /// slice of the wrong length, or a shape whose sizes overflow, panics
    /// before any work.
    #[test]
    fn attention_kernels_reject_slices_of_the_wrong_length() {
        let s = shape(1, 4, 2, 2, 4);
        let (n, att_len) = (4, 2 * 16);
        let ok = |y: usize, att: usize, qkv: usize| {
            std::panic::catch_unwind(|| {
                let (mut o, mut a, mut h, q) = (vec![0.0f32; y], vec![0.0f32; att], vec![0.0; n * 8], vec![0.1; qkv]);
                attention_forward(&mut o, &mut a, &mut h, &q, s);
            })
            .is_ok()
        };
        assert!(ok(n * 8, att_len, n * 24));
        assert!(!ok(n * 8, 4 * att_len, n * 24), "longer att");
        assert!(!ok(n * 8, att_len, n * 24 - 1), "short qkv");
        assert!(!ok(n * 8 - 1, att_len, n * 24), "short y");
        let back = |dqkv: usize, datt: usize, dy: usize, qkv: usize, att: usize| {
            std::panic::catch_unwind(|| {
                let (mut dq, mut da, mut h) = (vec![0.0f32; dqkv], vec![0.0f32; datt], vec![0.0; n * 24]);
                attention_backward(&mut dq, &mut da, &mut h, &vec![0.1; dy], (&vec![0.1; qkv], &vec![0.1; att]), s);
            })
            .is_ok()
        };
        assert!(back(n * 24, att_len, n * 8, n * 24, att_len));
        assert!(!back(n * 24, 4 * att_len, n * 8, n * 24, 4 * att_len), "longer datt/att");
        assert!(!back(n * 24 - 1, att_len, n * 8, n * 24, att_len), "short dqkv");
        assert!(!back(n * 24, att_len, n * 8 - 1, n * 24, att_len), "short dy");
        let huge = shape(usize::MAX / 2 + 1, 1, 1, 1, 2);
        let overflow = std::panic::catch_unwind(|| attention_forward(&mut [], &mut [], &mut [], &[], huge));
        assert!(overflow.is_err(), "a shape whose sizes overflow must not pass as empty");
        let bad = std::panic::catch_unwind(|| {
            attention_forward(&mut [0.0; 8], &mut [0.0; 8], &mut [0.0; 8], &[0.0; 15], shape(1, 2, 2, 1, 2));
        });
        assert!(bad.is_err(), "short grouped qkv");
    }
}
