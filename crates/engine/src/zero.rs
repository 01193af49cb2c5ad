//! ZeRO: which model states are sharded ([`ZeroStage`]) and how the flat
//! buffers are cut ([`Partition`]).
//!
//! Each segment `j` (length `n_j`) is cut into `W` pieces of `s_j = ⌈n_j/W⌉`
//! parameters; rank `r` owns piece `r` of every segment (the last pieces may
//! be short or empty — padding). A rank's parameter *shard* is its pieces
//! back to back, each padded to `s_j`. Its gradient and optimizer-state shard
//! holds the *trainable* elements of the same pieces, each padded to the
//! longest such run of the segment, `t_j` (= `s_j` when nothing is frozen):
//! the owner of a parameter is the owner of its gradient and of its
//! optimizer state, and frozen parameters cost neither. Cutting per segment
//! (DeepSpeed cuts per tensor) lets ZeRO-3 gather one segment with one
//! all-gather, and reduce-scatter one segment's gradient with one call.
//!
//! Invariant: for every segment, the `W` pieces tile `[start, start + W·s_j)`,
//! which covers the segment; so every element has exactly one owner.

use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::precision::Precision;
use crate::store::GradSpace;
use std::ops::Range;

/// How the optimizer state, gradients and parameters are partitioned (the
/// configuration as given; [`ZeroStage`] is the checked form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ZeroConfig {
    /// 0: replicated; 1: optimizer state; 2: + gradients; 3: + parameters.
    pub stage: u8,
    /// Stage 2 only: reduce-scatter each segment's gradient after every
    /// micro-step (DeepSpeed's way: gradient memory N/W, K× the bytes)
    /// instead of accumulating locally and reducing once at the boundary.
    pub reduce_every_micro_step: bool,
}

/// A ZeRO stage: what each rank keeps of the model states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Stage 0 (DDP): everything replicated; gradients all-reduced.
    Replicated,
    /// Stage 1: optimizer state sharded; gradients all-reduced, each rank
    /// updates its shard, parameters all-gathered.
    ShardedOptimizer,
    /// Stage 2: + gradients sharded by reduce-scatter — at the boundary from
    /// a local accumulator, or (`per_micro_step`) after every micro-step
    /// into a shard accumulator.
    ShardedGradients {
        /// Reduce-scatter each segment after each micro-step.
        per_micro_step: bool,
    },
    /// Stage 3: + parameters sharded; each segment gathered just before
    /// use, its gradient reduce-scattered right after its backward.
    ShardedParameters,
}

/// Where the accumulated gradient lives during a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accumulation {
    /// A full local buffer, reduced once at the boundary.
    Local,
    /// A shard accumulator fed by one reduce-scatter per segment backward.
    PerSegment,
}

/// The collective that reduces the accumulated gradient at the boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// All-reduce in buckets: every rank holds the whole sum.
    AllReduce,
    /// Reduce-scatter per segment: each rank holds its pieces of the sum.
    ReduceScatter,
    /// Reduced already, during the micro-steps.
    Done,
}

/// The one rule of what ZeRO composes with: stages 0 and 1 with a pipeline
/// of `pipeline` stages and a tensor split `tensor` ways (as in DeepSpeed);
/// stages 2 and 3 with neither, since they cut a whole model's gradient
/// (and parameters) into data-parallel shards, which a pipeline stage or a
/// tensor-parallel rank does not hold. `None` when `stage` composes; else
/// the refusal, naming the keys to change. The config check, the planner
/// and the trainer all ask this.
pub fn composition_error(stage: u8, pipeline: usize, tensor: usize) -> Option<String> {
    if stage < 2 {
        return None;
    }
    let (what, key, n) = match (pipeline > 1, tensor > 1) {
        (true, _) => ("pipeline", "pipeline_parallel", pipeline),
        (false, true) => ("tensor", "tensor_parallel", tensor),
        (false, false) => return None,
    };
    Some(format!(
        "ZeRO stage {stage} does not compose with {what} parallelism (dist.{key} = {n}); stages 0 and 1 do, as in DeepSpeed: set dist.zero_stage = 1 or dist.{key} = 1"
    ))
}

impl ZeroStage {
    /// The checked form of `cfg`.
    pub fn new(cfg: ZeroConfig) -> Result<Self, EngineError> {
        if cfg.reduce_every_micro_step && cfg.stage != 2 {
            return Err(EngineError::Zero("dist.reduce_every_micro_step applies to stage 2 only".into()));
        }
        Ok(match cfg.stage {
            0 => ZeroStage::Replicated,
            1 => ZeroStage::ShardedOptimizer,
            2 => ZeroStage::ShardedGradients { per_micro_step: cfg.reduce_every_micro_step },
            3 => ZeroStage::ShardedParameters,
            s => return Err(EngineError::Zero(format!("dist.zero_stage = {s} (use 0, 1, 2 or 3)"))),
        })
    }

    /// The stage number.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Replicated => 0,
            ZeroStage::ShardedOptimizer => 1,
            ZeroStage::ShardedGradients { .. } => 2,
            ZeroStage::ShardedParameters => 3,
        }
    }

    /// Back to the configuration form.
    pub fn config(self) -> ZeroConfig {
        ZeroConfig {
            stage: self.number(),
            reduce_every_micro_step: self == ZeroStage::ShardedGradients { per_micro_step: true },
        }
    }

    /// Whether the optimizer state (and the update) is cut into shards.
    pub fn shards_optimizer(self) -> bool {
        self != ZeroStage::Replicated
    }

    /// Where gradients accumulate.
    pub fn accumulation(self) -> Accumulation {
        match self {
            ZeroStage::ShardedParameters | ZeroStage::ShardedGradients { per_micro_step: true } => {
                Accumulation::PerSegment
            }
            _ => Accumulation::Local,
        }
    }

    /// The boundary's gradient collective.
    pub fn reduction(self) -> Reduction {
        match (self, self.accumulation()) {
            (_, Accumulation::PerSegment) => Reduction::Done,
            (ZeroStage::ShardedGradients { .. }, _) => Reduction::ReduceScatter,
            _ => Reduction::AllReduce,
        }
    }

    /// Whether each rank holds only its shard of the parameters.
    pub fn shards_parameters(self) -> bool {
        self == ZeroStage::ShardedParameters
    }

    /// Whether updated pieces are all-gathered into every rank's replicated
    /// parameters after the update (stages 1–2).
    pub fn gathers_after_update(self) -> bool {
        matches!(self, ZeroStage::ShardedOptimizer | ZeroStage::ShardedGradients { .. })
    }

    /// `(rank, world_size)` of the partition on rank `rank` of `world_size`:
    /// the communicator's ranks when anything is sharded, else one piece
    /// holding everything (every rank keeps all of it).
    pub fn partition_of(self, rank: usize, world_size: usize) -> (usize, usize) {
        if self.shards_optimizer() {
            (rank, world_size)
        } else {
            (0, 1)
        }
    }

    /// Whether each rank holds only its shard of the f32 parameters (the
    /// master weights): stage 3, and stages 1–2 when a 16-bit copy is what
    /// the model reads (the replicated copy is then that copy).
    pub fn shards_master(self, precision: Precision) -> bool {
        self.shards_parameters() || (precision.is_low() && self.shards_optimizer())
    }

    /// Whether the model reads a replicated 16-bit copy of the parameters:
    /// mixed precision at stages 0–2 (stage 3 rounds each gathered segment
    /// instead).
    pub fn keeps_model_copy(self, precision: Precision) -> bool {
        precision.is_low() && !self.shards_parameters()
    }

    /// Which buffers this rank's optimizer update indexes by shard.
    pub fn update_sharding(self, precision: Precision) -> UpdateSharding {
        UpdateSharding {
            params: self.shards_master(precision),
            grads: self.accumulation() == Accumulation::PerSegment,
            state: self.shards_optimizer(),
        }
    }
}

/// The partition of a model's segments over `world_size` ranks, seen from `rank`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The segments and their gradient space.
    pub space: GradSpace,
    /// Piece length `s_j` of each segment (parameters).
    pub piece: Vec<usize>,
    /// Offset of each segment's piece inside the parameter shard.
    pub offset: Vec<usize>,
    /// Gradient piece length `t_j` of each segment (trainable elements of
    /// the longest piece).
    pub grad_piece: Vec<usize>,
    /// Offset of each segment's gradient piece inside the gradient shard.
    pub grad_offset: Vec<usize>,
    /// This rank.
    pub rank: usize,
    /// Ranks.
    pub world_size: usize,
}

fn offsets(lens: &[usize]) -> Vec<usize> {
    lens.iter().scan(0, |acc, &p| Some(std::mem::replace(acc, *acc + p))).collect()
}

impl Partition {
    /// Partitions `space`'s segments over `world_size` ranks.
    pub fn new(space: GradSpace, rank: usize, world_size: usize) -> Self {
        Self::aligned(space, rank, world_size, 1)
    }

    /// [`Partition::new`] with every piece a multiple of `align` elements,
    /// so the cuts fall on multiples of `align` from each segment's start
    /// (what a blockwise optimizer's blocks need to stay on one rank).
    pub fn aligned(space: GradSpace, rank: usize, world_size: usize, align: usize) -> Self {
        let align = align.max(1);
        let piece: Vec<usize> =
            space.segments.iter().map(|r| r.len().div_ceil(world_size).div_ceil(align) * align).collect();
        let mut p = Self {
            offset: offsets(&piece),
            piece,
            grad_piece: Vec::new(),
            grad_offset: Vec::new(),
            space,
            rank,
            world_size,
        };
        p.grad_piece =
            (0..p.n_segments()).map(|j| (0..world_size).map(|r| p.grad_owned(j, r).len()).max().unwrap_or(0)).collect();
        p.grad_offset = offsets(&p.grad_piece);
        p
    }

    /// Number of segments.
    pub fn n_segments(&self) -> usize {
        self.space.segments.len()
    }

    /// Parameter range of segment `seg`.
    pub fn segment(&self, seg: usize) -> Range<usize> {
        self.space.segments[seg].clone()
    }

    /// Elements of this rank's parameter shard (padding included).
    pub fn shard_len(&self) -> usize {
        self.piece.iter().sum()
    }

    /// Elements of this rank's gradient (and optimizer-state) shard.
    pub fn grad_shard_len(&self) -> usize {
        self.grad_piece.iter().sum()
    }

    /// The parameter range rank `rank` owns of segment `seg` (may be short or empty).
    pub fn owned(&self, seg: usize, rank: usize) -> Range<usize> {
        let r = &self.space.segments[seg];
        let start = (r.start + rank * self.piece[seg]).min(r.end);
        let end = (r.start + (rank + 1) * self.piece[seg]).min(r.end);
        start..end
    }

    /// The gradient range rank `rank` owns of segment `seg`: the trainable
    /// elements of its parameter piece.
    pub fn grad_owned(&self, seg: usize, rank: usize) -> Range<usize> {
        self.space.grad_range(seg, self.owned(seg, rank))
    }

    /// The parameter-shard range holding this rank's piece of segment `seg`.
    pub fn shard_range(&self, seg: usize) -> Range<usize> {
        self.offset[seg]..self.offset[seg] + self.piece[seg]
    }

    /// The gradient-shard range holding this rank's piece of segment `seg`.
    pub fn grad_shard_range(&self, seg: usize) -> Range<usize> {
        self.grad_offset[seg]..self.grad_offset[seg] + self.grad_piece[seg]
    }

    /// Packs segment `seg`'s gradients into a reduce-scatter's input, in
    /// place: `buf` holds them at its front and has room for `W·t_j`; after,
    /// block `r` (`t_j` long) is rank `r`'s gradient piece, zero-padded.
    /// Block `r` moves
    /// forward (never onto a lower block's source), so blocks are moved
    /// from the last to the first; with nothing frozen every block is
    /// already in place and only the padding is written.
    pub fn pack_grads_in_place(&self, seg: usize, buf: &mut [f32]) {
        let (t, g0) = (self.grad_piece[seg], self.space.grad_segments[seg].start);
        for r in (0..self.world_size).rev() {
            let own = self.grad_owned(seg, r);
            if own.start - g0 != r * t {
                buf.copy_within(own.start - g0..own.end - g0, r * t);
            }
            buf[r * t + own.len()..(r + 1) * t].fill(0.0);
        }
    }

    /// Segment `seg`'s gradient from the local accumulator `grads` (full
    /// gradient space), packed as a reduce-scatter's input into the front
    /// `W·t_j` elements of `buf` (which has room for the segment too).
    pub fn pack_segment_grads(&self, seg: usize, grads: &[f32], buf: &mut [f32]) {
        let g = self.space.grad_segments[seg].clone();
        buf[..g.len()].copy_from_slice(&grads[g]);
        self.pack_grads_in_place(seg, &mut buf[..self.grad_piece[seg] * self.world_size]);
    }

    /// A reduce-scatter's result for segment `seg` written back over this
    /// rank's piece of the local accumulator `grads` (full gradient space).
    pub fn place_reduced(&self, seg: usize, reduced: &[f32], grads: &mut [f32]) {
        let own = self.grad_owned(seg, self.rank);
        grads[own.clone()].copy_from_slice(&reduced[..own.len()]);
    }

    /// A reduce-scatter's result for segment `seg` added into the shard
    /// accumulator `grads` (per-segment reduction).
    pub fn add_reduced(&self, seg: usize, reduced: &[f32], grads: &mut [f32]) {
        let acc = &mut grads[self.grad_shard_range(seg)];
        acc.iter_mut().zip(reduced).for_each(|(a, r)| *a += r);
    }

    /// Copies this rank's parameter pieces of a full buffer into a shard (padding zero).
    pub fn gather_own(&self, full: &[f32], shard: &mut [f32]) {
        self.copy_own(full, shard, |j| self.owned(j, self.rank), |j| self.shard_range(j));
    }

    /// Copies this rank's gradient pieces of a full gradient-space buffer into a gradient shard.
    pub fn gather_own_grads(&self, full: &[f32], shard: &mut [f32]) {
        self.copy_own(full, shard, |j| self.grad_owned(j, self.rank), |j| self.grad_shard_range(j));
    }

    fn copy_own(
        &self,
        full: &[f32],
        shard: &mut [f32],
        own: impl Fn(usize) -> Range<usize>,
        dst: impl Fn(usize) -> Range<usize>,
    ) {
        for seg in 0..self.n_segments() {
            let own = own(seg);
            let dst = &mut shard[dst(seg)];
            dst[..own.len()].copy_from_slice(&full[own.clone()]);
            dst[own.len()..].fill(0.0);
        }
    }

    /// The optimizer's view of this rank's part: one [`UpdateRun`] per
    /// trainable run of its pieces, indexing the buffers `sharding` names.
    pub fn update_runs(&self, sharding: UpdateSharding) -> Vec<UpdateRun> {
        let UpdateSharding { params: params_sharded, grads: grads_sharded, state: state_sharded } = sharding;
        let mut runs = Vec::new();
        for j in 0..self.n_segments() {
            let own = if state_sharded || params_sharded || grads_sharded {
                self.owned(j, self.rank)
            } else {
                self.segment(j)
            };
            let gown = self.space.grad_range(j, own.clone());
            for (pr, g, tensor) in self.space.trainable_runs(j, own.clone()) {
                let in_shard = self.grad_shard_range(j).start + (g - gown.start);
                let param = if params_sharded { self.shard_range(j).start + (pr.start - own.start) } else { pr.start };
                let grad = if grads_sharded { in_shard } else { g };
                let state = if state_sharded { in_shard } else { g };
                let seg_at = pr.start - self.segment(j).start;
                let rel = self.space.tensors[j].iter().find(|t| t.idx == tensor).map_or(0, |t| t.rel.start);
                runs.push(UpdateRun { param, grad, state, len: pr.len(), tensor, seg_at, at: seg_at - rel });
            }
        }
        runs
    }

    /// The layout the optimizer sees for this rank's gradient shard: the
    /// pieces of the model's trainable tensors and the padding.
    pub fn shard_layout(&self, layout: &ParamLayout) -> ParamLayout {
        let mut out = ParamLayout::new();
        for seg in 0..self.n_segments() {
            let own = self.owned(seg, self.rank);
            let mut n = 0;
            for (pr, _, idx) in self.space.trainable_runs(seg, own) {
                let t = &layout.tensors()[idx];
                let tr = t.range();
                out.push(format!("{}[{}..{}]", t.name, pr.start - tr.start, pr.end - tr.start), &[pr.len()], t.decay);
                n += pr.len();
            }
            let pad = self.grad_piece[seg] - n;
            if pad > 0 {
                out.push(format!("padding.{seg}"), &[pad], false);
            }
        }
        out
    }
}

/// Which buffers an [`UpdateRun`]'s indices point into: this rank's shard,
/// or the whole buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdateSharding {
    /// Parameters index the parameter shard (else the full parameters).
    pub params: bool,
    /// Gradients index the gradient shard (else the full gradient space).
    pub grads: bool,
    /// Optimizer state indexes the gradient shard (else the gradient space).
    pub state: bool,
}

/// One contiguous trainable run of this rank's update: where its
/// parameters, gradients and optimizer state start, its length, and the
/// layout index of the tensor it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdateRun {
    /// First parameter element.
    pub param: usize,
    /// First gradient element.
    pub grad: usize,
    /// First optimizer-state element.
    pub state: usize,
    /// Elements in the run.
    pub len: usize,
    /// Layout index of its tensor.
    pub tensor: usize,
    /// Offset of its first parameter from its segment's first parameter.
    pub seg_at: usize,
    /// Index of its first element within its tensor.
    pub at: usize,
}

/// The all-reduce buckets of a gradient space of `n` elements: `bucket`
/// elements each, the last shorter. One definition for the boundary and
/// `overlap_comm`: at three or more ranks a sum's order depends on them.
pub fn buckets(n: usize, bucket: usize) -> impl Iterator<Item = Range<usize>> {
    let b = bucket.max(1);
    (0..n.div_ceil(b)).map(move |i| i * b..((i + 1) * b).min(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every element of every segment has exactly one owner, every
        /// trainable element one gradient owner, and shards are the same
        /// length on every rank; aligned pieces are multiples of the alignment.
        #[test]
        fn pieces_tile_every_segment(
            lens in proptest::collection::vec((0usize..50, any::<bool>()), 1..8),
            cut in proptest::collection::vec(any::<bool>(), 8),
            world in 1usize..6,
            align in prop_oneof![Just(1usize), 1usize..9],
        ) {
            let mut layout = ParamLayout::new();
            for (i, &(l, _)) in lens.iter().enumerate() {
                layout.push(format!("t{i}"), &[l], true);
            }
            layout.set_trainable(|t| lens[t.name[1..].parse::<usize>().unwrap()].1);
            // Segments: whole tensors, cut after tensor i where cut[i].
            let mut segs = Vec::new();
            let mut start = 0;
            for (i, t) in layout.tensors().iter().enumerate() {
                if cut[i] || i + 1 == layout.tensors().len() {
                    segs.push(start..t.range().end);
                    start = t.range().end;
                }
            }
            let space = GradSpace::new(&layout, segs.clone()).unwrap();
            let mut owners = vec![0u32; layout.n_params()];
            let mut grad_owners = vec![0u32; layout.n_trainable()];
            let p0 = Partition::aligned(space.clone(), 0, world, align);
            for rank in 0..world {
                let p = Partition::aligned(space.clone(), rank, world, align);
                prop_assert!(p.piece.iter().all(|&s| s % align == 0));
                prop_assert_eq!(p.shard_len(), p0.shard_len());
                prop_assert_eq!(p.grad_shard_len(), p0.grad_shard_len());
                for seg in 0..segs.len() {
                    for i in p.owned(seg, rank) {
                        owners[i] += 1;
                    }
                    for i in p.grad_owned(seg, rank) {
                        grad_owners[i] += 1;
                    }
                }
                prop_assert_eq!(p.shard_layout(&layout).n_params(), p.grad_shard_len());
                let runs = p.update_runs(UpdateSharding { params: true, grads: true, state: true });
                prop_assert_eq!(runs.iter().map(|r| r.len).sum::<usize>(),
                    (0..segs.len()).map(|s| p.grad_owned(s, rank).len()).sum::<usize>());
            }
            prop_assert!(owners.iter().all(|&n| n == 1));
            prop_assert!(grad_owners.iter().all(|&n| n == 1));
        }
    }
}
