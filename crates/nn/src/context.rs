//! Attention under context parallelism ([`engine::context`]): this rank's
//! rows are its positions of each sequence; the keys and values of every
//! position are gathered from the context group, the flash kernels run
//! this rank's query rows against them
//! ([`crate::flash::flash_attention_forward_rows`]), and in backward the
//! key/value gradients this rank's queries produced for every position
//! are summed over the group into their owners' rows.
//!
//! Keys and values travel as one all-gather per layer (forward, and again
//! in backward: they are never saved), their gradients as one
//! reduce-scatter — the collectives Llama 3 chose for context parallelism
//! (Grattafiori et al. 2024, §3.3.2), whose document masks they leave
//! untouched: the kernel runs in the whole sequence's coordinates, so
//! packed documents, sliding windows and soft caps apply as uncut. The
//! forward of a row is the uncut kernel's computation (the same key tiles
//! in the same order; bit for bit where the rank's chunks start on
//! multiples of the tile); a key's gradient adds the ranks' sums in rank
//! order instead of the query tiles' order. Working buffers of the whole
//! sequence (q|k|v, and in backward y, dy and the gradients) are allocated
//! per call: `B·T·(2·(n_head + 2·n_kv_head) + 2·n_head)·d` f32 at most.

use crate::attention::AttnShape;
use crate::flash::{
    flash_attention_backward, flash_attention_backward_rows, flash_attention_forward, flash_attention_forward_rows,
    Visible,
};
use engine::{ContextRank, EngineError, TensorGroup};

/// Where a call's rows sit in their sequences: this rank of the context
/// group and the whole sequences' length (the call's rows are
/// [`ContextRank::positions`] of each).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Context {
    /// This rank.
    pub rank: ContextRank,
    /// Positions of a whole sequence.
    pub t: usize,
}

impl Context {
    /// Whole sequences of `t` on every rank.
    pub fn whole(t: usize) -> Self {
        Context { rank: ContextRank::WHOLE, t }
    }

    /// Whether the sequences are split over more than one rank.
    pub fn is_split(&self) -> bool {
        self.rank.is_split()
    }

    /// The whole sequences' shape of a call shaped `s` (its rows).
    fn whole_shape(&self, s: AttnShape) -> AttnShape {
        AttnShape { t: self.t, ..s }
    }

    /// Positions of rank `r`'s rows of a sequence, in order.
    fn positions_of(&self, r: usize) -> Vec<usize> {
        self.rank.chunks_of(r, self.t).into_iter().flat_map(|(a, b)| a..b).collect()
    }

    /// Errors unless `group` is this rank's context group.
    fn check(&self, group: &TensorGroup<'_>, s: AttnShape) -> Result<(), EngineError> {
        let here = (self.rank.rank, self.rank.size);
        if group.context() != Some(here) || s.t != self.rank.local_len(self.t) {
            return Err(EngineError::TensorParallel(format!(
                "attention on {} of sequences of {} positions got {} rows per sequence and the group {:?}",
                self.rank,
                self.t,
                s.t,
                group.context()
            )));
        }
        Ok(())
    }
}

/// `(local row, whole row)` of rank `r`'s rows of `outer` sequences (or
/// sequence × head rows): row `li` of outer `o` is local row `o·local +
/// li` (`local`: the rows per outer index there — this rank's positions,
/// or a gather's padded block) and whole row `o·T + position`.
fn row_pairs(cx: Context, r: usize, outer: usize, local: usize) -> impl Iterator<Item = (usize, usize)> {
    let (pos, t) = (cx.positions_of(r), cx.t);
    (0..outer).flat_map(move |o| pos.clone().into_iter().enumerate().map(move |(li, p)| (o * local + li, o * t + p)))
}

/// Copies `width` values at column `col` of each pair's local row of `src`
/// (rows of `src_w`) into its whole row of `dst` (rows of `dst_w`); with
/// `to_local`, the other way.
fn copy_pairs(
    pairs: impl Iterator<Item = (usize, usize)>,
    (local, whole): (&[f32], &mut [f32]),
    (local_w, whole_w, col, width): (usize, usize, (usize, usize), usize),
) {
    for (l, f) in pairs {
        whole[f * whole_w + col.1..][..width].copy_from_slice(&local[l * local_w + col.0..][..width]);
    }
}

/// `qkv` of this rank's rows (`[B·t_local, w]`) as the whole sequences'
/// `[B·T, w]`: every rank's keys and values (one all-gather of the k|v
/// columns, each rank's rows padded to [`ContextRank::block`]) and this
/// rank's queries; the other ranks' query columns are 0.
fn gather_qkv(qkv: &[f32], s: AttnShape, cx: Context, group: &mut TensorGroup<'_>) -> Result<Vec<f32>, EngineError> {
    let (qd, w, t, b) = (s.q_dim(), s.qkv_width(), cx.t, s.b);
    let (kvw, block, c, me) = (w - qd, cx.rank.block(t), cx.rank.size, cx.rank.rank);
    let mut mine = vec![0.0f32; b * block * kvw];
    for (bi, rows) in qkv.chunks(s.t * w).enumerate() {
        for (li, row) in rows.chunks(w).enumerate() {
            mine[(bi * block + li) * kvw..][..kvw].copy_from_slice(&row[qd..]);
        }
    }
    let mut all = vec![0.0f32; c * mine.len()];
    group.context_all_gather(&mine, &mut all)?;
    let mut full = vec![0.0f32; b * t * w];
    for (r, theirs) in all.chunks(mine.len().max(1)).enumerate() {
        copy_pairs(row_pairs(cx, r, b, block), (theirs, &mut full), (kvw, w, (0, qd), kvw));
    }
    copy_pairs(row_pairs(cx, me, b, s.t), (qkv, &mut full), (w, w, (0, 0), qd));
    Ok(full)
}

/// This rank's rows of `whole` (rows of `width` per whole position, `outer`
/// sequences or sequence × head rows) into `local`.
fn take_rows(whole: &[f32], local: &mut [f32], width: usize, (outer, tl): (usize, usize), cx: Context) {
    for (l, f) in row_pairs(cx, cx.rank.rank, outer, tl) {
        local[l * width..][..width].copy_from_slice(&whole[f * width..][..width]);
    }
}

/// This rank's rows `local` placed at their positions of a zeroed whole buffer.
fn whole_rows(local: &[f32], width: usize, (outer, tl): (usize, usize), cx: Context) -> Vec<f32> {
    let mut whole = vec![0.0f32; outer * cx.t * width];
    copy_pairs(row_pairs(cx, cx.rank.rank, outer, tl), (local, &mut whole), (width, width, (0, 0), width));
    whole
}

/// Causal attention forward of this rank's rows ([`flash_attention_forward`]'s
/// arguments, `s.t` this rank's positions per sequence), under context
/// parallelism `cx`; unsplit, the kernel itself. `docs` are the whole
/// sequences' document starts.
///
/// # Errors
/// A collective's failure, or `group` not `cx`'s context group.
pub fn attention_forward(
    y: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    (s, docs): (AttnShape, Visible<'_>),
    cx: Context,
    group: &mut TensorGroup<'_>,
) -> Result<(), EngineError> {
    if !cx.is_split() {
        flash_attention_forward(y, lse, qkv, s, docs);
        return Ok(());
    }
    cx.check(group, s)?;
    let full = gather_qkv(qkv, s, cx, group)?;
    let sf = cx.whole_shape(s);
    let (mut yf, mut lf) = (vec![0.0f32; s.b * cx.t * s.q_dim()], vec![0.0f32; s.b * s.n_head * cx.t]);
    flash_attention_forward_rows(&mut yf, &mut lf, &full, sf, docs, &cx.rank.chunks(cx.t));
    take_rows(&yf, y, s.q_dim(), (s.b, s.t), cx);
    take_rows(&lf, lse, 1, (s.b * s.n_head, s.t), cx);
    Ok(())
}

/// Backward of [`attention_forward`] ([`flash_attention_backward`]'s
/// arguments for this rank's rows): this rank's dq, and dk and dv of its
/// positions summed over what every rank's queries sent them.
///
/// # Errors
/// A collective's failure, or `group` not `cx`'s context group.
pub fn attention_backward(
    dqkv: &mut [f32],
    heads: &mut [f32],
    dy: &[f32],
    saved: (&[f32], &[f32], &[f32]),
    (s, docs): (AttnShape, Visible<'_>),
    cx: Context,
    group: &mut TensorGroup<'_>,
) -> Result<(), EngineError> {
    if !cx.is_split() {
        flash_attention_backward(dqkv, heads, dy, saved, s, docs);
        return Ok(());
    }
    cx.check(group, s)?;
    let (qkv, y, lse) = saved;
    let (qd, w, t, b) = (s.q_dim(), s.qkv_width(), cx.t, s.b);
    let full = gather_qkv(qkv, s, cx, group)?;
    let (yf, dyf) = (whole_rows(y, qd, (b, s.t), cx), whole_rows(dy, qd, (b, s.t), cx));
    let lf = whole_rows(lse, 1, (b * s.n_head, s.t), cx);
    let (mut df, mut hf) = (vec![0.0f32; b * t * w], vec![0.0f32; b * t * w]);
    flash_attention_backward_rows(
        &mut df,
        &mut hf,
        &dyf,
        (&full, &yf, &lf),
        cx.whole_shape(s),
        docs,
        &cx.rank.chunks(t),
    );
    drop(hf);
    // This rank's rows whole (dq only here); then dk|dv summed over the group.
    take_rows(&df, dqkv, w, (b, s.t), cx);
    let (kvw, block, c) = (w - qd, cx.rank.block(t), cx.rank.size);
    let mut all = vec![0.0f32; c * b * block * kvw];
    for (r, theirs) in all.chunks_mut((b * block * kvw).max(1)).enumerate() {
        for (l, f) in row_pairs(cx, r, b, block) {
            theirs[l * kvw..][..kvw].copy_from_slice(&df[f * w + qd..][..kvw]);
        }
    }
    let mut mine = vec![0.0f32; b * block * kvw];
    group.context_reduce_scatter(&all, &mut mine)?;
    for (bi, rows) in dqkv.chunks_mut(s.t * w).enumerate() {
        for (li, row) in rows.chunks_mut(w).enumerate() {
            row[qd..].copy_from_slice(&mine[(bi * block + li) * kvw..][..kvw]);
        }
    }
    Ok(())
}
