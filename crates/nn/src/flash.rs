//! Causal grouped-query attention in O(T) memory: FlashAttention-2's tiled
//! algorithm (Dao 2023) over the same `qkv` rows and [`AttnShape`] as
//! [`attention_forward`](crate::attention::attention_forward).
//!
//! The forward walks key/value tiles left to right with an online softmax
//! (a running row maximum `m` and sum `l`; the partial output is rescaled
//! by `exp(m_old − m_new)` whenever the maximum grows) and keeps, besides
//! the output, one log-sum-exp `m + ln l` per (sequence, head, row). The
//! backward recomputes each probability tile from it, `P = exp(S − lse)`,
//! with `D_i = Σ_j dy_ij · y_ij` standing in for the row sum of `P ⊙ dP`.
//! No `T × T` matrix exists: tiles above the diagonal are skipped whole,
//! the diagonal tile is masked, and the query heads of one key/value group
//! run against a key/value tile copied once for all of them. What a query
//! sees ([`Visible`]) may also end on the left — at its document's start
//! (packed rows) and `w − 1` positions back (sliding-window attention):
//! key tiles left of a query tile's first row's range are skipped whole.
//! How a query scores a key may differ from `q·k/√d` too: another scale
//! (Gemma 2's `query_pre_attn_scalar`) and a soft cap `c·tanh(s/c)` on the
//! scores (Gemma 2's `attn_logit_softcapping`), whose derivative
//! `1 − tanh²` the backward applies to the score gradients.

use crate::act::fast_exp;
use crate::attention::{qkv_heads_to_rows, AttnShape};
use crate::{gemm_into, GemmDims, GemmOut, Par, Strided};
use rayon::prelude::*;

/// Rows of a query tile and columns of a key/value tile. 64 keeps a task's
/// scratch (a score tile of 64 × 64, key and value tiles of 64 × d and one
/// output tile of 64 × d per query head of the group: 16 KiB + (2 + group)
/// · 16 KiB at d = 64, 96 KiB for SmolLM2) inside a core's L2 cache, while
/// each tile GEMM (64 × 64 × d) is still large enough for the packed GEMM
/// kernel to run at speed; square tiles put the diagonal on tile corners,
/// so every row of a diagonal tile has at least one unmasked column.
/// Tiles of 128 (4× the scratch) measured no faster at T = 2048 on a
/// 2-core AMD EPYC (single-thread forward and backward within the run-to-run
/// noise of ±20%). The tile products run on the packed GEMM kernel: plain
/// loops (16-lane dot products for the scores, row updates for `P · v`)
/// made the forward 2.5× slower there.
pub const TILE: usize = 64;

/// The keys each query sees besides the causal bound: a query at position
/// `i` sees keys `start(i)..=i`, where `start(i)` is the later of its
/// document's start (packed rows whose documents must not attend to each
/// other: `B·T` offsets, each at most its own position and never
/// decreasing along a row; empty: one document per row) and, with a
/// sliding window of `w`, `i + 1 − w` (the `w` latest keys, itself
/// included, as transformers' `kv_idx > q_idx − sliding_window`). It
/// also carries how a query scores the keys it sees ([`Visible::scored`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Visible<'a> {
    starts: &'a [u32],
    /// The window `w`; 0: none.
    window: usize,
    /// The scores' scale and soft cap.
    scores: Scores,
}

/// How a query scores a key: `s = scale · q·k`, then, with a soft cap `c`,
/// `c · tanh(s / c)` (transformers' Gemma 2 eager attention: divide, tanh,
/// multiply, in f32).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Scores {
    /// The scale; `None`: `1/√d` of the head width `d`.
    pub scale: Option<f32>,
    /// The soft cap `c > 0`; `None`: the scores as they are.
    pub softcap: Option<f32>,
}

impl Scores {
    /// The scale for heads of width `d`.
    pub fn scale_for(&self, d: usize) -> f32 {
        self.scale.unwrap_or_else(|| 1.0 / (d as f32).sqrt())
    }

    /// Caps the scores of `row` in place (without a cap, leaves them).
    pub fn cap(&self, row: &mut [f32]) {
        if let Some(c) = self.softcap {
            row.iter_mut().for_each(|x| *x = c * (*x / c).tanh());
        }
    }
}

impl<'a> Visible<'a> {
    /// Plain causal attention: one document per row, no window.
    pub const CAUSAL: Visible<'static> =
        Visible { starts: &[], window: 0, scores: Scores { scale: None, softcap: None } };

    /// Packed rows whose documents start at `starts` (empty: one per row).
    pub fn documents(starts: &'a [u32]) -> Self {
        Visible { starts, ..Visible::CAUSAL }
    }

    /// The same, scoring keys by `scores`.
    ///
    /// # Panics
    /// On a cap or scale that is not finite and positive.
    pub fn scored(self, scores: Scores) -> Self {
        let ok = |x: Option<f32>| x.is_none_or(|x| x.is_finite() && x > 0.0);
        assert!(ok(scores.scale) && ok(scores.softcap), "attention scores need a positive scale and cap: {scores:?}");
        Visible { scores, ..self }
    }

    /// The same, and at most the `w` latest keys (`None`: no window).
    ///
    /// # Panics
    /// On a window of 0, which would see nothing.
    pub fn window(self, w: Option<usize>) -> Self {
        assert!(w != Some(0), "a sliding window of 0 keys");
        Visible { window: w.unwrap_or(0), ..self }
    }

    /// First key position `i` of sequence `bi` (rows of `t`) sees.
    fn start(&self, bi: usize, t: usize, i: usize) -> usize {
        let doc = self.starts.get(bi * t + i).map_or(0, |&s| s as usize);
        doc.max(window_start(i, self.window))
    }

    /// Panics unless the starts are empty or `b·t` offsets that are at
    /// most their position and never decrease along a row.
    fn check(&self, b: usize, t: usize) {
        if self.starts.is_empty() {
            return;
        }
        assert_eq!(self.starts.len(), b * t, "document starts: {} for {b} rows of {t}", self.starts.len());
        for row in self.starts.chunks(t) {
            for (i, w) in row.iter().enumerate() {
                assert!(*w as usize <= i && (i == 0 || row[i - 1] <= *w), "document start {w} at position {i}");
            }
        }
    }

    /// Key columns `[lo, hi)` of a tile starting at `c0` with `nc` columns
    /// that query position `i` (of sequence `bi`) sees; `lo ≥ hi`: none.
    fn visible(&self, (bi, t): (usize, usize), i: usize, (c0, nc): (usize, usize)) -> (usize, usize) {
        (self.start(bi, t, i).saturating_sub(c0).min(nc), (i + 1).saturating_sub(c0).min(nc))
    }
}

/// The first key position a query at position `i` sees under a sliding
/// window of `w` keys (0: none): `i + 1 − w`, the rule of
/// [`Visible::window`] and of [`crate::kv::KvCache::window`].
pub(crate) fn window_start(i: usize, w: usize) -> usize {
    match w {
        0 => 0,
        w => (i + 1).saturating_sub(w),
    }
}

/// Tiles covering `t` rows.
fn tiles(t: usize) -> usize {
    t.div_ceil(TILE)
}

/// Rows `r0..r1` of tile `i` of a length-`t` sequence.
fn tile_rows(i: usize, t: usize) -> (usize, usize) {
    (i * TILE, ((i + 1) * TILE).min(t))
}

/// The query tiles of a sequence of `t` rows when only `rows` (sorted,
/// disjoint `[start, end)` ranges) are computed: each range cut into
/// tiles of [`TILE`] rows from its start. `[(0, t)]` gives the tiles of
/// the whole sequence, at multiples of [`TILE`].
fn query_tiles(t: usize, rows: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut prev = 0;
    for &(a, b) in rows {
        assert!(prev <= a && a <= b && b <= t, "query rows {rows:?} of a sequence of {t}");
        out.extend((a..b).step_by(TILE).map(|r0| (r0, (r0 + TILE).min(b))));
        prev = b;
    }
    out
}

/// `buf` (rows of `width` per (outer, position) of `outer · t` rows) cut
/// into one mutable piece per (outer index, tile of `tiles`), in order.
fn carve<'b>(
    buf: &'b mut [f32],
    outer: usize,
    t: usize,
    width: usize,
    tiles: &[(usize, usize)],
) -> Vec<(usize, usize, usize, &'b mut [f32])> {
    let mut pieces = Vec::with_capacity(outer * tiles.len());
    let (mut rest, mut at) = (buf, 0);
    for o in 0..outer {
        for &(r0, r1) in tiles {
            let start = (o * t + r0) * width;
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
            let (mine, tail) = tail.split_at_mut((r1 - r0) * width);
            pieces.push((o, r0, r1, mine));
            (rest, at) = (tail, (o * t + r1) * width);
        }
    }
    pieces
}

/// Copies rows `r0..r1` of the `d` columns at `col` of the `w`-wide rows
/// starting at `row0` into `dst` (dense, `d` wide).
fn gather_tile(
    dst: &mut [f32],
    src: &[f32],
    (row0, w, col, d): (usize, usize, usize, usize),
    (r0, r1): (usize, usize),
) {
    for (r, out) in (r0..r1).zip(dst.chunks_mut(d)) {
        out.copy_from_slice(&src[row0 + r * w + col..][..d]);
    }
}

/// Causal attention forward without the probabilities. `qkv`
/// `[B·T, qkv_width]`, `y` receives the head outputs `[B·T, n_head·d]`,
/// `lse` the log-sum-exp of each softmax row `[B, n_head, T]`, which
/// [`flash_attention_backward`] needs. One task per (sequence, query tile)
/// writes its rows of `y` for every head; each row's sums run in key order
/// inside one task, so results do not depend on the number of threads.
///
/// # Panics
/// Unless every slice has exactly the length the shape implies.
pub fn flash_attention_forward(y: &mut [f32], lse: &mut [f32], qkv: &[f32], s: AttnShape, docs: Visible<'_>) {
    flash_attention_forward_rows(y, lse, qkv, s, docs, &[(0, s.t)]);
}

/// [`flash_attention_forward`] for the query rows `rows` of each sequence
/// only (sorted, disjoint `[start, end)` ranges of positions; context
/// parallelism's chunks): their rows of `y` and `lse` are written, the
/// others left as they are. Each range is cut into tiles from its start;
/// a row's keys are walked in the same key tiles, so a range starting on
/// a multiple of [`TILE`] gives the whole call's bits for its rows.
///
/// # Panics
/// As [`flash_attention_forward`], and on ranges out of order or past `t`.
pub fn flash_attention_forward_rows(
    y: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    s: AttnShape,
    docs: Visible<'_>,
    rows: &[(usize, usize)],
) {
    engine::profile::timed(engine::profile::Kind::Attention, || {
        let AttnShape { b, t, n_head, n_kv_head, head_dim: d, ops } = s;
        let (qd, w) = (s.q_dim(), s.qkv_width());
        s.check(
            "flash_attention_forward",
            &[("y", y.len(), &[b, t, qd]), ("lse", lse.len(), &[b, n_head, t]), ("qkv", qkv.len(), &[b, t, w])],
        );
        docs.check(b, t);
        let group = n_head / n_kv_head;
        let scale = docs.scores.scale_for(d);
        let par = Par::ONE.with(ops);
        let qt = query_tiles(t, rows);
        let tile_lse: Vec<Vec<f32>> = carve(y, b, t, qd, &qt)
            .into_par_iter()
            .map(|(bi, r0, r1, yt)| {
                let nr = r1 - r0;
                let row0 = bi * t * w;
                let (mut sc, mut kt, mut vt) =
                    (vec![0.0f32; nr * TILE], vec![0.0f32; TILE * d], vec![0.0f32; TILE * d]);
                let mut o = vec![0.0f32; group * nr * d];
                let (mut m, mut l) = (vec![0.0f32; group * nr], vec![0.0f32; group * nr]);
                // This tile's log-sum-exps, head-major: [n_head, nr].
                let mut out_lse = vec![0.0f32; n_head * nr];
                // Key tiles left of the first row's document are never visible.
                let k0 = docs.start(bi, t, r0) / TILE;
                for kvh in 0..n_kv_head {
                    let (kc, vc) = (qd + kvh * d, qd + (n_kv_head + kvh) * d);
                    // Through the key tile of the tile's last row (the diagonal's).
                    for kj in k0..=(r1 - 1) / TILE {
                        let (c0, c1) = tile_rows(kj, t);
                        let nc = c1 - c0;
                        gather_tile(&mut kt, qkv, (row0, w, kc, d), (c0, c1));
                        gather_tile(&mut vt, qkv, (row0, w, vc, d), (c0, c1));
                        for g in 0..group {
                            let h = kvh * group + g;
                            let q = Strided { data: qkv, offset: row0 + r0 * w + h * d, rs: w, cs: 1 };
                            // S = scale · q · kᵀ: (nr, d) @ (d, nc)
                            let dims = GemmDims { m: nr, n: nc, k: d };
                            gemm_into(
                                dims,
                                &mut sc,
                                GemmOut::overwrite(nc),
                                q,
                                Strided::transposed(&kt, d),
                                scale,
                                par,
                            );
                            let (og, mg, lg) =
                                (&mut o[g * nr * d..][..nr * d], &mut m[g * nr..][..nr], &mut l[g * nr..][..nr]);
                            for (ri, srow) in sc[..nr * nc].chunks_mut(nc).enumerate() {
                                // Columns past the diagonal (only in the diagonal
                                // tile) and before the row's document are masked; a
                                // row's first visible tile starts its softmax.
                                let i = r0 + ri;
                                let (lo, hi) = docs.visible((bi, t), i, (c0, nc));
                                if lo >= hi {
                                    srow[..nc].fill(0.0);
                                    continue;
                                }
                                let first = kj == docs.start(bi, t, i) / TILE;
                                docs.scores.cap(&mut srow[lo..hi]);
                                let row_max = srow[lo..hi].iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                                let m_new = if first { row_max } else { mg[ri].max(row_max) };
                                srow[lo..hi].iter_mut().for_each(|x| *x = fast_exp(*x - m_new));
                                srow[..lo].fill(0.0);
                                srow[hi..].fill(0.0);
                                let sum = srow[lo..hi].iter().fold(0.0f32, |a, &x| a + x);
                                if first {
                                    lg[ri] = sum;
                                } else {
                                    let alpha = fast_exp(mg[ri] - m_new);
                                    lg[ri] = alpha * lg[ri] + sum;
                                    og[ri * d..][..d].iter_mut().for_each(|x| *x *= alpha);
                                }
                                mg[ri] = m_new;
                            }
                            // O (+)= P · v: (nr, nc) @ (nc, d)
                            gemm_into(
                                GemmDims { m: nr, n: d, k: nc },
                                og,
                                GemmOut { offset: 0, rs: d, accumulate: kj > k0 },
                                Strided::rows(&sc, nc),
                                Strided::rows(&vt, d),
                                1.0,
                                par,
                            );
                        }
                    }
                    for g in 0..group {
                        let h = kvh * group + g;
                        for ri in 0..nr {
                            let (mi, li) = (m[g * nr + ri], l[g * nr + ri]);
                            let inv = 1.0 / li;
                            let src = &o[(g * nr + ri) * d..][..d];
                            yt[ri * qd + h * d..][..d].iter_mut().zip(src).for_each(|(dst, &x)| *dst = x * inv);
                            out_lse[h * nr + ri] = mi + li.ln();
                        }
                    }
                }
                out_lse
            })
            .collect();
        // Tiles come back in (sequence, tile) order: scatter into [B, n_head, T].
        for (task, tl) in tile_lse.iter().enumerate() {
            let (bi, (r0, r1)) = (task / qt.len(), qt[task % qt.len()]);
            for h in 0..n_head {
                lse[(bi * n_head + h) * t + r0..][..r1 - r0].copy_from_slice(&tl[h * (r1 - r0)..][..r1 - r0]);
            }
        }
    })
}

/// Backward of [`flash_attention_forward`]: overwrites `dqkv` (gradients of
/// the rotated q and k, and of v) from `dy` and the saved `(qkv, y, lse)`;
/// `heads` is scratch of `dqkv`'s size (head-major dq, dk, dv).
///
/// With at least as many (sequence, key/value head) pairs as threads, one
/// task per pair walks key tiles, then query tiles at or below the
/// diagonal, then its query heads, and accumulates dq, dk and dv. With
/// fewer, the work splits into one task per (sequence, key/value head, key
/// tile) for dk and dv, and one per (sequence, query head, query tile) for
/// dq, which recomputes the probability and score-gradient tiles (7 tile
/// products per tile pair instead of 5) but keeps every thread busy. Both
/// add every sum in the same order (dk and dv over query tiles then heads,
/// dq over key tiles), so the result is the same bit for bit whichever
/// runs, and does not depend on the number of threads.
///
/// # Panics
/// Unless every slice has exactly the length the shape implies.
pub fn flash_attention_backward(
    dqkv: &mut [f32],
    heads: &mut [f32],
    dy: &[f32],
    saved: (&[f32], &[f32], &[f32]),
    s: AttnShape,
    docs: Visible<'_>,
) {
    flash_attention_backward_rows(dqkv, heads, dy, saved, s, docs, &[(0, s.t)]);
}

/// [`flash_attention_backward`] of [`flash_attention_forward_rows`]: the
/// gradients from the query rows `rows` of each sequence only — dq of the
/// other rows is 0, dk and dv sum what those queries send every key (0
/// for a key none of them sees). Only the values of `dy`, `y` and `lse` at
/// `rows` matter.
///
/// # Panics
/// As [`flash_attention_backward`], and on ranges out of order or past `t`.
pub fn flash_attention_backward_rows(
    dqkv: &mut [f32],
    heads: &mut [f32],
    dy: &[f32],
    saved: (&[f32], &[f32], &[f32]),
    s: AttnShape,
    docs: Visible<'_>,
    rows: &[(usize, usize)],
) {
    engine::profile::timed(engine::profile::Kind::Attention, || {
        let (qkv, y, lse) = saved;
        let AttnShape { b, t, n_head, n_kv_head, head_dim: d, ops } = s;
        let (qd, w) = (s.q_dim(), s.qkv_width());
        let kvd = n_kv_head * d;
        s.check(
            "flash_attention_backward",
            &[
                ("dqkv", dqkv.len(), &[b, t, w]),
                ("heads", heads.len(), &[b, t, w]),
                ("dy", dy.len(), &[b, t, qd]),
                ("qkv", qkv.len(), &[b, t, w]),
                ("y", y.len(), &[b, t, qd]),
                ("lse", lse.len(), &[b, n_head, t]),
            ],
        );
        docs.check(b, t);
        let qt = query_tiles(t, rows);
        // D [B, n_head, T]: Σ dy ⊙ y over each row of each head (= Σ_j P ⊙ dP).
        let mut dsum = vec![0.0f32; b * n_head * t];
        dsum.par_chunks_mut(t).enumerate().for_each(|(bh, dh)| {
            let (bi, h) = (bh / n_head, bh % n_head);
            for (ti, out) in dh.iter_mut().enumerate() {
                let at = (bi * t + ti) * qd + h * d;
                *out = dy[at..at + d].iter().zip(&y[at..at + d]).fold(0.0f32, |a, (&x, &z)| a + x * z);
            }
        });
        let scale = docs.scores.scale_for(d);
        let bw = Backward { qkv, dy, lse, dsum: &dsum, s, docs, scale, par: Par::ONE.with(ops), tiles: &qt };
        let group = n_head / n_kv_head;
        let (dq_h, dkv_h) = heads.split_at_mut(b * t * qd);
        if rows != [(0, t)] {
            // Rows no query tile writes.
            dq_h.fill(0.0);
        }
        let (dk_h, dv_h) = dkv_h.split_at_mut(b * t * kvd);
        if b * n_kv_head >= rayon::current_num_threads() {
            dq_h.par_chunks_mut(group * t * d)
                .zip(dk_h.par_chunks_mut(t * d).zip(dv_h.par_chunks_mut(t * d)))
                .enumerate()
                .for_each(|(bkv, (dq_g, (dk, dv)))| {
                    let mut sc = Scratch::new(d);
                    for kj in 0..tiles(t) {
                        let (c0, c1) = tile_rows(kj, t);
                        let dkv_j = (&mut dk[c0 * d..c1 * d], &mut dv[c0 * d..c1 * d]);
                        bw.key_tile((bkv, kj), dkv_j, Some(&mut *dq_g), &mut sc);
                    }
                });
        } else {
            dk_h.par_chunks_mut(t * d)
                .zip(dv_h.par_chunks_mut(t * d))
                .enumerate()
                .flat_map(|(bkv, (dk, dv))| {
                    let tiles = dk.par_chunks_mut(TILE * d).zip(dv.par_chunks_mut(TILE * d));
                    tiles.enumerate().map(move |(kj, dkv_j)| (bkv, kj, dkv_j))
                })
                .for_each(|(bkv, kj, dkv_j)| bw.key_tile((bkv, kj), dkv_j, None, &mut Scratch::new(d)));
            carve(dq_h, b * n_head, t, d, &qt)
                .into_par_iter()
                .for_each(|(bh, r0, r1, dq_i)| bw.query_tile((bh, (r0, r1)), dq_i, &mut Scratch::new(d)));
        }
        qkv_heads_to_rows(dqkv, heads, s);
    })
}

/// What every task of [`flash_attention_backward`] reads.
struct Backward<'a> {
    qkv: &'a [f32],
    dy: &'a [f32],
    lse: &'a [f32],
    dsum: &'a [f32],
    s: AttnShape,
    docs: Visible<'a>,
    scale: f32,
    par: Par,
    /// The query tiles of each sequence ([`query_tiles`]).
    tiles: &'a [(usize, usize)],
}

/// A backward task's tiles: probabilities, score gradients, keys, values.
struct Scratch {
    p: Vec<f32>,
    ds: Vec<f32>,
    kt: Vec<f32>,
    vt: Vec<f32>,
}

impl Scratch {
    fn new(d: usize) -> Self {
        Scratch {
            p: vec![0.0; TILE * TILE],
            ds: vec![0.0; TILE * TILE],
            kt: vec![0.0; TILE * d],
            vt: vec![0.0; TILE * d],
        }
    }
}

impl Backward<'_> {
    /// Query head `h` of sequence `bi`, rows from `r0`, as a GEMM operand:
    /// its queries in `qkv` and its output gradient in `dy`.
    fn q_dy(&self, bi: usize, h: usize, r0: usize) -> (Strided<'_>, Strided<'_>) {
        let (t, d, qd, w) = (self.s.t, self.s.head_dim, self.s.q_dim(), self.s.qkv_width());
        let q = Strided { data: self.qkv, offset: (bi * t + r0) * w + h * d, rs: w, cs: 1 };
        (q, Strided { data: self.dy, offset: (bi * t + r0) * qd + h * d, rs: qd, cs: 1 })
    }

    /// Copies key/value tile `kj` of head `kvh` of sequence `bi` into the scratch.
    fn gather_kv(&self, bi: usize, kvh: usize, kj: usize, sc: &mut Scratch) {
        let (t, d, w) = (self.s.t, self.s.head_dim, self.s.qkv_width());
        let (kc, vc) = (self.s.q_dim() + kvh * d, self.s.q_dim() + (self.s.n_kv_head + kvh) * d);
        gather_tile(&mut sc.kt, self.qkv, (bi * t * w, w, kc, d), tile_rows(kj, t));
        gather_tile(&mut sc.vt, self.qkv, (bi * t * w, w, vc, d), tile_rows(kj, t));
    }

    /// Recomputes, for query tile `(r0, r1)` of head `h` against the gathered key
    /// tile `kj`, `P = exp(S − lse)` with `S = scale · q · kᵀ` (masked past
    /// the diagonal) into `sc.p` and `dS = P ⊙ (dy · vᵀ − D)` into `sc.ds`
    /// (`nr × nc`, row stride `nc`). With a soft cap `c`, `P` is of the
    /// capped scores `c·tanh(S/c)` and `dS` is times their derivative
    /// `1 − tanh²(S/c)`: the gradient of the uncapped `S`.
    fn probs(&self, (bi, h): (usize, usize), ((r0, r1), kj): ((usize, usize), usize), sc: &mut Scratch) {
        let AttnShape { t, n_head, head_dim: d, .. } = self.s;
        let (c0, c1) = tile_rows(kj, t);
        let (nr, nc) = (r1 - r0, c1 - c0);
        let (q, dy) = self.q_dy(bi, h, r0);
        let dims = GemmDims { m: nr, n: nc, k: d };
        gemm_into(dims, &mut sc.p, GemmOut::overwrite(nc), q, Strided::transposed(&sc.kt, d), self.scale, self.par);
        gemm_into(dims, &mut sc.ds, GemmOut::overwrite(nc), dy, Strided::transposed(&sc.vt, d), 1.0, self.par);
        let lse_i = &self.lse[(bi * n_head + h) * t + r0..][..nr];
        let d_i = &self.dsum[(bi * n_head + h) * t + r0..][..nr];
        let rows = sc.p[..nr * nc].chunks_mut(nc).zip(sc.ds.chunks_mut(nc));
        for (ri, (prow, dsrow)) in rows.enumerate() {
            let (lo, hi) = self.docs.visible((bi, t), r0 + ri, (c0, nc));
            let hi = hi.max(lo);
            match self.docs.scores.softcap {
                None => prow[lo..hi].iter_mut().for_each(|x| *x = fast_exp(*x - lse_i[ri])),
                Some(c) => {
                    // The cap's derivative, from the raw score, waits in dS's row
                    // until dP − D is there to multiply.
                    for (x, g) in prow[lo..hi].iter_mut().zip(&mut dsrow[lo..hi]) {
                        let th = (*x / c).tanh();
                        *x = fast_exp(c * th - lse_i[ri]);
                        *g = (*g - d_i[ri]) * (1.0 - th * th);
                    }
                }
            }
            prow[..lo].fill(0.0);
            prow[hi..].fill(0.0);
            match self.docs.scores.softcap {
                None => dsrow.iter_mut().zip(&*prow).for_each(|(x, &pv)| *x = pv * (*x - d_i[ri])),
                Some(_) => {
                    dsrow.iter_mut().zip(&*prow).enumerate().for_each(|(j, (x, &pv))| {
                        *x = if (lo..hi).contains(&j) { pv * *x } else { 0.0 };
                    });
                }
            }
        }
    }

    /// `dq_i (+)= scale · dS · k` for the `nr` rows of a query tile against
    /// the gathered key tile of `nc` rows; the first key tile overwrites.
    fn add_dq(&self, dq_i: &mut [f32], (nr, nc): (usize, usize), first: bool, sc: &Scratch) {
        let d = self.s.head_dim;
        let out = GemmOut { offset: 0, rs: d, accumulate: !first };
        let (lhs, rhs) = (Strided::rows(&sc.ds, nc), Strided::rows(&sc.kt, d));
        gemm_into(GemmDims { m: nr, n: d, k: nc }, dq_i, out, lhs, rhs, self.scale, self.par);
    }

    /// dk and dv of key tile `kj` of key/value head `bkv % n_kv_head` of
    /// sequence `bkv / n_kv_head`, overwritten (0 where none sees it): the
    /// query tiles that see any of its keys, in order, each over the
    /// group's query heads in order. With `dq` (the group's head-major dq, `[group, T, d]`), also
    /// adds this key tile's share of it (overwriting at the query tile's
    /// first visible key tile; called for key tiles in order).
    fn key_tile(
        &self,
        (bkv, kj): (usize, usize),
        (dk_j, dv_j): (&mut [f32], &mut [f32]),
        mut dq: Option<&mut [f32]>,
        sc: &mut Scratch,
    ) {
        let AttnShape { t, n_head, n_kv_head, head_dim: d, .. } = self.s;
        let (bi, kvh, group) = (bkv / n_kv_head, bkv % n_kv_head, n_head / n_kv_head);
        self.gather_kv(bi, kvh, kj, sc);
        let (c0, c1) = tile_rows(kj, t);
        let nc = c1 - c0;
        // The first query tile that sees the key tile overwrites dk_j and dv_j.
        let mut first = true;
        for &(r0, r1) in self.tiles {
            let nr = r1 - r0;
            if r1 <= c0 {
                // Every row before the key tile: causally masked.
                continue;
            }
            // Starts never decrease along a row: once the first row of a
            // query tile sees no key of this tile, no later row does.
            let k0 = self.docs.start(bi, t, r0) / TILE;
            if k0 > kj {
                debug_assert!(self.docs.start(bi, t, r0) >= c1);
                break;
            }
            for g in 0..group {
                let h = kvh * group + g;
                self.probs((bi, h), ((r0, r1), kj), sc);
                let (q, dy) = self.q_dy(bi, h, r0);
                let acc = GemmOut { offset: 0, rs: d, accumulate: !first };
                first = false;
                let dims = GemmDims { m: nc, n: d, k: nr };
                // dv_j (+)= Pᵀ · dy and dk_j (+)= scale · dSᵀ · q: (nc, nr) @ (nr, d)
                gemm_into(dims, dv_j, acc, Strided::transposed(&sc.p, nc), dy, 1.0, self.par);
                gemm_into(dims, dk_j, acc, Strided::transposed(&sc.ds, nc), q, self.scale, self.par);
                if let Some(dq) = dq.as_deref_mut() {
                    // The query tile's first visible key tile overwrites, as in `query_tile`.
                    self.add_dq(&mut dq[(g * t + r0) * d..][..nr * d], (nr, nc), kj == k0, sc);
                }
            }
        }
        if first {
            // No query here sees these keys.
            dk_j.fill(0.0);
            dv_j.fill(0.0);
        }
    }

    /// dq of query tile `(r0, r1)` of query head `bh % n_head` of sequence
    /// `bh / n_head`, overwritten: key tiles through the diagonal's, in order.
    fn query_tile(&self, (bh, (r0, r1)): (usize, (usize, usize)), dq_i: &mut [f32], sc: &mut Scratch) {
        let AttnShape { t, n_head, n_kv_head, .. } = self.s;
        let (bi, h) = (bh / n_head, bh % n_head);
        // Key tiles left of the first row's document add nothing.
        let k0 = self.docs.start(bi, t, r0) / TILE;
        for kj in k0..=(r1 - 1) / TILE {
            self.gather_kv(bi, h / (n_head / n_kv_head), kj, sc);
            self.probs((bi, h), ((r0, r1), kj), sc);
            let (c0, c1) = tile_rows(kj, t);
            self.add_dq(dq_i, (r1 - r0, c1 - c0), kj == k0, sc);
        }
    }
}

#[cfg(test)]
mod tests;
