//! Attention under context parallelism ([`engine::context`]): this rank's
//! rows are its positions of each sequence, its queries run against the
//! keys and values of every rank's positions, and in backward the key and
//! value gradients its queries produce reach their owners' rows. The
//! kernels run in the whole sequence's coordinates
//! ([`crate::flash::flash_attention_forward_spans`]), so packed documents,
//! sliding windows and soft caps apply as uncut.
//!
//! Two ways to reach the keys and values ([`ContextAttention`]):
//!
//! - **Ring** (the default): rank c's block of keys and values (its two
//!   chunks) passes around the group, c → c + 1, C − 1 times; at step s
//!   the rank runs its queries against the block of rank c − s while the
//!   block travels on (a buffered send posted before the attention, its
//!   receive after), and folds the partial attention into the rows so far
//!   with the online softmax ([`merge_partial`]). The backward passes the
//!   blocks again, with their key/value gradients, which each rank adds to
//!   on the way and which reach their owner after C hops; `P = exp(S −
//!   lse)` of the whole softmax's saved `lse` makes each block's gradients
//!   exact parts of the whole's. A rank holds two blocks (and in backward
//!   their gradients) at a time: `4·B·⌈T/2C⌉·2·n_kv_head·d` f32.
//! - **All-gather** (Llama 3's choice, Grattafiori et al. 2024, §3.3.2):
//!   every rank's keys and values gathered per layer (forward, and again
//!   in backward: they are never saved), their gradients one
//!   reduce-scatter; the whole sequence's keys and values on each rank
//!   during the call. A row's forward is then the uncut kernel's
//!   computation (the same key tiles in the same order: bit for bit where
//!   the rank's chunks start on multiples of the tile).
//!
//! Both add a key's gradient over ranks in another order than the uncut
//! kernel's query tiles, and the ring also adds a row's softmax in another
//! grouping (a few ulp: the conformance suite's tolerances).

use crate::attention::AttnShape;
use crate::flash::{
    flash_attention_backward, flash_attention_backward_spans, flash_attention_forward, flash_attention_forward_spans,
    Grads, Rows, Visible,
};
use engine::{ContextAttention, ContextRank, EngineError, TensorGroup};

/// Tags of the ring's messages on the context group: keys|values, and
/// their gradients.
const KV: u32 = 1;
const DKV: u32 = 2;
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

/// `(local row, whole row)` of rank `r`'s rows of `outer` sequences: row
/// `li` of sequence `o` is local row `o·local + li` (`local`: the rows per
/// sequence there — this rank's positions, or a block's padded rows) and
/// whole row `o·T + position`.
fn row_pairs(cx: Context, r: usize, outer: usize, local: usize) -> impl Iterator<Item = (usize, usize)> {
    let (pos, t) = (cx.positions_of(r), cx.t);
    (0..outer).flat_map(move |o| pos.clone().into_iter().enumerate().map(move |(li, p)| (o * local + li, o * t + p)))
}

/// `(row of the k|v columns in this rank's `[B·t_local, w]` rows, row in
/// its block)`, as values' offsets: a block holds [`ContextRank::block`]
/// rows of `2·n_kv_head·d` per sequence, this rank's positions first.
fn block_rows(s: AttnShape, cx: Context) -> impl Iterator<Item = (usize, usize)> {
    let (qd, w, block) = (s.q_dim(), s.qkv_width(), cx.rank.block(cx.t));
    (0..s.b).flat_map(move |bi| (0..s.t).map(move |li| ((bi * s.t + li) * w + qd, (bi * block + li) * (w - qd))))
}

/// The k|v columns of this rank's rows of `qkv` as a block, the rows past
/// this rank's positions 0.
fn my_block(qkv: &[f32], s: AttnShape, cx: Context) -> Vec<f32> {
    let kvw = s.qkv_width() - s.q_dim();
    let mut mine = vec![0.0f32; s.b * cx.rank.block(cx.t) * kvw];
    for (row, at) in block_rows(s, cx) {
        mine[at..][..kvw].copy_from_slice(&qkv[row..][..kvw]);
    }
    mine
}

/// This rank's queries: the q columns of its rows of `qkv`.
fn queries<'a>(qkv: &'a [f32], s: AttnShape, spans: &'a [(usize, usize)]) -> Rows<'a> {
    Rows { data: qkv, width: s.qkv_width(), col: 0, stride: s.t, spans }
}

/// Keys and values of `data`: rows of `2·n_kv_head·d`, `stride` per
/// sequence, at the positions `spans`.
fn keys<'a>(data: &'a [f32], s: AttnShape, stride: usize, spans: &'a [(usize, usize)]) -> Rows<'a> {
    Rows { data, width: s.qkv_width() - s.q_dim(), col: 0, stride, spans }
}

/// Every rank's keys and values, `[B·T, 2·n_kv_head·d]` in position order:
/// one all-gather of the ranks' blocks.
fn gather_kv(qkv: &[f32], s: AttnShape, cx: Context, group: &mut TensorGroup<'_>) -> Result<Vec<f32>, EngineError> {
    let (kvw, block) = (s.qkv_width() - s.q_dim(), cx.rank.block(cx.t));
    let mine = my_block(qkv, s, cx);
    let mut all = vec![0.0f32; cx.rank.size * mine.len()];
    group.context_all_gather(&mine, &mut all)?;
    let mut whole = vec![0.0f32; s.b * cx.t * kvw];
    for (r, theirs) in all.chunks(mine.len().max(1)).enumerate() {
        for (l, f) in row_pairs(cx, r, s.b, block) {
            whole[f * kvw..][..kvw].copy_from_slice(&theirs[l * kvw..][..kvw]);
        }
    }
    Ok(whole)
}

/// Writes this rank's key/value gradients (a block, as [`my_block`]) into
/// the k|v columns of its rows of `dqkv`.
fn put_block(dqkv: &mut [f32], mine: &[f32], s: AttnShape, cx: Context) {
    let kvw = s.qkv_width() - s.q_dim();
    for (row, at) in block_rows(s, cx) {
        dqkv[row..][..kvw].copy_from_slice(&mine[at..][..kvw]);
    }
}

/// Causal attention forward of this rank's rows ([`flash_attention_forward`]'s
/// arguments, `s.t` this rank's positions per sequence), under context
/// parallelism `cx`; unsplit, the kernel itself. `docs` are the whole
/// sequences' document starts.
///
/// # Errors
/// A collective's or the ring's failure, or `group` not `cx`'s context group.
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
    let (sw, mine) = (cx.whole_shape(s), cx.rank.chunks(cx.t));
    let q = queries(qkv, s, &mine);
    if cx.rank.attention == ContextAttention::AllGather {
        let kv = gather_kv(qkv, s, cx, group)?;
        flash_attention_forward_spans(y, lse, (q, keys(&kv, s, cx.t, &[(0, cx.t)])), sw, docs);
        return Ok(());
    }
    let (c, me, block) = (cx.rank.size, cx.rank.rank, cx.rank.block(cx.t));
    let held = my_block(qkv, s, cx);
    let (mut next, mut held) = (vec![0.0f32; held.len()], held);
    let (mut py, mut pl) = (vec![0.0f32; y.len()], vec![0.0f32; lse.len()]);
    for step in 0..c {
        let owner = (me + c - step) % c;
        if step + 1 < c {
            group.context_send_next(&held, KV)?;
        }
        let spans = cx.rank.chunks_of(owner, cx.t);
        let kv = keys(&held, s, block, &spans);
        match step {
            0 => flash_attention_forward_spans(y, lse, (q, kv), sw, docs),
            _ => {
                flash_attention_forward_spans(&mut py, &mut pl, (q, kv), sw, docs);
                merge_partial((y, lse), (&py, &pl), (s.b, s.t, s.n_head, s.head_dim));
            }
        }
        if step + 1 < c {
            group.context_recv_prev(&mut next, KV, step + 2 == c)?;
            std::mem::swap(&mut held, &mut next);
        }
    }
    Ok(())
}

/// Backward of [`attention_forward`] ([`flash_attention_backward`]'s
/// arguments for this rank's rows): this rank's dq, and dk and dv of its
/// positions summed over what every rank's queries sent them.
///
/// # Errors
/// A collective's or the ring's failure, or `group` not `cx`'s context group.
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
    let (sw, mine, w) = (cx.whole_shape(s), cx.rank.chunks(cx.t), s.qkv_width());
    let (kvw, kvd, qd) = (w - s.q_dim(), s.n_kv_head * s.head_dim, s.q_dim());
    let (c, me, block, t) = (cx.rank.size, cx.rank.rank, cx.rank.block(cx.t), cx.t);
    let q = queries(qkv, s, &mine);
    if cx.rank.attention == ContextAttention::AllGather {
        let kv = gather_kv(qkv, s, cx, group)?;
        let mut dkv = vec![0.0f32; s.b * t * kvw];
        let mut scratch = vec![0.0f32; s.b * (s.t * qd + 2 * t * kvd)];
        let whole = [(0, t)];
        let kvr = keys(&kv, s, t, &whole);
        let out = Grads::Split((&mut *dqkv, w), &mut dkv);
        flash_attention_backward_spans(out, &mut scratch, dy, (q, kvr), (y, lse), sw, docs);
        // Each rank's rows of the key/value gradients, summed over the group.
        let mut all = vec![0.0f32; c * s.b * block * kvw];
        for (r, theirs) in all.chunks_mut((s.b * block * kvw).max(1)).enumerate() {
            for (l, f) in row_pairs(cx, r, s.b, block) {
                theirs[l * kvw..][..kvw].copy_from_slice(&dkv[f * kvw..][..kvw]);
            }
        }
        let mut summed = vec![0.0f32; s.b * block * kvw];
        group.context_reduce_scatter(&all, &mut summed)?;
        put_block(dqkv, &summed, s, cx);
        return Ok(());
    }
    let mut held = my_block(qkv, s, cx);
    let (mut dheld, mut dstep) = (vec![0.0f32; held.len()], vec![0.0f32; held.len()]);
    let (mut next, mut dnext) = (vec![0.0f32; held.len()], vec![0.0f32; held.len()]);
    let mut dq = vec![0.0f32; s.b * s.t * qd];
    let mut scratch = vec![0.0f32; s.b * (s.t * qd + 2 * block * kvd)];
    for step in 0..c {
        let owner = (me + c - step) % c;
        if step + 1 < c {
            group.context_send_next(&held, KV)?;
        }
        let spans = cx.rank.chunks_of(owner, t);
        let kv = keys(&held, s, block, &spans);
        let out = match step {
            0 => Grads::Split((&mut *dqkv, w), &mut dstep),
            _ => Grads::Split((&mut dq, qd), &mut dstep),
        };
        flash_attention_backward_spans(out, &mut scratch, dy, (q, kv), (y, lse), sw, docs);
        if step > 0 {
            for (row, add) in dqkv.chunks_mut(w).zip(dq.chunks(qd)) {
                row[..qd].iter_mut().zip(add).for_each(|(a, &x)| *a += x);
            }
        }
        dheld.iter_mut().zip(&dstep).for_each(|(a, &x)| *a += x);
        // The block's gradients travel with it; after the last step they
        // belong to the next rank, one more hop away.
        group.context_send_next(&dheld, DKV)?;
        if step + 1 < c {
            group.context_recv_prev(&mut next, KV, false)?;
            std::mem::swap(&mut held, &mut next);
        }
        group.context_recv_prev(&mut dnext, DKV, step + 1 == c)?;
        std::mem::swap(&mut dheld, &mut dnext);
    }
    put_block(dqkv, &dheld, s, cx);
    Ok(())
}

/// Folds the partial attention `(y, lse)` of some keys into `(acc_y,
/// acc_lse)`, that of others (rows of `d` per (row, head); `lse` per
/// head-major row, `heads` heads): the attention over both key sets,
/// `lse = ln(e^a + e^b)` and `y = e^(a−lse)·y_a + e^(b−lse)·y_b` (the
/// online softmax's step, in f64 with libm's `exp` and `ln_1p`, each
/// result rounded once to f32). A part
/// with `lse = −∞` (no key) leaves the other as it is. `acc_*` start as
/// `0` and `−∞`.
///
/// # Panics
/// Unless the lengths agree.
pub fn merge_partial(
    (acc_y, acc_lse): (&mut [f32], &mut [f32]),
    (y, lse): (&[f32], &[f32]),
    (b, rows, heads, d): (usize, usize, usize, usize),
) {
    assert!(acc_y.len() == b * rows * heads * d && y.len() == acc_y.len() && lse.len() == b * heads * rows);
    assert_eq!(acc_lse.len(), lse.len(), "merge_partial: log-sum-exps");
    for bi in 0..b {
        for h in 0..heads {
            for r in 0..rows {
                let li = (bi * heads + h) * rows + r;
                let (a, z) = (acc_lse[li], lse[li]);
                if z == f32::NEG_INFINITY {
                    continue;
                }
                let at = (bi * rows + r) * heads * d + h * d;
                let (ya, yz) = (&mut acc_y[at..][..d], &y[at..][..d]);
                if a == f32::NEG_INFINITY {
                    ya.copy_from_slice(yz);
                    acc_lse[li] = z;
                    continue;
                }
                // In f64: the weights' exponents are differences of
                // log-sum-exps of order 1–10, whose f32 rounding alone
                // (up to 5e-7) would move every weight by as much.
                let (a, z) = (f64::from(a), f64::from(z));
                let new = a.max(z) + (-(a - z).abs()).exp().ln_1p();
                let (wa, wz) = ((a - new).exp(), (z - new).exp());
                ya.iter_mut().zip(yz).for_each(|(x, &v)| *x = (wa * f64::from(*x) + wz * f64::from(v)) as f32);
                acc_lse[li] = new as f32;
            }
        }
    }
}
