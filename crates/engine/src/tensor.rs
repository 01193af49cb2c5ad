//! Tensor parallelism (Megatron-LM's split of a transformer block): rank
//! `t` of a group of `T` holds a slice of each split matrix — attention
//! heads, MLP columns — and the whole of every replicated tensor (norms,
//! embeddings, biases added after a reduction). A model built for one rank
//! has its own, smaller layout ([`TensorShards`] maps it to the whole
//! model's, so checkpoints stay layout-free) and reaches its group through
//! the [`TensorGroup`] of each segment it is handed: one all-reduce after
//! each row-parallel product in forward, one before each column-parallel
//! input gradient in backward (the paper's `g` and `f`).
//!
//! Gradients: a split tensor's slice gets its complete gradient on its rank.
//! A replicated tensor whose inputs are the same on every rank (a norm, a
//! bias after the reduction, the embeddings) gets the same gradient on every
//! rank ([`Shard::Replicated`]); one that each rank feeds from its own
//! heads (key/value projections replicated because `T` does not divide
//! their head count, a LoRA factor beside a split matrix) holds a part of
//! its gradient on each rank, summed over the group at the step boundary
//! ([`Shard::Partial`]).

use crate::error::EngineError;
use crate::layout::{ParamLayout, TensorSpec};
use comm::{CommError, Communicator};
use std::ops::Range;
use std::time::Instant;

/// Rank `rank` of a tensor-parallel group of `size` ranks (`size == 1`: no
/// split), and whether the vocabulary is split over the group too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpRank {
    /// This rank's place in the group.
    pub rank: usize,
    /// Ranks in the group (T).
    pub size: usize,
    /// The token embedding and the head split by vocabulary rows, rank `t`
    /// holding rows `t·V/T .. (t+1)·V/T` (Megatron-LM's vocab-parallel
    /// embedding and cross-entropy); `false`: whole on every rank.
    pub vocab: bool,
    /// Sequence parallelism (Korthikanti et al.): the residual stream's
    /// rows (norms, residual additions, dropout-free regions) split over
    /// the group, rank `t` holding [`TpRank::seq_rows`]; the all-reduces
    /// around each parallel block become an all-gather before and a
    /// reduce-scatter after. `false`: every rank holds every row.
    pub seq: bool,
}

impl Default for TpRank {
    fn default() -> Self {
        TpRank::WHOLE
    }
}

impl TpRank {
    /// No split: one rank holds everything.
    pub const WHOLE: TpRank = TpRank::new(0, 1);

    /// Rank `rank` of a group of `size`, the vocabulary whole on every rank.
    pub const fn new(rank: usize, size: usize) -> Self {
        TpRank { rank, size, vocab: false, seq: false }
    }

    /// This rank with the residual stream's rows split (`true`) or whole.
    pub const fn with_seq(self, seq: bool) -> Self {
        TpRank { seq, ..self }
    }

    /// Whether this rank holds a slice of the residual stream's rows
    /// (sequence parallelism over more than one rank).
    pub fn splits_seq(&self) -> bool {
        self.seq && self.is_split()
    }

    /// The rows of `n` this rank holds in the residual stream: its block
    /// of [`seq_block`] rows (the last blocks shorter or empty where the
    /// group does not divide `n`) under sequence parallelism, all of them
    /// otherwise.
    pub fn seq_rows(&self, n: usize) -> Range<usize> {
        match self.splits_seq() {
            true => rows_of(self.rank, self.size, n),
            false => 0..n,
        }
    }

    /// [`TpRank::seq_rows`] as (start, end) where the rows are split
    /// (sequence parallelism over more than one rank), else `None`.
    pub fn held_rows(&self, n: usize) -> Option<(usize, usize)> {
        self.splits_seq().then(|| self.seq_rows(n)).map(|r| (r.start, r.end))
    }

    /// This rank with the vocabulary split (`true`) or whole.
    pub const fn with_vocab(self, vocab: bool) -> Self {
        TpRank { vocab, ..self }
    }

    /// Whether this rank holds a slice of the vocabulary (split over more than one rank).
    pub fn splits_vocab(&self) -> bool {
        self.vocab && self.is_split()
    }

    /// Why a vocabulary of `v` cannot be split over this group by rows, if
    /// it cannot (T must divide it), with the fix.
    pub fn vocab_problem(&self, v: usize) -> Option<String> {
        (self.splits_vocab() && !v.is_multiple_of(self.size)).then(|| {
            format!(
                "the vocabulary ({v}) must be divisible by dist.tensor_parallel ({}) to split it by rows (dist.vocab_parallel = true): choose a dist.tensor_parallel that divides {v}, or set dist.vocab_parallel = false, or (a model trained from scratch) pad the vocabulary to a multiple of {} (model.vocab_size = {})",
                self.size,
                self.size,
                v.next_multiple_of(self.size)
            )
        })
    }

    /// The vocabulary rows this rank holds of `v`: its slice where the
    /// vocabulary is split, all of them otherwise.
    pub fn vocab_rows(&self, v: usize) -> Range<usize> {
        match self.splits_vocab() {
            true => self.range(v, self.size),
            false => 0..v,
        }
    }

    /// Whether tensors are split over more than one rank.
    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// This rank's share of `n` equal parts (`n / size`; `size` divides `n`).
    pub fn local(&self, n: usize) -> usize {
        n / self.size.max(1)
    }

    /// Which of `parts` pieces this rank holds (`parts` divides the group
    /// size: `size / parts` consecutive ranks hold each piece).
    pub fn piece(&self, parts: usize) -> usize {
        self.rank / (self.size / parts.max(1)).max(1)
    }

    /// This rank's range of `n` cut into `parts` equal pieces.
    pub fn range(&self, n: usize, parts: usize) -> Range<usize> {
        let l = n / parts.max(1);
        let p = self.piece(parts);
        p * l..(p + 1) * l
    }
}

/// "tensor-parallel rank t of T", and "(vocabulary split)" where it is.
impl std::fmt::Display for TpRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tensor-parallel rank {} of {}", self.rank, self.size)?;
        match (self.splits_vocab(), self.splits_seq()) {
            (true, true) => write!(f, " (vocabulary and sequence split)"),
            (true, false) => write!(f, " (vocabulary split)"),
            (false, true) => write!(f, " (sequence split)"),
            (false, false) => Ok(()),
        }
    }
}

/// Rows per rank when `n` rows are split over `size` ranks: `⌈n / size⌉`
/// (the collectives' block; a rank past the end holds fewer or none).
pub fn seq_block(n: usize, size: usize) -> usize {
    n.div_ceil(size.max(1))
}

/// Rank `rank`'s rows of `n` split over `size` ranks in blocks of [`seq_block`].
fn rows_of(rank: usize, size: usize, n: usize) -> Range<usize> {
    let b = seq_block(n, size);
    (rank * b).min(n)..((rank + 1) * b).min(n)
}

/// How one tensor of a rank's layout relates to the whole model's tensor
/// of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// The whole tensor on every rank, with the same gradient on every rank.
    Replicated,
    /// The whole tensor on every rank; each rank's gradient is a part,
    /// summed over the group at the boundary.
    Partial,
    /// The whole tensor viewed as `[outer, dim, inner]` (row-major), the
    /// middle axis cut into `parts` pieces; this rank holds piece
    /// [`TpRank::piece`]`(parts)` — `[outer, dim / parts, inner]`. A
    /// column-parallel `nn.Linear` weight `[out, in]` is `{1, out, in}`; a
    /// row-parallel one `{out, in, 1}`; heads are `{…, n_head, head_dim ·
    /// …}`. `parts` is the group size, or a divisor of it when fewer pieces
    /// exist than ranks (grouped-query key/value heads, `n_kv_head < T`):
    /// then `T / parts` ranks hold each piece, and each holds a part of its
    /// gradient, summed over them at the boundary.
    Split {
        /// Product of the axes before the split one.
        outer: usize,
        /// The split axis.
        dim: usize,
        /// Product of the axes after it.
        inner: usize,
        /// Pieces the axis is cut into.
        parts: usize,
    },
}

impl Shard {
    /// Whether every rank holds all of the tensor.
    pub fn is_replicated(&self) -> bool {
        matches!(self, Shard::Replicated | Shard::Partial)
    }

    /// Whether rank `tp` counts this tensor in the global gradient norm:
    /// each piece of the whole model once (a replicated tensor on rank 0).
    pub fn counted_by(&self, tp: TpRank) -> bool {
        match *self {
            Shard::Replicated | Shard::Partial => tp.rank == 0,
            Shard::Split { parts, .. } => tp.rank.is_multiple_of((tp.size / parts.max(1)).max(1)),
        }
    }

    /// Whether each rank holds only a part of this tensor's gradient
    /// (summed over the ranks holding the same values at the boundary).
    pub fn partial_gradient(&self, tp: TpRank) -> bool {
        match *self {
            Shard::Replicated => false,
            Shard::Partial => true,
            Shard::Split { parts, .. } => parts < tp.size,
        }
    }
}

/// A tensor-parallel rank's layout mapped onto the whole model's: per
/// tensor of the rank's layout (same order and names as the whole
/// layout), its [`Shard`].
#[derive(Debug, Clone, PartialEq)]
pub struct TensorShards {
    /// This rank.
    pub tp: TpRank,
    /// The whole model's layout.
    pub full: ParamLayout,
    /// The rank's layout.
    pub local: ParamLayout,
    /// One per tensor of both layouts.
    pub shards: Vec<Shard>,
}

impl TensorShards {
    /// The map of rank `tp`'s `local` layout onto `full`: the same tensor
    /// names in the same order, each shape as its shard says. Trainable
    /// flags of `full` are taken from `local`.
    pub fn new(tp: TpRank, mut full: ParamLayout, local: ParamLayout, shards: Vec<Shard>) -> Result<Self, EngineError> {
        let bad = |m: String| Err(EngineError::TensorParallel(m));
        if tp.size == 0 || tp.rank >= tp.size {
            return bad(format!("rank {} of a group of {}", tp.rank, tp.size));
        }
        let (f, l) = (full.tensors(), local.tensors());
        if f.len() != l.len() || shards.len() != l.len() {
            return bad(format!("{} whole tensors, {} local, {} shards", f.len(), l.len(), shards.len()));
        }
        for ((ft, lt), s) in f.iter().zip(l).zip(&shards) {
            let ok = ft.name == lt.name
                && match *s {
                    Shard::Replicated | Shard::Partial => ft.shape == lt.shape,
                    Shard::Split { outer, dim, inner, parts } => {
                        parts > 0
                            && tp.size.is_multiple_of(parts)
                            && dim.is_multiple_of(parts)
                            && outer * dim * inner == ft.numel()
                            && outer * (dim / parts) * inner == lt.numel()
                    }
                };
            if !ok {
                return bad(format!(
                    "{} {:?} cannot be {s:?} of {} {:?} at T = {}",
                    lt.name, lt.shape, ft.name, ft.shape, tp.size
                ));
            }
        }
        let trainable: std::collections::HashMap<&str, bool> =
            l.iter().map(|t| (t.name.as_str(), t.trainable)).collect();
        full.set_trainable(|t| trainable.get(t.name.as_str()).copied().unwrap_or(true));
        Ok(TensorShards { tp, full, local, shards })
    }

    /// The tensors of a buffer: every tensor (parameters), or the trainable
    /// ones back to back (`grad_space`: gradients, optimizer state).
    pub(crate) fn spans(layout: &ParamLayout, grad_space: bool) -> Vec<Option<Range<usize>>> {
        let mut at = 0;
        layout
            .tensors()
            .iter()
            .map(|t: &TensorSpec| {
                if grad_space && !t.trainable {
                    return None;
                }
                let r = if grad_space { at..at + t.numel() } else { t.range() };
                at = r.end;
                Some(r)
            })
            .collect()
    }

    fn len(layout: &ParamLayout, grad_space: bool) -> usize {
        if grad_space {
            layout.n_trainable()
        } else {
            layout.n_params()
        }
    }

    /// Rank `tp`'s part of one whole tensor's values, appended to `out`.
    pub fn take_tensor(shard: Shard, tp: TpRank, whole: &[f32], out: &mut Vec<f32>) {
        match shard {
            Shard::Replicated | Shard::Partial => out.extend_from_slice(whole),
            Shard::Split { outer, dim, inner, parts } => {
                let r = tp.range(dim, parts);
                for o in 0..outer {
                    out.extend_from_slice(&whole[(o * dim + r.start) * inner..(o * dim + r.end) * inner]);
                }
            }
        }
    }

    /// This rank's part of a whole-model buffer: parameters, or with
    /// `grad_space` a buffer of the trainable tensors (optimizer state).
    pub fn take(&self, whole: &[f32], grad_space: bool) -> Result<Vec<f32>, EngineError> {
        let want = Self::len(&self.full, grad_space);
        if whole.len() != want {
            return Err(EngineError::ParamCount { expected: want, got: whole.len() });
        }
        let mut out = Vec::with_capacity(Self::len(&self.local, grad_space));
        for (span, s) in Self::spans(&self.full, grad_space).into_iter().zip(&self.shards) {
            if let Some(r) = span {
                Self::take_tensor(*s, self.tp, &whole[r], &mut out);
            }
        }
        Ok(out)
    }

    /// The inverse of [`TensorShards::take_tensor`]: rank `tp`'s `piece`
    /// written into its place in the whole tensor `whole` (all of it for
    /// a replicated tensor).
    pub fn place_tensor(shard: Shard, tp: TpRank, piece: &[f32], whole: &mut [f32]) {
        match shard {
            Shard::Replicated | Shard::Partial => whole.copy_from_slice(piece),
            Shard::Split { outer, dim, inner, parts } => {
                let r = tp.range(dim, parts);
                let per = r.len() * inner;
                for o in 0..outer {
                    let dst = (o * dim + r.start) * inner;
                    whole[dst..dst + per].copy_from_slice(&piece[o * per..(o + 1) * per]);
                }
            }
        }
    }

    /// This rank's part of the whole model's parameters `range` (whole
    /// tensors, e.g. a segment), given as `whole`.
    pub fn take_range(&self, range: Range<usize>, whole: &[f32]) -> Vec<f32> {
        let ts = self.full.tensors();
        let first = ts.partition_point(|t| t.offset < range.start);
        let end = ts.partition_point(|t| t.offset < range.end);
        self.take_tensors(first..end, whole)
    }

    /// This rank's part of whole-model segment values: `whole` holds the
    /// whole layout's tensors `tensors` back to back.
    pub fn take_tensors(&self, tensors: Range<usize>, whole: &[f32]) -> Vec<f32> {
        let mut out = Vec::new();
        let mut at = 0;
        for i in tensors {
            let n = self.full.tensors()[i].numel();
            Self::take_tensor(self.shards[i], self.tp, &whole[at..at + n], &mut out);
            at += n;
        }
        out
    }

    /// Rank 0 of `group` assembles the whole-model buffer from every
    /// rank's `local` one (replicated tensors from its own); the others
    /// send theirs and get `None`. Every rank of the group calls it.
    pub fn gather(
        &self,
        group: &mut dyn Communicator,
        local: &[f32],
        grad_space: bool,
    ) -> Result<Option<Vec<f32>>, CommError> {
        const TAG: u32 = 7;
        if self.tp.rank > 0 {
            group.send(local, 0, TAG)?;
            group.flush_sends()?;
            return Ok(None);
        }
        let (fs, ls) = (Self::spans(&self.full, grad_space), Self::spans(&self.local, grad_space));
        let mut whole = vec![0.0; Self::len(&self.full, grad_space)];
        // Each rank's buffer placed as it arrives (rank 0's own first, with
        // the replicated tensors): one received buffer held at a time.
        let mut buf = Vec::new();
        for from in 0..self.tp.size {
            let part = if from == 0 {
                local
            } else {
                buf.resize(local.len(), 0.0);
                group.recv(&mut buf, from, TAG)?;
                &buf[..]
            };
            let rank = TpRank { rank: from, ..self.tp };
            for ((f, l), s) in fs.iter().zip(&ls).zip(&self.shards) {
                if let (Some(f), Some(l), true) = (f, l, from == 0 || !s.is_replicated()) {
                    Self::place_tensor(*s, rank, &part[l.clone()], &mut whole[f.clone()]);
                }
            }
        }
        Ok(Some(whole))
    }
}

/// Time and bytes of a rank's tensor-parallel all-reduces.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TpTraffic {
    /// All-reduce calls.
    pub calls: u64,
    /// Bytes each rank contributed (f32 elements × 4).
    pub bytes: u64,
    /// Seconds spent in them (waiting for the slowest rank included).
    pub seconds: f64,
}

/// A tensor-parallel group as a step uses it: the communicator, where its
/// traffic is counted, and the step (for errors).
pub(crate) struct TpLink<'c> {
    pub(crate) comm: &'c mut dyn Communicator,
    pub(crate) traffic: &'c mut TpTraffic,
    pub(crate) step: u64,
}

/// What a [`TensorGroup`] reaches (a [`TpLink`] of any lifetime).
trait Reduce {
    fn sum(&mut self, buf: &mut [f32]) -> Result<(), EngineError>;
    fn gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), EngineError>;
    fn scatter(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), EngineError>;
    fn place(&self) -> (usize, usize);
    /// Sends `buf` to the next rank of the ring under `tag`.
    fn send_next(&mut self, buf: &[f32], tag: u32) -> Result<(), EngineError>;
    /// Receives the previous rank's next message under `tag` into `buf`;
    /// with `flush`, then waits until this rank's sends are delivered.
    fn recv_prev(&mut self, buf: &mut [f32], tag: u32, flush: bool) -> Result<(), EngineError>;
}

impl TpLink<'_> {
    /// Runs one collective, counting `bytes` contributed and its time.
    fn timed(
        &mut self,
        bytes: usize,
        run: impl FnOnce(&mut dyn Communicator) -> Result<(), CommError>,
    ) -> Result<(), EngineError> {
        let t0 = Instant::now();
        run(&mut *self.comm).map_err(|source| EngineError::Comm { step: self.step, source })?;
        self.traffic.calls += 1;
        self.traffic.bytes += 4 * bytes as u64;
        self.traffic.seconds += t0.elapsed().as_secs_f64();
        Ok(())
    }
}

impl Reduce for TpLink<'_> {
    fn sum(&mut self, buf: &mut [f32]) -> Result<(), EngineError> {
        self.timed(buf.len(), |c| c.all_reduce_sum(buf))
    }

    fn gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), EngineError> {
        self.timed(input.len(), |c| c.all_gather(input, output))
    }

    fn scatter(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), EngineError> {
        self.timed(input.len(), |c| c.reduce_scatter_sum(input, output))
    }

    fn place(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world_size())
    }

    fn send_next(&mut self, buf: &[f32], tag: u32) -> Result<(), EngineError> {
        let (rank, size) = self.place();
        self.timed(buf.len(), |c| c.send(buf, (rank + 1) % size, tag))
    }

    fn recv_prev(&mut self, buf: &mut [f32], tag: u32, flush: bool) -> Result<(), EngineError> {
        let (rank, size) = self.place();
        let t0 = Instant::now();
        let mut run = || {
            self.comm.recv(buf, (rank + size - 1) % size, tag)?;
            match flush {
                true => self.comm.flush_sends(),
                false => Ok(()),
            }
        };
        run().map_err(|source| EngineError::Comm { step: self.step, source })?;
        // The wait counts as the ring's time; the bytes and calls are the sends'.
        self.traffic.seconds += t0.elapsed().as_secs_f64();
        Ok(())
    }
}

/// A ring step without a context group to pass it.
fn no_context_group() -> EngineError {
    EngineError::TensorParallel("a context ring step on a rank without a context-parallel group".into())
}

/// A model's handle on its tensor-parallel group during one pass, handed
/// out with each segment ([`crate::SegmentView::tp`]); without a split
/// every operation is a no-op. It also reaches the context-parallel group
/// ([`crate::context`]), whose ranks exchange attention's keys and values.
pub struct TensorGroup<'a> {
    link: Option<&'a mut dyn Reduce>,
    context: Option<&'a mut dyn Reduce>,
}

impl<'a> TensorGroup<'a> {
    /// No split (a single rank holds every tensor).
    pub fn none() -> Self {
        TensorGroup { link: None, context: None }
    }

    /// The tensor-parallel group of `link` and the context-parallel group
    /// of `context` (each of more than one rank; otherwise none).
    pub(crate) fn new(link: Option<&'a mut TpLink<'_>>, context: Option<&'a mut TpLink<'_>>) -> Self {
        TensorGroup {
            link: link.filter(|l| l.comm.world_size() > 1).map(|l| l as &mut dyn Reduce),
            context: context.filter(|l| l.comm.world_size() > 1).map(|l| l as &mut dyn Reduce),
        }
    }

    /// This rank's place `(rank, size)` in its context-parallel group,
    /// where sequences are split (more than one rank).
    pub fn context(&self) -> Option<(usize, usize)> {
        self.context.as_deref().map(Reduce::place)
    }

    /// Context parallelism's all-gather: every rank's `local` (the same
    /// length on each) into `all`, in rank order. Unsplit: a copy.
    pub fn context_all_gather(&mut self, local: &[f32], all: &mut [f32]) -> Result<(), EngineError> {
        match self.context.as_deref_mut() {
            Some(l) => l.gather(local, all),
            None => {
                all.copy_from_slice(local);
                Ok(())
            }
        }
    }

    /// Context parallelism's reduce-scatter: `all` (one block per rank, in
    /// rank order) summed over the group, this rank's block into `local`
    /// (every sum in rank order on thread ranks). Unsplit: a copy.
    pub fn context_reduce_scatter(&mut self, all: &[f32], local: &mut [f32]) -> Result<(), EngineError> {
        match self.context.as_deref_mut() {
            Some(l) => l.scatter(all, local),
            None => {
                local.copy_from_slice(all);
                Ok(())
            }
        }
    }

    /// The context ring's send: `buf` to the next rank of the context
    /// group (buffered: returns at once), under `tag`.
    ///
    /// # Errors
    /// The send's failure, or no context group.
    pub fn context_send_next(&mut self, buf: &[f32], tag: u32) -> Result<(), EngineError> {
        match self.context.as_deref_mut() {
            Some(l) => l.send_next(buf, tag),
            None => Err(no_context_group()),
        }
    }

    /// The context ring's receive: the previous rank's next message under
    /// `tag` into `buf` (which has its length); with `flush` (the ring's
    /// last receive of a call), also waits until this rank's sends are
    /// delivered.
    ///
    /// # Errors
    /// The receive's failure, or no context group.
    pub fn context_recv_prev(&mut self, buf: &mut [f32], tag: u32, flush: bool) -> Result<(), EngineError> {
        match self.context.as_deref_mut() {
            Some(l) => l.recv_prev(buf, tag, flush),
            None => Err(no_context_group()),
        }
    }

    /// Whether tensors are split (more than one rank).
    pub fn is_split(&self) -> bool {
        self.link.is_some()
    }

    /// Sums `buf` over the group, in place; every rank gets the same bits.
    pub fn all_reduce(&mut self, buf: &mut [f32]) -> Result<(), EngineError> {
        match self.link.as_deref_mut() {
            Some(l) => l.sum(buf),
            None => Ok(()),
        }
    }

    /// The group's link, the values of one block of `n` rows of `width`
    /// and the group's size (`None` unsplit), checking that this rank
    /// holds `local` values: its rows.
    fn row_link(&mut self, n: usize, width: usize, local: usize) -> Option<(&mut (dyn Reduce + 'a), usize, usize)> {
        let l = self.link.as_deref_mut()?;
        let (rank, size) = l.place();
        assert_eq!(local, rows_of(rank, size, n).len() * width, "a rank's rows of the residual stream");
        Some((l, seq_block(n, size) * width, size))
    }

    /// Sequence parallelism's all-gather: each rank's rows of `n` rows of
    /// `width` ([`TpRank::seq_rows`], in `local`) into all `n` rows of
    /// `full` (its first `n · width` values). Where the group does not
    /// divide `n` the blocks travel padded to [`seq_block`] rows. Unsplit:
    /// a copy.
    pub fn all_gather_rows(
        &mut self,
        local: &[f32],
        full: &mut [f32],
        n: usize,
        width: usize,
    ) -> Result<(), EngineError> {
        let full = &mut full[..n * width];
        let Some((l, block, size)) = self.row_link(n, width, local.len()) else {
            full.copy_from_slice(local);
            return Ok(());
        };
        if block * size == n * width {
            return l.gather(local, full);
        }
        let mut mine = vec![0.0; block];
        mine[..local.len()].copy_from_slice(local);
        let mut all = vec![0.0; block * size];
        l.gather(&mine, &mut all)?;
        full.copy_from_slice(&all[..n * width]);
        Ok(())
    }

    /// Sequence parallelism's reduce-scatter: `full` (`n` rows of `width`,
    /// a part of each value on each rank) summed over the group, each rank
    /// receiving its rows ([`TpRank::seq_rows`]) into `local` — the
    /// all-reduce's sums, in the same rank order. Unsplit: a copy.
    pub fn reduce_scatter_rows(
        &mut self,
        full: &[f32],
        local: &mut [f32],
        n: usize,
        width: usize,
    ) -> Result<(), EngineError> {
        let full = &full[..n * width];
        let Some((l, block, size)) = self.row_link(n, width, local.len()) else {
            local.copy_from_slice(full);
            return Ok(());
        };
        if block * size == n * width {
            return l.scatter(full, local);
        }
        let mut all = vec![0.0; block * size];
        all[..n * width].copy_from_slice(full);
        let mut mine = vec![0.0; block];
        l.scatter(&all, &mut mine)?;
        local.copy_from_slice(&mine[..local.len()]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layouts(t: TpRank) -> (ParamLayout, ParamLayout, Vec<Shard>) {
        let (mut full, mut local) = (ParamLayout::new(), ParamLayout::new());
        full.push("norm", &[3], false);
        local.push("norm", &[3], false);
        // Column-parallel [out 4, in 3]; row-parallel [out 3, in 4]; heads {2, 2, 2}.
        full.push("up", &[4, 3], true);
        local.push("up", &[t.local(4), 3], true);
        full.push("down", &[3, 4], true);
        local.push("down", &[3, t.local(4)], true);
        full.push("qkv", &[2, 2, 2], true);
        local.push("qkv", &[2, t.local(2), 2], true);
        let shards = vec![
            Shard::Replicated,
            Shard::Split { outer: 1, dim: 4, inner: 3, parts: 2 },
            Shard::Split { outer: 3, dim: 4, inner: 1, parts: 2 },
            Shard::Split { outer: 2, dim: 2, inner: 2, parts: 2 },
        ];
        (full, local, shards)
    }

    #[test]
    fn take_then_gather_is_the_identity_and_slices_the_named_axis() {
        let whole: Vec<f32> = (0..35).map(|i| i as f32).collect();
        let mut parts = Vec::new();
        for rank in 0..2 {
            let tp = TpRank::new(rank, 2);
            let (full, local, shards) = layouts(tp);
            let s = TensorShards::new(tp, full, local, shards).unwrap();
            parts.push((s.clone(), s.take(&whole, false).unwrap()));
        }
        // Rank 1: norm whole, up rows 2..4, down columns 2..4 of each row, qkv heads 1.
        let r1 = &parts[1].1;
        assert_eq!(&r1[..3], &[0.0, 1.0, 2.0]);
        assert_eq!(&r1[3..9], &[9.0, 10.0, 11.0, 12.0, 13.0, 14.0]);
        assert_eq!(&r1[9..15], &[17.0, 18.0, 21.0, 22.0, 25.0, 26.0]);
        assert_eq!(&r1[15..19], &[29.0, 30.0, 33.0, 34.0]);
        let comms = comm::threads::group(2, std::time::Duration::from_secs(30));
        let mut g: Vec<Option<Vec<f32>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    let (s, local) = &parts[c.rank()];
                    sc.spawn(move || s.gather(&mut c, local, false).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(g.remove(0), Some(whole));
        assert_eq!(g[0], None);
    }

    #[test]
    fn fewer_pieces_than_ranks_are_held_by_consecutive_ranks() {
        let s = Shard::Split { outer: 1, dim: 2, inner: 3, parts: 2 };
        let whole: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let held: Vec<Vec<f32>> = (0..4)
            .map(|rank| {
                let mut out = Vec::new();
                TensorShards::take_tensor(s, TpRank::new(rank, 4), &whole, &mut out);
                out
            })
            .collect();
        assert_eq!(held, [vec![0.0, 1.0, 2.0], vec![0.0, 1.0, 2.0], vec![3.0, 4.0, 5.0], vec![3.0, 4.0, 5.0]]);
        let counted: Vec<bool> = (0..4).map(|rank| s.counted_by(TpRank::new(rank, 4))).collect();
        assert_eq!(counted, [true, false, true, false]);
        assert!(s.partial_gradient(TpRank::new(0, 4)));
        assert!(!Shard::Replicated.counted_by(TpRank::new(1, 2)));
    }

    /// Sequence parallelism's collectives at a row count the group does
    /// not divide (7 rows over 3 ranks: blocks of 3, 3 and 1) and one it
    /// does: the gather rebuilds every row on every rank, the
    /// reduce-scatter hands each rank its rows' sums — the all-reduce's.
    #[test]
    fn row_collectives_split_uneven_rows_in_blocks() {
        for (n, size) in [(7, 3), (8, 4), (0, 2)] {
            let w = 2;
            let rows: Vec<_> = (0..size).map(|r| TpRank::new(r, size).with_seq(true).seq_rows(n)).collect();
            assert_eq!(rows.iter().map(|r| r.len()).sum::<usize>(), n);
            let comms = comm::threads::group(size, std::time::Duration::from_secs(30));
            let out: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = std::thread::scope(|sc| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|mut c| {
                        let mine = rows[c.rank()].clone();
                        sc.spawn(move || {
                            let r = c.rank();
                            let (mut traffic, step) = (TpTraffic::default(), 0);
                            let mut link = TpLink { comm: &mut c, traffic: &mut traffic, step };
                            let mut g = TensorGroup::new(Some(&mut link), None);
                            let local: Vec<f32> = (mine.start * w..mine.end * w).map(|i| i as f32).collect();
                            let mut full = vec![-1.0; n * w + 3];
                            g.all_gather_rows(&local, &mut full, n, w).unwrap();
                            let part: Vec<f32> = (0..n * w).map(|i| (i * (r + 1)) as f32).collect();
                            let mut scattered = vec![0.0; mine.len() * w];
                            g.reduce_scatter_rows(&part, &mut scattered, n, w).unwrap();
                            let mut summed = part.clone();
                            g.all_reduce(&mut summed).unwrap();
                            (full, scattered, summed[mine.start * w..mine.end * w].to_vec())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (full, scattered, summed) in out {
                let want: Vec<f32> = (0..n * w).map(|i| i as f32).collect();
                assert_eq!(&full[..n * w], &want[..], "n {n} over {size}");
                assert_eq!(&full[n * w..], &[-1.0; 3], "past n rows untouched");
                assert_eq!(scattered, summed, "n {n} over {size}");
            }
        }
        assert_eq!(TpRank::new(2, 3).with_seq(true).seq_rows(7), 6..7);
        assert_eq!(TpRank::new(1, 3).seq_rows(7), 0..7, "without sequence parallelism every row");
    }

    #[test]
    fn shapes_that_do_not_fit_their_shard_are_named() {
        let tp = TpRank::new(0, 2);
        let (full, mut local, mut shards) = layouts(tp);
        shards[1] = Shard::Split { outer: 1, dim: 3, inner: 4, parts: 2 };
        let e = TensorShards::new(tp, full.clone(), local.clone(), shards).unwrap_err().to_string();
        assert!(e.contains("up") && e.contains("T = 2"), "{e}");
        local.push("extra", &[1], false);
        assert!(TensorShards::new(tp, full, local, layouts(tp).2).is_err());
    }
}
