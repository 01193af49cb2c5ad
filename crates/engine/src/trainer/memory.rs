//! Memory accounting: the element count of every trainer buffer, defined
//! once ([`BufferSizes`]) for what a trainer allocates and what a plan
//! predicts from the layout alone.

use super::Trainer;
use crate::error::EngineError;
use crate::model::Model;
use crate::optim::offload::{window_len, WINDOW_ELEMS};
use crate::optim::StateSize;
use crate::precision::Precision;
use crate::store::GradSpace;
use crate::zero::{Accumulation, Partition, Reduction, ZeroConfig, ZeroStage};

impl Trainer {
    /// The [`Trainer::memory`] a trainer of `model` would report on rank 0
    /// of `world_size` ranks, computed from the layout alone: nothing is
    /// allocated, so shapes too large for this machine can be planned.
    /// `optimizer_state`: how the optimizer's state is sized (a number: f32
    /// values per trainable parameter, AdamW 2; see [`StateSize`]);
    /// `bucket_elems`: [`TrainerOptions::bucket_elems`](crate::TrainerOptions::bucket_elems).
    pub fn planned_memory<M: Model>(
        model: &M,
        zero: ZeroConfig,
        world_size: usize,
        precision: Precision,
        optimizer_state: impl Into<StateSize>,
        bucket_elems: usize,
        offload: bool,
    ) -> Result<MemoryReport, EngineError> {
        Self::planned_memory_of(
            (model.layout(), model.segments()),
            zero,
            world_size,
            precision,
            optimizer_state,
            bucket_elems,
            offload,
        )
    }

    /// [`Trainer::planned_memory`] of a layout cut into `segments` (a
    /// pipeline stage's own, [`crate::StageLayout`]): what
    /// [`Trainer::for_stage`] allocates on rank 0 of the stage's
    /// `world_size` data ranks.
    pub fn planned_memory_of(
        (layout, segments): (&crate::ParamLayout, Vec<std::ops::Range<usize>>),
        zero: ZeroConfig,
        world_size: usize,
        precision: Precision,
        optimizer_state: impl Into<StateSize>,
        bucket_elems: usize,
        offload: bool,
    ) -> Result<MemoryReport, EngineError> {
        let size: StateSize = optimizer_state.into();
        let stage = ZeroStage::new(zero)?;
        let space = GradSpace::new(layout, segments)?;
        let (rank, world) = stage.partition_of(0, world_size.max(1));
        let part = Partition::aligned(space, rank, world, size.shard_align());
        let s = BufferSizes::new(&part, stage, precision, bucket_elems);
        let runs = super::state_runs(&part, layout, stage.update_sharding(precision));
        let slots = size.offload_slots();
        Ok(match offload {
            true => s.report(
                precision,
                4 * slots * window_len(s.optimizer, WINDOW_ELEMS) + size.kept_in_memory(&runs),
                4 * slots * s.optimizer,
            ),
            false => s.report(precision, size.bytes(s.optimizer, &runs), 0),
        })
    }

    /// Bytes this rank holds for model states and collectives.
    pub fn memory(&self) -> MemoryReport {
        let copy = self.model_copy.as_ref();
        let sizes = BufferSizes {
            params: self.params.len(),
            model_copy: copy.map_or(0, |c| c.bits.len()),
            decoded: copy.map_or(0, |c| c.decoded_len()),
            optimizer: 0,
            grads: self.grads.len(),
            seg_grads: self.seg_grads.len(),
            gathered: self.gathered.len(),
            scratch: self.scratch.len(),
            max_collective: self.max_collective,
            overlap_staging: super::overlap::staging_elems(
                &self.part,
                (self.zero_stage.reduction(), self.zero_stage.shards_parameters()),
                self.options.bucket_elems,
            ),
        };
        let (resident, offloaded) = self.offload.as_ref().map_or((0, 0), |d| (d.resident_bytes(), d.offloaded_bytes()));
        sizes.report(self.options.precision, self.optimizer.state_bytes() + resident, offloaded)
    }
}

/// Bytes this rank holds, by kind (the per-rank model states of docs/contract.md, Memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct MemoryReport {
    /// Parameters resident between steps (all at stages 0–2, the shard at 3).
    pub params: usize,
    /// Gradient buffers: the full local accumulator (stages 0–1, and 2 with
    /// local accumulation), or the shard accumulator.
    pub grads: usize,
    /// Optimizer state in memory (AdamW's m and v; full at stage 0, the
    /// shard above; with the state offloaded to disk, its window buffers).
    pub optimizer: usize,
    /// Optimizer state offloaded to disk (`dist.offload_optimizer = "disk"`), not in memory.
    pub offloaded: usize,
    /// f32 master weights separate from the parameters (none while training in f32).
    pub master: usize,
    /// Buffers for collectives: one segment's gradient waiting for its
    /// reduce-scatter, stage 3's gathered segment, padding scratch.
    pub comm_buffers: usize,
    /// Largest parameter residency during a step: resident parameters plus
    /// the one gathered segment (stage 3).
    pub peak_param_residency: usize,
    /// Elements of the largest buffer one collective carries (a gradient
    /// bucket of an all-reduce, or a padded segment of a reduce-scatter,
    /// all-gather or the initial broadcast): what a communicator stages.
    pub max_collective_elems: usize,
    /// Elements `overlap_comm` would stage at once (copies of gradient
    /// buckets or packed segments in flight, a segment gathered ahead):
    /// reported whether or not it is on; held, and planned, only when it is.
    pub overlap_staging_elems: usize,
}

impl MemoryReport {
    /// Parameters + gradients + optimizer state + master weights.
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer + self.master
    }
}

/// Element counts of a trainer's buffers on one rank: what
/// [`Trainer::distributed_with`] allocates and [`Trainer::planned_memory`]
/// predicts (one definition, so the plan cannot drift from the engine).
#[derive(Debug, Clone, Copy)]
pub(super) struct BufferSizes {
    /// f32 parameters (all, or this rank's shard).
    pub(super) params: usize,
    /// 16-bit model copy (mixed precision, stages 0–2).
    pub(super) model_copy: usize,
    /// Segments decoded from the 16-bit copy (the largest, and one other).
    pub(super) decoded: usize,
    /// Optimizer-state elements per slot.
    pub(super) optimizer: usize,
    /// Gradient accumulator.
    pub(super) grads: usize,
    /// One segment's gradient awaiting its reduce-scatter (per-segment accumulation).
    pub(super) seg_grads: usize,
    /// Stage 3's gathered segment.
    pub(super) gathered: usize,
    /// Packing / result scratch of the reduction.
    pub(super) scratch: usize,
    /// The largest buffer one collective carries.
    pub(super) max_collective: usize,
    /// What `overlap_comm` may stage at once.
    pub(super) overlap_staging: usize,
}

impl BufferSizes {
    pub(super) fn new(part: &Partition, stage: ZeroStage, precision: Precision, bucket_elems: usize) -> Self {
        let world = part.world_size;
        let n_params = part.space.segments.last().map_or(0, |r| r.end);
        let low_copy = stage.keeps_model_copy(precision);
        let max_grad_padded = (0..part.n_segments()).map(|j| part.grad_piece[j] * world).max().unwrap_or(0);
        let max_grad_piece = part.grad_piece.iter().copied().max().unwrap_or(0);
        let per_segment = stage.accumulation() == Accumulation::PerSegment;
        let max_padded = (0..part.n_segments()).map(|j| part.piece[j] * world).max().unwrap_or(0);
        Self {
            params: if stage.shards_master(precision) { part.shard_len() } else { n_params },
            model_copy: if low_copy { n_params } else { 0 },
            decoded: match low_copy {
                true => {
                    let (_, pinned, shared) = super::decode_slots(&part.space.segments);
                    pinned + shared
                }
                false => 0,
            },
            optimizer: if stage.shards_optimizer() { part.grad_shard_len() } else { part.space.n_grads },
            grads: if per_segment { part.grad_shard_len() } else { part.space.n_grads },
            seg_grads: if per_segment { max_grad_padded } else { 0 },
            gathered: if stage.shards_parameters() { max_padded } else { 0 },
            // Stage 2 with local accumulation packs whole segments for
            // reduce-scatter; per-segment reduction only needs one piece for the result.
            scratch: match stage.reduction() {
                Reduction::ReduceScatter => max_grad_padded,
                Reduction::Done => max_grad_piece,
                Reduction::AllReduce => 0,
            },
            // Segments are broadcast at start and gathered / reduce-scattered
            // padded; stages 0–1 all-reduce the gradient in buckets.
            max_collective: max_padded.max(match stage.reduction() {
                Reduction::AllReduce => bucket_elems.max(1).min(part.space.n_grads),
                _ => 0,
            }),
            overlap_staging: super::overlap::staging_elems(
                part,
                (stage.reduction(), stage.shards_parameters()),
                bucket_elems,
            ),
        }
    }

    /// The accounting, with the optimizer state's bytes given (in memory, on disk).
    fn report(&self, precision: Precision, optimizer_bytes: usize, offloaded: usize) -> MemoryReport {
        // f32: the parameters are their own master copy. Mixed precision: the
        // model reads the 16-bit copy (stages 0–2) or rounded gathered
        // segments (stage 3); the f32 values are the master weights.
        let (params, master) =
            if precision.is_low() { (2 * self.model_copy, 4 * self.params) } else { (4 * self.params, 0) };
        let (gathered, decoded) = (4 * self.gathered, 4 * self.decoded);
        MemoryReport {
            params,
            grads: 4 * self.grads,
            optimizer: optimizer_bytes,
            offloaded,
            master,
            comm_buffers: gathered + 4 * (self.seg_grads + self.scratch) + decoded,
            peak_param_residency: params + gathered + decoded,
            max_collective_elems: self.max_collective,
            overlap_staging_elems: self.overlap_staging,
        }
    }
}
