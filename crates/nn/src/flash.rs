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
use crate::attention::{heads_to_rows, qkv_heads_to_rows, AttnShape};
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

/// Where a flash call's queries, or its keys and values, are: `data` holds
/// `stride` rows of `width` per sequence, and its first rows of each
/// sequence are the positions of `spans` (sorted, disjoint `[start, end)`
/// ranges of the whole sequence), in order; rows past them are never read.
/// A head's columns start at `col` (queries: head `h` at `col + h·d`;
/// keys at `col + kvh·d`, values at `col + (n_kv_head + kvh)·d`).
///
/// [`Rows::whole`] is the uncut call's `qkv`; context parallelism passes a
/// rank's positions as queries and another rank's (or every rank's) keys
/// and values ([`crate::context`]).
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    /// The values, `[B · stride, width]`.
    pub data: &'a [f32],
    /// Values per row.
    pub width: usize,
    /// The first head's column.
    pub col: usize,
    /// Rows per sequence.
    pub stride: usize,
    /// The positions of each sequence's rows.
    pub spans: &'a [(usize, usize)],
}

impl<'a> Rows<'a> {
    /// The queries and the keys and values of `qkv` rows of whole
    /// sequences shaped `s` (`whole`: `[(0, s.t)]`).
    pub fn whole(qkv: &'a [f32], s: AttnShape, whole: &'a [(usize, usize); 1]) -> (Self, Self) {
        let q = Rows { data: qkv, width: s.qkv_width(), col: 0, stride: s.t, spans: whole };
        (q, Rows { col: s.q_dim(), ..q })
    }

    /// Panics unless the rows fit `s` (`heads` of them per row).
    fn check(&self, what: &str, s: AttnShape, heads: usize) {
        let n = self.spans.iter().map(|(a, b)| b.saturating_sub(*a)).sum::<usize>();
        assert!(
            self.data.len() == s.b * self.stride * self.width
                && self.col + heads * s.head_dim <= self.width
                && n <= self.stride,
            "flash attention {what}: {} values for {} sequences of {} rows of {} (heads from column {}, spans {:?})",
            self.data.len(),
            s.b,
            self.stride,
            self.width,
            self.col,
            self.spans
        );
    }

    /// Whether these are the uncut call's rows of sequences of `t`.
    fn is_whole(&self, t: usize) -> bool {
        self.stride == t && self.spans == [(0, t)]
    }
}

/// A query or key tile: positions `r0..r1` of the whole sequence, stored
/// from row `at` of its sequence's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tile {
    r0: usize,
    r1: usize,
    at: usize,
}

impl Tile {
    fn len(&self) -> usize {
        self.r1 - self.r0
    }
}

/// The tiles of `spans` of a sequence of `t`: each span cut into tiles of
/// [`TILE`] rows from its start. `[(0, t)]` gives the whole sequence's
/// tiles, at multiples of [`TILE`].
fn span_tiles(t: usize, spans: &[(usize, usize)]) -> Vec<Tile> {
    let (mut out, mut prev, mut at) = (Vec::new(), 0, 0);
    for &(a, b) in spans {
        assert!(prev <= a && a <= b && b <= t, "rows {spans:?} of a sequence of {t}");
        out.extend((a..b).step_by(TILE).map(|r0| Tile { r0, r1: (r0 + TILE).min(b), at: at + r0 - a }));
        (prev, at) = (b, at + b - a);
    }
    out
}

/// The key tiles a query tile starting at `r0` and ending before `r1` may
/// see (of sequence `bi` of `t`): from the first ending after its first
/// row's first visible key through the last starting before `r1`, and the
/// index of the first in `keys`.
fn keys_for<'k>(
    keys: &'k [Tile],
    docs: &Visible<'_>,
    (bi, t): (usize, usize),
    (r0, r1): (usize, usize),
) -> (usize, &'k [Tile]) {
    let start = docs.start(bi, t, r0);
    let from = keys.partition_point(|k| k.r1 <= start);
    let to = keys.partition_point(|k| k.r0 < r1);
    (from, &keys[from..to.max(from)])
}

/// `buf` (`stride` rows of `width` per outer index) cut into one mutable
/// piece per (outer index, tile of `tiles`), in order: `(outer, tile
/// index, piece)`.
fn carve<'b>(
    buf: &'b mut [f32],
    outer: usize,
    stride: usize,
    width: usize,
    tiles: &[Tile],
) -> Vec<(usize, usize, &'b mut [f32])> {
    let mut pieces = Vec::with_capacity(outer * tiles.len());
    let (mut rest, mut at) = (buf, 0);
    for o in 0..outer {
        for (i, tile) in tiles.iter().enumerate() {
            let start = (o * stride + tile.at) * width;
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
            let (mine, tail) = tail.split_at_mut(tile.len() * width);
            pieces.push((o, i, mine));
            (rest, at) = (tail, (o * stride + tile.at + tile.len()) * width);
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

/// Copies key tile `key` of sequence `bi`'s rows of `kv` (head columns
/// `col`) into `dst`.
fn gather_key(dst: &mut [f32], kv: &Rows<'_>, (bi, col, d): (usize, usize, usize), key: &Tile) {
    gather_tile(dst, kv.data, (bi * kv.stride * kv.width, kv.width, col, d), (key.at, key.at + key.len()));
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
    let whole = [(0, s.t)];
    let qkv = Rows::whole(qkv, s, &whole);
    flash_attention_forward_spans(y, lse, qkv, s, docs);
}

/// [`flash_attention_forward`] of the queries `q` against the keys and
/// values `kv` only, positions in the whole sequences of `s.t` (where
/// [`Visible`] applies): `y` `[B · q.stride, n_head·d]` and `lse`
/// `[B, n_head, q.stride]` receive the rows of `q.spans`, the others left
/// as they are. A row that sees none of these keys gets `y = 0` and
/// `lse = −∞` (the empty softmax, which
/// [`crate::context::merge_partial`] leaves out). Each span is cut into tiles from its start and a row's keys are
/// walked in the key tiles of `kv.spans` in order, so the uncut call's
/// key tiles and a query span starting on a multiple of [`TILE`] give
/// the uncut call's bits for its rows.
///
/// # Panics
/// As [`flash_attention_forward`], and on spans out of order or past `s.t`.
pub fn flash_attention_forward_spans(
    y: &mut [f32],
    lse: &mut [f32],
    (q, kv): (Rows<'_>, Rows<'_>),
    s: AttnShape,
    docs: Visible<'_>,
) {
    engine::profile::timed(engine::profile::Kind::Attention, || {
        let AttnShape { b, t, n_head, n_kv_head, head_dim: d, ops } = s;
        let qd = s.q_dim();
        s.check(
            "flash_attention_forward",
            &[("y", y.len(), &[b, q.stride, qd]), ("lse", lse.len(), &[b, n_head, q.stride])],
        );
        q.check("queries", s, n_head);
        kv.check("keys and values", s, 2 * n_kv_head);
        docs.check(b, t);
        let group = n_head / n_kv_head;
        let scale = docs.scores.scale_for(d);
        let par = Par::ONE.with(ops);
        let (qt, kt_all) = (span_tiles(t, q.spans), span_tiles(t, kv.spans));
        let tile_lse: Vec<Vec<f32>> = carve(y, b, q.stride, qd, &qt)
            .into_par_iter()
            .map(|(bi, ti, yt)| {
                let Tile { r0, r1, at } = qt[ti];
                let nr = r1 - r0;
                let (mut sc, mut kt, mut vt) =
                    (vec![0.0f32; nr * TILE], vec![0.0f32; TILE * d], vec![0.0f32; TILE * d]);
                let mut o = vec![0.0f32; group * nr * d];
                let (mut m, mut l) = (vec![0.0f32; group * nr], vec![0.0f32; group * nr]);
                // Whether a row has seen a key yet (its softmax started).
                let mut seen = vec![false; group * nr];
                // This tile's log-sum-exps, head-major: [n_head, nr].
                let mut out_lse = vec![0.0f32; n_head * nr];
                // Key tiles left of the first row's first visible key, or
                // past the tile's last row, are never visible.
                let (_, keys) = keys_for(&kt_all, &docs, (bi, t), (r0, r1));
                for kvh in 0..n_kv_head {
                    let (kc, vc) = (kv.col + kvh * d, kv.col + (n_kv_head + kvh) * d);
                    seen.fill(false);
                    for (n, key) in keys.iter().enumerate() {
                        let (c0, nc) = (key.r0, key.len());
                        gather_key(&mut kt, &kv, (bi, kc, d), key);
                        gather_key(&mut vt, &kv, (bi, vc, d), key);
                        for g in 0..group {
                            let h = kvh * group + g;
                            let q = Strided {
                                data: q.data,
                                offset: (bi * q.stride + at) * q.width + q.col + h * d,
                                rs: q.width,
                                cs: 1,
                            };
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
                            let sg = &mut seen[g * nr..][..nr];
                            for (ri, srow) in sc[..nr * nc].chunks_mut(nc).enumerate() {
                                // Columns past the diagonal and before the row's
                                // document are masked; a row's first visible tile
                                // starts its softmax.
                                let i = r0 + ri;
                                let (lo, hi) = docs.visible((bi, t), i, (c0, nc));
                                if lo >= hi {
                                    srow[..nc].fill(0.0);
                                    continue;
                                }
                                let first = !sg[ri];
                                sg[ri] = true;
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
                                GemmOut { offset: 0, rs: d, accumulate: n > 0 },
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
                            let dst = &mut yt[ri * qd + h * d..][..d];
                            if !seen[g * nr + ri] {
                                // No key here: the empty softmax.
                                dst.fill(0.0);
                                out_lse[h * nr + ri] = f32::NEG_INFINITY;
                                continue;
                            }
                            let (mi, li) = (m[g * nr + ri], l[g * nr + ri]);
                            let inv = 1.0 / li;
                            let src = &o[(g * nr + ri) * d..][..d];
                            dst.iter_mut().zip(src).for_each(|(dst, &x)| *dst = x * inv);
                            out_lse[h * nr + ri] = mi + li.ln();
                        }
                    }
                }
                out_lse
            })
            .collect();
        // Tiles come back in (sequence, tile) order: scatter into [B, n_head, q.stride].
        for (task, tl) in tile_lse.iter().enumerate() {
            let (bi, tile) = (task / qt.len(), qt[task % qt.len()]);
            let nr = tile.len();
            for h in 0..n_head {
                lse[(bi * n_head + h) * q.stride + tile.at..][..nr].copy_from_slice(&tl[h * nr..][..nr]);
            }
        }
    })
}

/// Where [`flash_attention_backward_spans`] writes its gradients.
pub enum Grads<'a> {
    /// The uncut call's `dqkv` rows (`[B·T, qkv_width]`): dq, dk and dv
    /// of every position.
    Qkv(&'a mut [f32]),
    /// dq into the query columns (`[0, n_head·d)`) of the `q.stride` rows
    /// per sequence of the first (rows of the given width), dk|dv into
    /// the `kv.stride` rows of `2·n_kv_head·d` per sequence of the second.
    Split((&'a mut [f32], usize), &'a mut [f32]),
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
    let (qkv, y, lse) = saved;
    let whole = [(0, s.t)];
    let qkv = Rows::whole(qkv, s, &whole);
    flash_attention_backward_spans(Grads::Qkv(dqkv), heads, dy, qkv, (y, lse), s, docs);
}

/// [`flash_attention_backward`] of [`flash_attention_forward_spans`]: the
/// gradients the queries `q` send themselves and the keys and values `kv`
/// through this call's softmax, given the **whole** attention's `y` and
/// `lse` (`dy`, `y` `[B · q.stride, n_head·d]`, `lse` `[B, n_head,
/// q.stride]`; `P = exp(S − lse)` is then each key's true probability,
/// so the gradients of calls over disjoint key sets add up to the whole
/// call's). dq of a row that sees none of these keys is 0, and so are dk
/// and dv of a key no query here sees; rows past the spans are 0.
/// `heads` is scratch of `B·(q.stride·n_head + 2·kv.stride·n_kv_head)·d`.
///
/// # Panics
/// As [`flash_attention_backward`], and on spans out of order or past `s.t`.
pub fn flash_attention_backward_spans(
    out: Grads<'_>,
    heads: &mut [f32],
    dy: &[f32],
    (q, kv): (Rows<'_>, Rows<'_>),
    (y, lse): (&[f32], &[f32]),
    s: AttnShape,
    docs: Visible<'_>,
) {
    engine::profile::timed(engine::profile::Kind::Attention, || {
        let AttnShape { b, t, n_head, n_kv_head, head_dim: d, ops } = s;
        let (qd, kvd) = (s.q_dim(), n_kv_head * d);
        let (qr, kr) = (q.stride, kv.stride);
        s.check(
            "flash_attention_backward",
            &[
                ("heads", heads.len(), &[b, qr * qd + 2 * kr * kvd]),
                ("dy", dy.len(), &[b, qr, qd]),
                ("y", y.len(), &[b, qr, qd]),
                ("lse", lse.len(), &[b, n_head, qr]),
            ],
        );
        q.check("queries", s, n_head);
        kv.check("keys and values", s, 2 * n_kv_head);
        docs.check(b, t);
        let (qt, kt) = (span_tiles(t, q.spans), span_tiles(t, kv.spans));
        // D [B, n_head, q.stride]: Σ dy ⊙ y over each row of each head (= Σ_j P ⊙ dP).
        let mut dsum = vec![0.0f32; b * n_head * qr];
        dsum.par_chunks_mut(qr.max(1)).enumerate().for_each(|(bh, dh)| {
            let (bi, h) = (bh / n_head, bh % n_head);
            for (ti, out) in dh.iter_mut().enumerate() {
                let at = (bi * qr + ti) * qd + h * d;
                *out = dy[at..at + d].iter().zip(&y[at..at + d]).fold(0.0f32, |a, (&x, &z)| a + x * z);
            }
        });
        let scale = docs.scores.scale_for(d);
        let par = Par::ONE.with(ops);
        let bw = Backward { q, kv, dy, lse, dsum: &dsum, s, docs, scale, par, qt: &qt, kt: &kt };
        let group = n_head / n_kv_head;
        if !(q.is_whole(t) && kv.is_whole(t)) {
            // Rows no tile writes: those no key or query here reaches.
            heads.fill(0.0);
        }
        let (dq_h, dkv_h) = heads.split_at_mut(b * qr * qd);
        let (dk_h, dv_h) = dkv_h.split_at_mut(b * kr * kvd);
        if b * n_kv_head >= rayon::current_num_threads() {
            dq_h.par_chunks_mut((group * qr * d).max(1))
                .zip(dk_h.par_chunks_mut((kr * d).max(1)).zip(dv_h.par_chunks_mut((kr * d).max(1))))
                .enumerate()
                .for_each(|(bkv, (dq_g, (dk, dv)))| {
                    let mut sc = Scratch::new(d);
                    for (kj, key) in kt.iter().enumerate() {
                        let rows = key.at * d..(key.at + key.len()) * d;
                        let dkv_j = (&mut dk[rows.clone()], &mut dv[rows]);
                        bw.key_tile((bkv, kj), dkv_j, Some(&mut *dq_g), &mut sc);
                    }
                });
        } else {
            carve(dk_h, b * n_kv_head, kr, d, &kt)
                .into_par_iter()
                .zip(carve(dv_h, b * n_kv_head, kr, d, &kt))
                .for_each(|((bkv, kj, dk_j), (_, _, dv_j))| {
                    bw.key_tile((bkv, kj), (dk_j, dv_j), None, &mut Scratch::new(d))
                });
            carve(dq_h, b * n_head, qr, d, &qt)
                .into_par_iter()
                .for_each(|(bh, qi, dq_i)| bw.query_tile((bh, qi), dq_i, &mut Scratch::new(d)));
        }
        let (dq_h, dkv_h) = heads.split_at(b * qr * qd);
        let (dk_h, dv_h) = dkv_h.split_at(b * kr * kvd);
        match out {
            Grads::Qkv(dqkv) => {
                assert_eq!(dqkv.len(), b * t * s.qkv_width(), "flash_attention_backward: dqkv");
                qkv_heads_to_rows(dqkv, heads, s);
            }
            Grads::Split((dq, w), dkv) => {
                assert!(dq.len() == b * qr * w && w >= qd, "flash_attention_backward: dq rows");
                assert_eq!(dkv.len(), b * kr * 2 * kvd, "flash_attention_backward: dk|dv rows");
                heads_to_rows((dq, w, 0), dq_h, (b, n_head, qr, d));
                heads_to_rows((dkv, 2 * kvd, 0), dk_h, (b, n_kv_head, kr, d));
                heads_to_rows((dkv, 2 * kvd, kvd), dv_h, (b, n_kv_head, kr, d));
            }
        }
    })
}

/// What every task of [`flash_attention_backward`] reads.
struct Backward<'a> {
    q: Rows<'a>,
    kv: Rows<'a>,
    dy: &'a [f32],
    lse: &'a [f32],
    dsum: &'a [f32],
    s: AttnShape,
    docs: Visible<'a>,
    scale: f32,
    par: Par,
    /// The query tiles of each sequence ([`span_tiles`]).
    qt: &'a [Tile],
    /// The key tiles.
    kt: &'a [Tile],
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
    /// Query head `h` of sequence `bi`, query tile `qi`, as a GEMM operand:
    /// its queries and its output gradient in `dy`.
    fn q_dy(&self, bi: usize, h: usize, qi: &Tile) -> (Strided<'_>, Strided<'_>) {
        let (q, d, qd) = (&self.q, self.s.head_dim, self.s.q_dim());
        let row = bi * q.stride + qi.at;
        let qs = Strided { data: q.data, offset: row * q.width + q.col + h * d, rs: q.width, cs: 1 };
        (qs, Strided { data: self.dy, offset: row * qd + h * d, rs: qd, cs: 1 })
    }

    /// Copies key/value tile `key` of head `kvh` of sequence `bi` into the scratch.
    fn gather_kv(&self, bi: usize, kvh: usize, key: &Tile, sc: &mut Scratch) {
        let (d, col) = (self.s.head_dim, self.kv.col);
        gather_key(&mut sc.kt, &self.kv, (bi, col + kvh * d, d), key);
        gather_key(&mut sc.vt, &self.kv, (bi, col + (self.s.n_kv_head + kvh) * d, d), key);
    }

    /// Recomputes, for query tile `qi` of head `h` against the gathered key
    /// tile `key`, `P = exp(S − lse)` with `S = scale · q · kᵀ` (masked past
    /// the diagonal) into `sc.p` and `dS = P ⊙ (dy · vᵀ − D)` into `sc.ds`
    /// (`nr × nc`, row stride `nc`). With a soft cap `c`, `P` is of the
    /// capped scores `c·tanh(S/c)` and `dS` is times their derivative
    /// `1 − tanh²(S/c)`: the gradient of the uncapped `S`.
    fn probs(&self, (bi, h): (usize, usize), (qi, key): (&Tile, &Tile), sc: &mut Scratch) {
        let AttnShape { t, n_head, head_dim: d, .. } = self.s;
        let (nr, nc, c0) = (qi.len(), key.len(), key.r0);
        let (q, dy) = self.q_dy(bi, h, qi);
        let dims = GemmDims { m: nr, n: nc, k: d };
        gemm_into(dims, &mut sc.p, GemmOut::overwrite(nc), q, Strided::transposed(&sc.kt, d), self.scale, self.par);
        gemm_into(dims, &mut sc.ds, GemmOut::overwrite(nc), dy, Strided::transposed(&sc.vt, d), 1.0, self.par);
        let lse_i = &self.lse[(bi * n_head + h) * self.q.stride + qi.at..][..nr];
        let d_i = &self.dsum[(bi * n_head + h) * self.q.stride + qi.at..][..nr];
        let rows = sc.p[..nr * nc].chunks_mut(nc).zip(sc.ds.chunks_mut(nc));
        for (ri, (prow, dsrow)) in rows.enumerate() {
            let (lo, hi) = self.docs.visible((bi, t), qi.r0 + ri, (c0, nc));
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

    /// The key tiles query tile `qi` of sequence `bi` may see, and the
    /// index of the first in [`Backward::kt`].
    fn keys_of(&self, bi: usize, qi: &Tile) -> (usize, &[Tile]) {
        keys_for(self.kt, &self.docs, (bi, self.s.t), (qi.r0, qi.r1))
    }

    /// dk and dv of key tile `kj` of key/value head `bkv % n_kv_head` of
    /// sequence `bkv / n_kv_head`, overwritten (0 where none sees it): the
    /// query tiles that see any of its keys, in order, each over the
    /// group's query heads in order. With `dq` (the group's head-major dq,
    /// `[group, q.stride, d]`), also adds this key tile's share of it
    /// (overwriting at the query tile's first visible key tile; called for
    /// key tiles in order).
    fn key_tile(
        &self,
        (bkv, kj): (usize, usize),
        (dk_j, dv_j): (&mut [f32], &mut [f32]),
        mut dq: Option<&mut [f32]>,
        sc: &mut Scratch,
    ) {
        let AttnShape { t, n_head, n_kv_head, head_dim: d, .. } = self.s;
        let (bi, kvh, group) = (bkv / n_kv_head, bkv % n_kv_head, n_head / n_kv_head);
        let key = self.kt[kj];
        self.gather_kv(bi, kvh, &key, sc);
        let nc = key.len();
        // The first query tile that sees the key tile overwrites dk_j and dv_j.
        let mut first = true;
        for qi in self.qt {
            let nr = qi.len();
            if qi.r1 <= key.r0 {
                // Every row before the key tile: causally masked.
                continue;
            }
            // Starts never decrease along a row: once the first row of a
            // query tile sees no key of this tile, no later row does.
            if self.docs.start(bi, t, qi.r0) >= key.r1 {
                break;
            }
            let first_key = dq.is_some().then(|| self.keys_of(bi, qi).0 == kj);
            for g in 0..group {
                let h = kvh * group + g;
                self.probs((bi, h), (qi, &key), sc);
                let (q, dy) = self.q_dy(bi, h, qi);
                let acc = GemmOut { offset: 0, rs: d, accumulate: !first };
                first = false;
                let dims = GemmDims { m: nc, n: d, k: nr };
                // dv_j (+)= Pᵀ · dy and dk_j (+)= scale · dSᵀ · q: (nc, nr) @ (nr, d)
                gemm_into(dims, dv_j, acc, Strided::transposed(&sc.p, nc), dy, 1.0, self.par);
                gemm_into(dims, dk_j, acc, Strided::transposed(&sc.ds, nc), q, self.scale, self.par);
                if let Some(dq) = dq.as_deref_mut() {
                    // The query tile's first visible key tile overwrites, as in `query_tile`.
                    let at = (g * self.q.stride + qi.at) * d;
                    self.add_dq(&mut dq[at..][..nr * d], (nr, nc), first_key == Some(true), sc);
                }
            }
        }
        if first {
            // No query here sees these keys.
            dk_j.fill(0.0);
            dv_j.fill(0.0);
        }
    }

    /// dq of query tile `qi` of query head `bh % n_head` of sequence
    /// `bh / n_head`, overwritten: its key tiles in order (0 without any).
    fn query_tile(&self, (bh, qi): (usize, usize), dq_i: &mut [f32], sc: &mut Scratch) {
        let AttnShape { n_head, n_kv_head, .. } = self.s;
        let (bi, h, qi) = (bh / n_head, bh % n_head, &self.qt[qi]);
        let (_, keys) = self.keys_of(bi, qi);
        if keys.is_empty() {
            dq_i.fill(0.0);
        }
        for (n, key) in keys.iter().enumerate() {
            self.gather_kv(bi, h / (n_head / n_kv_head), key, sc);
            self.probs((bi, h), (qi, key), sc);
            self.add_dq(dq_i, (qi.len(), key.len()), n == 0, sc);
        }
    }
}

#[cfg(test)]
mod tests;
