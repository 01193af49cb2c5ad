//! The walk over a stack of blocks, written once for every family: one
//! parameter segment per block, the saved activations of each block
//! (16-bit under mixed precision), activation checkpointing (a recomputed
//! block keeps its output only and is run again, in a slot of its own,
//! just before its backward), the f16 rounding of activation gradients
//! between blocks, selective recomputation (a block drops the tensors of
//! the kinds the mode names and recomputes each, once, when its backward
//! first reads it), and the sizes of all of it ([`StackSizes`]: the one
//! definition that allocates the buffers and reports their bytes).
//!
//! A family supplies the block itself ([`Block`]) and lays out its saved
//! tensors and working buffers by index. Working buffer 0 is the residual
//! stream's gradient: on entry to a block's backward it holds the gradient
//! of the block's output, on exit that of its input.

use std::ops::Range;

use engine::{
    Checkpointing, EngineError, Inner, ParamStore, Precision, SavedTensor, SegmentGrads, SegmentView, TensorGroup,
};

/// Index of the residual-gradient working buffer.
pub const DRES: usize = 0;

/// The kinds of a pre-norm transformer block's eight saved tensors in the
/// order both families keep them: the attention's norm output, q|k|v, the
/// attention's output, the residual after attention, the MLP's norm
/// output, the MLP's input projection, its activation, the block's output.
pub const PRE_NORM_KINDS: [Inner; 8] = [
    Inner::Elementwise,
    Inner::Kept,
    Inner::AttnCore,
    Inner::Kept,
    Inner::Elementwise,
    Inner::Kept,
    Inner::Elementwise,
    Inner::Kept,
];

/// One block of a family, as the walk runs it.
pub trait Block {
    /// Forward of one block: on entry `x` holds its input, on exit its
    /// output; every tensor the backward needs is kept in `sv`. `bufs` are
    /// the working buffers, `extra` the family's additional forward
    /// buffers ([`StackSizes::extra`]). `p` and `tp`: the block's segment
    /// (under tensor parallelism this rank's slices, and the group to
    /// sum row-parallel outputs over).
    fn forward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        x: &mut [f32],
        sv: &mut Saved,
        bufs: &mut [Vec<f32>],
        extra: &mut [Vec<f32>],
    ) -> Result<(), EngineError>;

    /// Backward of one block: `bufs[DRES]` holds the gradient of its output
    /// on entry and of its input on exit (summed over `tp` where it is
    /// split); parameter gradients go where the store says (`grads`).
    fn backward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        grads: &mut SegmentGrads<'_>,
        saved: SavedView<'_>,
        bufs: &mut [Vec<f32>],
    ) -> Result<(), EngineError>;

    /// Recomputes saved tensor `k`, one that a selective mode dropped (its
    /// kind in [`StackSizes::kinds`] is not [`Inner::Kept`]), into `out`
    /// (its length), from what the forward kept (read through `saved`),
    /// with the forward's kernels on the same inputs — so the values are
    /// the forward's bit for bit (the walk rounds them to the storage
    /// precision after). `scratch` ([`StackSizes::redo_scratch`] values)
    /// takes by-products the forward also kept (a norm's statistics, the
    /// attention's log-sum-exps).
    fn redo(&self, p: &[f32], k: usize, saved: &mut SavedView<'_>, out: &mut [f32], scratch: &mut [f32]);

    /// Called before each [`Block::forward`] and [`Block::backward`] with
    /// the segment the block runs in (a family whose blocks hold state
    /// outside the segment, such as packed frozen weights, selects it here).
    fn enter(&self, _seg: usize) {}
}

/// What one block's forward keeps for its backward.
#[derive(Debug, Default)]
pub struct Saved {
    /// Tensors in the storage precision, by the family's indices.
    pub large: Vec<SavedTensor>,
    /// Per-row statistics (norms), always f32.
    pub stats: Vec<Vec<f32>>,
}

impl Saved {
    fn new(s: &StackSizes) -> Self {
        Saved {
            large: (0..s.large.len()).map(|k| s.saved_tensor(k)).collect(),
            stats: s.stats.iter().map(|&n| zeros(n)).collect(),
        }
    }

    /// What a recomputed block keeps: its output alone (the next block's input).
    fn output_only(s: &StackSizes) -> Self {
        let mut large: Vec<SavedTensor> = s.large.iter().map(|_| SavedTensor::default()).collect();
        large[s.output] = SavedTensor::new(s.precision, len(s.large[s.output]));
        Saved { large, stats: s.stats.iter().map(|_| Vec::new()).collect() }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.large.iter().map(SavedTensor::bytes).sum::<usize>() + 4 * self.stats.iter().map(Vec::len).sum::<usize>()
    }
}

/// Saved tensor `k` as f32: in place, decoded into `tmp`, or recomputed
/// already (in `redone`).
fn view<'s>(sv: &'s Saved, k: usize, prec: Precision, redone: &'s [Vec<f32>], tmp: &'s mut [f32]) -> &'s [f32] {
    match &sv.large[k] {
        SavedTensor::Dropped => &redone[k],
        t => t.read(prec, tmp),
    }
}

/// A block's [`Block::redo`] on its parameters: (tensor, view, out, scratch).
type RedoFn<'a> = dyn Fn(usize, &mut SavedView<'_>, &mut [f32], &mut [f32]) + 'a;

/// How a block's dropped tensors are recomputed: the block's
/// [`Block::redo`] on its parameters, a buffer per dropped tensor (filled
/// at its first read, then read again as is) and the scratch.
pub struct Redo<'a> {
    run: &'a RedoFn<'a>,
    bufs: &'a mut [Vec<f32>],
    done: &'a mut [bool],
    scratch: &'a mut Vec<f32>,
}

/// Where a block's backward reads what its forward saved: each tensor as
/// f32, directly, decoded into a staging buffer just before use, or (a
/// dropped tensor) recomputed into a buffer of its own at its first read.
pub struct SavedView<'a> {
    /// The block's saved tensors.
    pub sv: &'a Saved,
    /// The block's input.
    x: &'a SavedTensor,
    staging: &'a mut [Vec<f32>],
    prec: Precision,
    redo: Redo<'a>,
}

impl SavedView<'_> {
    /// Recomputes dropped tensor `k` unless it already is.
    fn materialize(&mut self, k: usize) {
        let r = &mut self.redo;
        if r.done[k] {
            return;
        }
        let (run, mut out, mut scratch) = (r.run, std::mem::take(&mut r.bufs[k]), std::mem::take(r.scratch));
        run(k, self, &mut out, &mut scratch);
        self.prec.round(&mut out);
        let r = &mut self.redo;
        (r.bufs[k], *r.scratch, r.done[k]) = (out, scratch, true);
    }

    /// Saved tensor `k` as f32 (decoded into staging buffer 0, or recomputed).
    pub fn get(&mut self, k: usize) -> &[f32] {
        if self.sv.large[k].is_dropped() {
            self.materialize(k);
        }
        view(self.sv, k, self.prec, self.redo.bufs, &mut self.staging[0])
    }

    /// Saved tensors `a.0` and `b.0` together, decoded into staging buffers
    /// `a.1` and `b.1` (different).
    pub fn pair(&mut self, a: (usize, usize), b: (usize, usize)) -> (&[f32], &[f32]) {
        assert!(a.1 < b.1, "staging buffers must differ and come in order");
        for k in [a.0, b.0] {
            if self.sv.large[k].is_dropped() {
                self.materialize(k);
            }
        }
        let (lo, hi) = self.staging.split_at_mut(b.1);
        let redone = &*self.redo.bufs;
        let (sv, prec) = (self.sv, self.prec);
        (view(sv, a.0, prec, redone, &mut lo[a.1]), view(sv, b.0, prec, redone, &mut hi[0]))
    }

    /// The block's input (decoded into staging buffer 0).
    pub fn input(&mut self) -> &[f32] {
        self.x.read(self.prec, &mut self.staging[0])
    }

    /// The storage precision.
    pub fn precision(&self) -> Precision {
        self.prec
    }
}

/// Which part of a model's stack is sized: its blocks, the micro-batches
/// in flight (each with a [`Stack`] of its own), and whether it holds the
/// embedding (first pipeline stage) and the head (last). The whole model
/// is one part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Blocks of this part.
    pub n_blocks: usize,
    /// Micro-batches whose activations are alive at once.
    pub in_flight: usize,
    /// Holds the embedding.
    pub first: bool,
    /// Holds the final norm, the head and the loss.
    pub last: bool,
}

impl Part {
    /// The whole model: every block, one micro-batch.
    pub fn whole(n_blocks: usize) -> Self {
        Part { n_blocks, in_flight: 1, first: true, last: true }
    }

    /// A pipeline stage.
    pub fn of(spec: &engine::StageSpec) -> Self {
        Part { n_blocks: spec.blocks.len(), in_flight: spec.in_flight, first: spec.is_first(), last: spec.is_last() }
    }
}

/// Element counts of every buffer of a [`Stack`], from the shape of one
/// call (rows, sequence length), the storage precision and checkpointing:
/// what [`Stack::new`] allocates and what [`StackSizes::bytes`] reports.
/// Counts are `u128` so planning shapes far beyond this machine never
/// overflows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackSizes {
    /// Storage precision of saved tensors.
    pub precision: Precision,
    /// Which blocks are recomputed.
    pub checkpointing: Checkpointing,
    /// Blocks with a slot of saved tensors: every block for training, one
    /// for a forward-only pass.
    pub n_slots: usize,
    /// One block's saved tensors (storage precision), by the family's indices.
    pub large: Vec<u128>,
    /// The kind of each of `large` (which selective modes drop it).
    pub kinds: Vec<Inner>,
    /// Scratch (f32) of [`Block::redo`] under a selective mode.
    pub redo_scratch: u128,
    /// Index in `large` of the block's output.
    pub output: usize,
    /// One block's saved per-row statistics (f32).
    pub stats: Vec<u128>,
    /// The residual stream `[n, C]`: its buffer, and the embeddings' saved output.
    pub x: u128,
    /// Working buffers (f32), shared by the forward and the backward;
    /// buffer [`DRES`] is the residual gradient.
    pub bufs: Vec<u128>,
    /// Staging buffers (f32) for decoding 16-bit saved tensors (and the
    /// forward's extra buffers outside the recompute slot).
    pub staging: Vec<u128>,
    /// The forward's extra buffers (f32) inside the recompute slot.
    pub extra: Vec<u128>,
    /// Working buffers (f32) used only within one call of a block's
    /// projection (sequence parallelism's gathered rows): one set per
    /// model, shared by every micro-batch in flight and the recompute
    /// slot, handed to the block after `bufs` ([`Stack::forward`]'s
    /// `scratch`); not part of [`StackSizes::bytes`].
    pub scratch: Vec<u128>,
}

/// `n` as a length (a shape that does not fit `usize` cannot be allocated
/// anyway: the allocation fails as it would for `usize::MAX`).
fn len(n: u128) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// `n` zeros: a buffer of a size counted in `u128` (see [`StackSizes`]).
pub fn zeros(n: u128) -> Vec<f32> {
    vec![0.0; len(n)]
}

impl StackSizes {
    /// Whether saved tensor `k` is dropped (recomputed in backward).
    pub fn dropped(&self, k: usize) -> bool {
        self.kinds.get(k).is_some_and(|&kind| self.checkpointing.drops(kind))
    }

    /// Saved tensor `k`'s storage: dropped, or its size in the storage precision.
    fn saved_tensor(&self, k: usize) -> SavedTensor {
        match self.dropped(k) {
            true => SavedTensor::Dropped,
            false => SavedTensor::new(self.precision, len(self.large[k])),
        }
    }

    /// Elements of one block's tensors that are kept (`true`) or dropped.
    fn large_sum(&self, kept: bool) -> u128 {
        self.large.iter().enumerate().filter(|&(k, _)| self.dropped(k) != kept).map(|(_, &n)| n).sum()
    }

    fn n_recomputed(&self) -> u128 {
        (0..self.n_slots).filter(|&i| self.checkpointing.recomputes(i)).count() as u128
    }

    fn block_bytes(&self) -> u128 {
        self.precision.bytes() as u128 * self.large_sum(true) + 4 * self.stats.iter().sum::<u128>()
    }

    /// Bytes of the saved activations: every slot (a recomputed block's
    /// output only), the recompute slot's tensors and the embeddings' output.
    pub fn saved_bytes(&self) -> u128 {
        let elem = self.precision.bytes() as u128;
        let n_rc = self.n_recomputed();
        let slots = (self.n_slots as u128 - n_rc) * self.block_bytes() + n_rc * elem * self.large[self.output];
        let slot = if self.checkpointing.is_on() { self.block_bytes() } else { 0 };
        slots + slot + elem * self.x
    }

    /// Bytes of the shared [`StackSizes::scratch`] (once per model).
    pub fn scratch_bytes(&self) -> u128 {
        4 * self.scratch.iter().sum::<u128>()
    }

    /// Bytes of everything [`Stack::new`] allocates.
    pub fn bytes(&self) -> u128 {
        let sum = |v: &[u128]| v.iter().sum::<u128>();
        let slot = if self.checkpointing.is_on() { sum(&self.bufs) + sum(&self.extra) + self.x } else { 0 };
        let redo = if self.checkpointing.is_selective() { self.large_sum(false) + self.redo_scratch } else { 0 };
        self.saved_bytes() + 4 * (self.x + sum(&self.staging) + sum(&self.bufs) + slot + redo)
    }
}

/// One block's activations, recomputed just before its backward, with
/// working buffers of its own (the backward's are busy then).
#[derive(Debug)]
struct Recompute {
    sv: Saved,
    bufs: Vec<Vec<f32>>,
    extra: Vec<Vec<f32>>,
    /// The block's input (then its output).
    x: Vec<f32>,
}

/// The activations of a stack of blocks for one (B, T).
#[derive(Debug, Default)]
pub struct Stack {
    precision: Precision,
    checkpointing: Checkpointing,
    /// Index of a block's output among its saved tensors.
    output: usize,
    /// One slot per block for training; forward-only passes use slot 0.
    saved: Vec<Saved>,
    /// The embeddings' output (block 0's input).
    embed: SavedTensor,
    /// The residual stream entering the current block; after the forward,
    /// the last block's output.
    pub x: Vec<f32>,
    staging: Vec<Vec<f32>>,
    /// The working buffers (buffer [`DRES`]: the residual gradient).
    pub bufs: Vec<Vec<f32>>,
    recompute: Option<Recompute>,
    /// Selective modes: one f32 buffer per saved tensor (empty unless
    /// dropped) holding its recomputed values, their marks, the scratch.
    redone: Vec<Vec<f32>>,
    redone_marks: Vec<bool>,
    redo_scratch: Vec<f32>,
}

impl Stack {
    /// Allocates every buffer `s` describes.
    pub fn new(s: &StackSizes) -> Self {
        let f32s = |v: &[u128]| v.iter().map(|&n| zeros(n)).collect::<Vec<_>>();
        let ck = s.checkpointing;
        Stack {
            precision: s.precision,
            checkpointing: ck,
            output: s.output,
            saved: (0..s.n_slots)
                .map(|i| if ck.recomputes(i) { Saved::output_only(s) } else { Saved::new(s) })
                .collect(),
            embed: SavedTensor::new(s.precision, len(s.x)),
            x: zeros(s.x),
            staging: f32s(&s.staging),
            bufs: f32s(&s.bufs),
            recompute: ck.is_on().then(|| Recompute {
                sv: Saved::new(s),
                bufs: f32s(&s.bufs),
                extra: f32s(&s.extra),
                x: zeros(s.x),
            }),
            redone: (0..s.large.len()).map(|k| if s.dropped(k) { zeros(s.large[k]) } else { Vec::new() }).collect(),
            redone_marks: vec![false; s.large.len()],
            redo_scratch: if ck.is_selective() { zeros(s.redo_scratch) } else { Vec::new() },
        }
    }

    /// Blocks with a slot of their own.
    pub fn n_slots(&self) -> usize {
        self.saved.len()
    }

    /// Bytes of the saved activations (every slot, the recompute slot's
    /// tensors and the embeddings' output).
    pub fn saved_bytes(&self) -> usize {
        self.saved.iter().map(Saved::bytes).sum::<usize>()
            + self.embed.bytes()
            + self.recompute.as_ref().map_or(0, |r| r.sv.bytes())
    }

    /// Bytes held (activations and working buffers).
    pub fn bytes(&self) -> usize {
        let sum = |v: &[Vec<f32>]| v.iter().map(Vec::len).sum::<usize>();
        let slot = self.recompute.as_ref().map_or(0, |r| sum(&r.bufs) + sum(&r.extra) + r.x.len());
        let redo = sum(&self.redone) + self.redo_scratch.len();
        self.saved_bytes() + 4 * (self.x.len() + sum(&self.staging) + sum(&self.bufs) + slot + redo)
    }

    /// Keeps the stack's input, now in [`Stack::x`] — the embeddings'
    /// output, or the previous pipeline stage's (already rounded there) —
    /// as block 0's input (rounded to the storage precision in place).
    pub fn keep_input(&mut self) {
        self.embed.keep_copy(&mut self.x, self.precision);
    }

    /// Forward through one block per segment of `segs` (block `i` in
    /// segment `segs.start + i`) on [`Stack::x`]. `keep_all`: a training
    /// pass, each block keeping its tensors in its own slot (a recomputed
    /// block its output only, its tensors going to the recompute slot);
    /// otherwise a forward-only pass, in which one slot serves every block.
    /// `scratch`: the model's [`StackSizes::scratch`] buffers, handed to
    /// the block after the working buffers.
    pub fn forward(
        &mut self,
        block: &impl Block,
        store: &mut dyn ParamStore,
        (segs, scratch): (Range<usize>, &mut Vec<Vec<f32>>),
        keep_all: bool,
    ) -> Result<(), EngineError> {
        for (idx, seg) in segs.enumerate() {
            let SegmentView { params, mut tp, .. } = store.segment(seg)?;
            block.enter(seg);
            let recomputed = !keep_all || self.checkpointing.recomputes(idx);
            let (x, staging) = (&mut self.x, &mut self.staging);
            match self.recompute.as_mut().filter(|_| recomputed) {
                Some(rc) => {
                    let sv = &mut rc.sv;
                    with_scratch(&mut self.bufs, scratch, |b| block.forward(params, &mut tp, x, sv, b, staging))?;
                    if keep_all {
                        std::mem::swap(&mut rc.sv.large[self.output], &mut self.saved[idx].large[self.output]);
                    }
                }
                None => {
                    let sv = &mut self.saved[if keep_all { idx } else { 0 }];
                    with_scratch(&mut self.bufs, scratch, |b| block.forward(params, &mut tp, x, sv, b, staging))?;
                }
            }
            store.done(seg, false)?;
        }
        Ok(())
    }

    /// Backward through the blocks of a training [`Stack::forward`] over
    /// `segs`, last block first: `bufs[DRES]` holds the gradient of the last
    /// block's output on entry and of block 0's input on exit. A recomputed
    /// block runs its forward again first, on its saved input, with the
    /// same kernels (so its gradients are bit-identical). Under f16 the
    /// activation gradient is rounded to f16 between blocks.
    pub fn backward(
        &mut self,
        block: &impl Block,
        store: &mut dyn ParamStore,
        (segs, scratch): (Range<usize>, &mut Vec<Vec<f32>>),
    ) -> Result<(), EngineError> {
        let prec = self.precision;
        for (idx, seg) in segs.enumerate().rev() {
            if prec == Precision::F16 {
                prec.round(&mut self.bufs[DRES]);
            }
            let SegmentView { params, mut grads, mut tp } = store.segment(seg)?;
            block.enter(seg);
            let x = if idx == 0 { &self.embed } else { &self.saved[idx - 1].large[self.output] };
            let sv = match self.recompute.as_mut().filter(|_| self.checkpointing.recomputes(idx)) {
                Some(rc) => {
                    match x {
                        SavedTensor::F32(v) => rc.x.copy_from_slice(v),
                        SavedTensor::Low(v) => prec.decode(v, &mut rc.x),
                        SavedTensor::Dropped => unreachable!("a block's input is always kept"),
                    }
                    let (x, sv, extra) = (&mut rc.x, &mut rc.sv, &mut rc.extra);
                    with_scratch(&mut rc.bufs, scratch, |b| block.forward(params, &mut tp, x, sv, b, extra))?;
                    &rc.sv
                }
                None => &self.saved[idx],
            };
            self.redone_marks.fill(false);
            let run = |k: usize, v: &mut SavedView<'_>, out: &mut [f32], scratch: &mut [f32]| {
                block.redo(params, k, v, out, scratch)
            };
            let redo = Redo {
                run: &run,
                bufs: &mut self.redone,
                done: &mut self.redone_marks,
                scratch: &mut self.redo_scratch,
            };
            let saved = SavedView { sv, x, staging: &mut self.staging, prec, redo };
            with_scratch(&mut self.bufs, scratch, |b| block.backward(params, &mut tp, &mut grads, saved, b))?;
            store.done(seg, true)?;
        }
        if prec == Precision::F16 {
            prec.round(&mut self.bufs[DRES]);
        }
        Ok(())
    }
}

/// Runs `f` on `bufs` with `scratch` appended (moved, not copied), then
/// moves the scratch buffers back.
fn with_scratch<R>(bufs: &mut Vec<Vec<f32>>, scratch: &mut Vec<Vec<f32>>, f: impl FnOnce(&mut [Vec<f32>]) -> R) -> R {
    let own = bufs.len();
    bufs.append(scratch);
    let r = f(bufs);
    scratch.extend(bufs.drain(own..));
    r
}

/// The activations of each micro-batch in flight on a pipeline stage: one
/// `A` per slot, the current one checked out into the model's own field
/// (so a family's code reads one set of activations whichever slot is
/// current). Buffers used only within one forward (logits, losses) travel
/// with the current slot, so one of each exists.
#[derive(Debug, Default)]
pub struct Slots<A> {
    parked: Vec<A>,
    cur: usize,
}

impl<A: Default> Slots<A> {
    /// Makes slot `f` (of `n`) current in `acts`; `carry(from, to)` moves
    /// the shared buffers from the slot left to the slot entered.
    pub fn enter(&mut self, acts: &mut A, f: usize, n: usize, carry: fn(&mut A, &mut A)) {
        if self.parked.len() != n {
            self.parked.resize_with(n, A::default);
            self.cur = self.cur.min(n - 1);
        }
        if f == self.cur {
            return;
        }
        let mut left = std::mem::take(acts);
        *acts = std::mem::take(&mut self.parked[f]);
        carry(&mut left, acts);
        self.parked[self.cur] = left;
        self.cur = f;
    }

    /// The slots not current.
    pub fn parked(&self) -> impl Iterator<Item = &A> {
        self.parked.iter()
    }
}
