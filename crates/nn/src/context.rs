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

/// `qkv` of this rank's rows (`[B·t_local, w]`) as the whole sequences'
/// `[B·T, w]`: every rank's keys and values (one all-gather of the k|v
/// columns, each rank's rows padded to [`ContextRank::block`]) and this
/// rank's queries; the other ranks' query columns are 0.
fn gather_qkv(qkv: &[f32], s: AttnShape, cx: Context, group: &mut TensorGroup<'_>) -> Result<Vec<f32>, EngineError> {
    let (qd, w, t, b) = (s.q_dim(), s.qkv_width(), cx.t, s.b);
    let (kvw, block, c) = (w - qd, cx.rank.block(t), cx.rank.size);
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
        let pos = cx.positions_of(r);
        for bi in 0..b {
            for (li, &p) in pos.iter().enumerate() {
                full[(bi * t + p) * w + qd..][..kvw].copy_from_slice(&theirs[(bi * block + li) * kvw..][..kvw]);
            }
        }
    }
    let pos = cx.positions_of(cx.rank.rank);
    for bi in 0..b {
        for (li, &p) in pos.iter().enumerate() {
            full[(bi * t + p) * w..][..qd].copy_from_slice(&qkv[(bi * s.t + li) * w..][..qd]);
        }
    }
    Ok(full)
}

/// Rows of `width` of this rank (`[B·t_local, width]`) placed at their
/// positions of `[B·T, width]` (0 elsewhere), or (`back`) taken from them.
fn place_rows(local: &mut [f32], full: &mut [f32], width: usize, (b, tl): (usize, usize), cx: Context, back: bool) {
    let pos = cx.positions_of(cx.rank.rank);
    for bi in 0..b {
        for (li, &p) in pos.iter().enumerate() {
            let (l, f) = (&mut local[(bi * tl + li) * width..][..width], &mut full[(bi * cx.t + p) * width..][..width]);
            match back {
                true => l.copy_from_slice(f),
                false => f.copy_from_slice(l),
            }
        }
    }
}

/// The log-sum-exps `[B, n_head, t_local]` of this rank at their positions
/// of `[B, n_head, T]`, or (`back`) taken from them.
fn place_lse(local: &mut [f32], full: &mut [f32], s: AttnShape, cx: Context, back: bool) {
    let pos = cx.positions_of(cx.rank.rank);
    for (l, f) in local.chunks_mut(s.t).zip(full.chunks_mut(cx.t)) {
        for (li, &p) in pos.iter().enumerate() {
            match back {
                true => l[li] = f[p],
                false => f[p] = l[li],
            }
        }
    }
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
    place_rows(y, &mut yf, s.q_dim(), (s.b, s.t), cx, true);
    place_lse(lse, &mut lf, s, cx, true);
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
    let (mut yf, mut dyf) = (vec![0.0f32; b * t * qd], vec![0.0f32; b * t * qd]);
    place_rows(&mut y.to_vec(), &mut yf, qd, (b, s.t), cx, false);
    place_rows(&mut dy.to_vec(), &mut dyf, qd, (b, s.t), cx, false);
    let mut lf = vec![0.0f32; b * s.n_head * t];
    place_lse(&mut lse.to_vec(), &mut lf, s, cx, false);
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
    place_rows(dqkv, &mut df, w, (b, s.t), cx, true);
    let (kvw, block, c) = (w - qd, cx.rank.block(t), cx.rank.size);
    let mut all = vec![0.0f32; c * b * block * kvw];
    for (r, theirs) in all.chunks_mut((b * block * kvw).max(1)).enumerate() {
        for bi in 0..b {
            for (li, p) in cx.positions_of(r).into_iter().enumerate() {
                theirs[(bi * block + li) * kvw..][..kvw].copy_from_slice(&df[(bi * t + p) * w + qd..][..kvw]);
            }
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
