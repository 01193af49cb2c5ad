//! The memory model: what a training run needs per rank and per process,
//! piece by piece, from the shapes alone — nothing large is allocated, so
//! shapes far beyond this machine can be planned. Model states and
//! collective buffers come from the engine's own accounting
//! (`Trainer::planned_memory`, equal to what a trainer allocates),
//! activations from the model family (equal to what the model allocates);
//! the rest is the data and the process itself. With pipeline parallelism
//! ([`pipeline`]) every stage is counted on its own layout and the peak
//! stage is the plan's; with tensor parallelism ([`tensor`]) every count is
//! of the shape one tensor rank holds. On top: the largest
//! micro-batch under a budget with the accumulation steps that keep the
//! global batch, the memory check of a run, and ([`report()`]) what to change
//! when nothing fits.

mod fit;
#[cfg(test)]
mod measure;
pub mod pipeline;
mod report;
pub mod tensor;
#[cfg(test)]
mod tensor_shapes;

pub use fit::plan;
pub use report::{render, report};

use crate::family::Build;
use crate::memory;
use crate::setup::{apply_trainable, bucket_elems, trainable_patterns, Plan};
use anyhow::Result;
use config::{Checkpointing, Precision};
use engine::{MemoryReport, ScheduleKind, StageSpec, Trainer, ZeroConfig};
use family::Family;
use serde::Serialize;
use std::sync::Arc;

/// How the ranks of a plan communicate (what their communicator stages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// One rank, no communication.
    Single,
    /// Ranks as threads of one process.
    Threads,
    /// One process per rank under MPI.
    Mpi,
}

/// The knobs a plan varies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Knobs {
    /// Sequences per micro-batch per rank.
    pub micro: usize,
    /// Ranks in the group.
    pub world_size: usize,
    /// Ranks sharing one process (thread ranks), 1 under MPI.
    pub ranks_per_process: usize,
    /// How ranks communicate.
    pub backend: Backend,
    /// ZeRO stage.
    pub zero_stage: u8,
    /// Stage 2: reduce-scatter after every micro-step.
    pub reduce_every_micro_step: bool,
    /// Storage precision of the model copy and activations.
    pub precision: Precision,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// Optimizer state in files instead of memory.
    pub offload_optimizer: bool,
    /// Pipeline stages P (1: no pipeline); the world is P × D data ranks.
    pub pipeline_parallel: usize,
    /// The pipeline's schedule.
    pub pipeline_schedule: ScheduleKind,
    /// Tensor-parallel ranks T (1: no split); the world is P × D × T.
    pub tensor_parallel: usize,
    /// The vocabulary split over the T ranks too.
    pub vocab_parallel: bool,
    /// The residual stream's rows split over the T ranks.
    pub sequence_parallel: bool,
    /// Context-parallel ranks C (1: whole sequences); the world is P × D × C × T.
    pub context_parallel: usize,
}

impl Knobs {
    /// The knobs of a resolved training plan.
    pub fn of(plan: &Plan) -> Self {
        let cfg = &plan.cfg;
        Self {
            micro: plan.batch.micro,
            world_size: plan.backend.world_size(),
            ranks_per_process: plan.backend.ranks_per_process(),
            backend: match plan.backend {
                crate::dist::Backend::Single => Backend::Single,
                crate::dist::Backend::Threads(_) => Backend::Threads,
                crate::dist::Backend::Mpi(_) => Backend::Mpi,
            },
            zero_stage: cfg.dist.zero_stage,
            reduce_every_micro_step: cfg.dist.reduce_every_micro_step,
            precision: cfg.train.precision,
            checkpointing: cfg.train.activation_checkpointing,
            offload_optimizer: cfg.dist.offload_optimizer == config::OffloadOptimizer::Disk,
            pipeline_parallel: cfg.dist.pipeline_parallel,
            pipeline_schedule: cfg.dist.pipeline_schedule,
            tensor_parallel: cfg.dist.tensor_parallel,
            vocab_parallel: cfg.dist.vocab_parallel,
            sequence_parallel: cfg.dist.sequence_parallel,
            context_parallel: cfg.dist.context_parallel,
        }
    }

    /// Data ranks D = W / (P × C × T): per pipeline stage, context rank and tensor rank.
    pub fn data_parallel(&self) -> usize {
        self.world_size / (self.pipeline_parallel.max(1) * self.tensor_parallel.max(1) * self.context_parallel.max(1))
    }

    /// Ranks holding one pipeline stage, D × C × T.
    pub fn stage_ranks(&self) -> usize {
        self.data_parallel() * self.context_parallel.max(1) * self.tensor_parallel.max(1)
    }

    /// Positions of a sequence of `t` the busiest context rank runs (all
    /// `t` without context parallelism): what its activations are sized by.
    pub fn rank_positions(&self, t: usize) -> usize {
        let c = self.context_parallel.max(1);
        (0..c).map(|r| engine::ContextRank::new(r, c).local_len(t)).max().unwrap_or(t)
    }
}

/// `dist.pipeline_layers` of a plan: layers per stage, or `None` (an even cut).
pub fn pipeline_layers(plan: &Plan) -> Option<Vec<usize>> {
    plan.cfg.dist.pipeline_layers.clone()
}

/// Bytes, per rank and per process.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    /// The knobs it is for.
    pub knobs: Knobs,
    /// Micro-steps per optimizer step that keep the global batch (with a
    /// pipeline: the micro-batches of one step through every stage).
    pub accumulation_steps: usize,
    /// The pipeline stage these bytes are of (0 without a pipeline); its
    /// ranks are `stage · D·T .. (stage + 1) · D·T`.
    pub stage: usize,
    /// The blocks (layers) the stage runs, `[start, end)`.
    pub blocks: (usize, usize),
    /// Micro-batches whose activations the stage keeps at once.
    pub in_flight: usize,
    /// Parameters one rank of the stage holds (with a tied embedding, the
    /// last stage its copy too; with tensor parallelism, a tensor rank's
    /// slices and the replicated tensors).
    pub stage_params: u64,
    /// Per rank: parameters the model reads (f32, or the 16-bit copy).
    pub params: u64,
    /// Per rank: f32 master weights (mixed precision).
    pub master: u64,
    /// Per rank: the gradient accumulator.
    pub grads: u64,
    /// Per rank: optimizer state.
    pub optimizer: u64,
    /// Per rank: collective buffers (stage 3's gathered segment, a
    /// segment's gradient awaiting reduce-scatter, packing scratch).
    pub comm_buffers: u64,
    /// Per rank: the communicator's staging of the largest collective.
    pub comm_staging: u64,
    /// Per rank: the tensor-parallel group's staging of its largest
    /// all-reduce (a micro-batch's residual stream or the partial
    /// gradients; 0 without a split).
    pub tp_staging: u64,
    /// Per process: staging shared by its thread ranks (their summed result).
    pub comm_shared: u64,
    /// Per process: the other ranks of this process (thread ranks; with a
    /// pipeline, every stage's).
    pub other_ranks: u64,
    /// Per rank: activations and backward scratch of the micro-batches in
    /// flight (saved tensors, attention probabilities, logits, recompute slot).
    pub activations: u64,
    /// Per rank: point-to-point buffers between pipeline stages (the
    /// activations and gradients sent and received, a tied embedding's
    /// gradient from the other end).
    pub p2p: u64,
    /// Per rank: the step's K micro-batches of token ids and targets.
    pub batches: u64,
    /// Per process: the tokenised data set (train and validation).
    pub data: u64,
    /// Per process: the program itself (code, libraries, thread stacks).
    pub runtime: u64,
    /// Per process, on top of a step's bytes, while rank 0 writes a
    /// checkpoint or saves the model: the full parameters and the full
    /// optimizer state gathered into one buffer each, one gathered segment
    /// (or an offloaded state file read back), and the write buffers. A stop
    /// signal may ask for a checkpoint after any step, so it always counts.
    /// Sharded (`train.checkpoint_sharded`): every rank of the process at
    /// once, each its share's write buffers (nothing gathered; the final
    /// model is the last checkpoint).
    pub checkpoint: u64,
    /// Per process, before the first step: a checkpoint (`--resume`) or a
    /// pretrained model (`--init-from`) read — the file's bytes while they
    /// are converted —, then held while every rank's trainer allocates its
    /// model states (no activation exists yet). Counted for every run: its
    /// own checkpoints must be resumable where it ran. Sharded: each rank's
    /// model states, one whole segment and one piece being read.
    pub load: u64,
    /// Per process: the kernels' per-thread workspace (GEMM packing buffers
    /// and the like), [`WORKSPACE_PER_THREAD`] × compute threads.
    pub workspace: u64,
    /// Per process: the frozen base packed outside the parameters
    /// (`train.frozen_dtype`), one copy shared by the process's ranks.
    pub frozen: u64,
    /// Per process (rank 0's): the f32 moving average of the trainable
    /// weights (`train.ema_decay`; 0 when off).
    pub ema: u64,
    /// Per rank, with `train.checkpoint_sharded`: its heap's growth while
    /// it writes its share (`checkpoint` counts every rank of the process).
    pub checkpoint_rank: u64,
    /// Per rank, with `train.checkpoint_sharded`: its heap's peak while it
    /// builds its trainer from a checkpoint's pieces (model states, one
    /// whole segment, one piece, one slot as it holds it).
    pub load_rank: u64,
}

/// Bytes of kernel workspace per compute thread: what the measured peak of
/// small runs exceeds everything else by (≈ 8 MiB with 2 threads on an AMD
/// EPYC; scripts/memory-table.sh), i.e. the GEMM's packing buffers.
pub const WORKSPACE_PER_THREAD: u64 = 4 << 20;

impl Estimate {
    /// One rank's bytes.
    pub fn per_rank(&self) -> u64 {
        self.params
            + self.master
            + self.grads
            + self.optimizer
            + self.comm_buffers
            + self.comm_staging
            + self.tp_staging
            + self.activations
            + self.p2p
            + self.batches
    }

    /// One process's bytes during an optimizer step: its ranks plus what
    /// they share.
    pub fn step_peak(&self) -> u64 {
        self.per_rank()
            + self.other_ranks
            + self.comm_shared
            + self.data
            + self.runtime
            + self.workspace
            + self.frozen
            + self.ema
    }

    /// One process's peak over every phase of a run: loading, steps and
    /// evaluation (the same buffers), checkpoints and the final save.
    pub fn per_process(&self) -> u64 {
        let step = self.step_peak();
        (step + self.checkpoint).max(self.load + self.data + self.runtime + self.workspace + self.frozen)
    }

    /// [`Estimate::per_process`] with the margin every fit keeps.
    pub fn needed(&self) -> u64 {
        with_margin(self.per_process())
    }
}

/// The margin on top of a plan: the measured peaks of docs/memory.md exceed
/// the plan by up to 10% (thread ranks' collective staging, allocator
/// overhead), and an address-space limit (`ulimit -v`) also counts memory
/// reserved but not touched (thread stacks, allocator arenas).
pub const MARGIN_PERCENT: u64 = 10;
/// The fixed part of the margin: 64 MiB.
pub const MARGIN_FIXED: u64 = 64 << 20;

/// `bytes` with the margin every fit keeps: + [`MARGIN_PERCENT`] % + [`MARGIN_FIXED`].
pub fn with_margin(bytes: u64) -> u64 {
    bytes.saturating_add(bytes / 100 * MARGIN_PERCENT).saturating_add(MARGIN_FIXED)
}

/// The process's resident size before a run allocates anything: measured
/// on this very binary (same code, same libraries) at start-up.
pub fn runtime_bytes() -> u64 {
    static AT_START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *AT_START.get_or_init(|| memory::proc_status_bytes("VmRSS:").unwrap_or(8 << 20))
}

/// Per-rank and per-process bytes of `plan` with `knobs` (the peak stage's with a pipeline).
pub fn estimate(plan: &Plan, knobs: Knobs) -> Result<Estimate> {
    estimate_at(plan, knobs, &model_states(plan, knobs)?)
}

/// The engine's accounting for `knobs` (everything but the micro-batch)
/// and the counts the save and load phases need.
pub struct States {
    /// Per pipeline stage (one without a pipeline), of one tensor rank.
    stages: Vec<StageStates>,
    /// The shape one tensor rank holds (the whole model's without a split).
    family: Arc<dyn Family>,
    /// The model's block stack (`None` without a pipeline).
    stack: Option<pipeline::Stack>,
    /// What a tensor rank reduces over its group (`None` without a split).
    traffic: Option<tensor::Traffic>,
    /// Trainable elements of the embedding segment (a tied embedding's
    /// gradient exchanged between the first and the last stage).
    embedding_grads: u64,
    /// Parameters of the whole model (what a checkpoint holds at any T).
    n_params: u64,
    /// Trainable parameters of the whole model (the full gradient space).
    n_trainable: u64,
    /// f32 optimizer-state values per trainable parameter in a checkpoint.
    slots: u64,
    /// Whether the state is converted to f32 for a checkpoint (8-bit,
    /// factored), every slot at once.
    converted: bool,
    /// Elements of the largest whole tensor (a sharded checkpoint's
    /// largest piece at any layout).
    largest_tensor: u64,
    /// Elements of the largest whole segment (what a sharded checkpoint's
    /// load reads into at a time).
    largest_segment: u64,
    /// Tensors of the whole model.
    n_tensors: u64,
    /// Segments of the model, and the multiple a ZeRO piece of one is
    /// rounded to.
    n_segments: u64,
    align: u64,
}

impl States {
    /// Bytes of a sharded checkpoint's manifest in memory, bounded: each
    /// of `world` ranks writes at most three pieces (a partial row, rows,
    /// a partial row) of each tensor of the parameters and of each slot,
    /// each piece ~[`PIECE_ENTRY_BYTES`] parsed.
    fn manifest_bytes(&self, world: usize) -> u64 {
        3 * (1 + self.slots) * world as u64 * self.n_tensors * PIECE_ENTRY_BYTES
    }
}

/// Bytes of one piece's entry in a manifest held in memory (its struct,
/// tensor and file names, and checksum).
const PIECE_ENTRY_BYTES: u64 = 320;

/// The engine's accounting of one stage (the whole model without a pipeline).
struct StageStates {
    /// The stage's blocks.
    blocks: std::ops::Range<usize>,
    /// `Trainer::planned_memory` over the stage's layout on its D data ranks.
    report: MemoryReport,
    /// Parameters of the stage's layout.
    n_params: u64,
    /// Trainable parameters of the stage's layout.
    n_trainable: u64,
}

/// The engine's accounting for `knobs`: everything but the micro-batch.
fn model_states(plan: &Plan, knobs: Knobs) -> Result<States> {
    stage_states(plan, knobs, pipeline_layers(plan).as_deref())
}

/// [`model_states`] with the pipeline's cut given: layers per stage, or
/// `None` for an even cut into `knobs.pipeline_parallel` stages.
pub(crate) fn stage_states(plan: &Plan, knobs: Knobs, layers: Option<&[usize]>) -> Result<States> {
    let cfg = &plan.cfg;
    let dp = pipeline::data_parallel(&knobs)?;
    // The layout does not depend on checkpointing (a family without it
    // still gets planned; `train` refuses to run it).
    let layout_build = Build { precision: knobs.precision, checkpointing: Checkpointing::None, whole_len: None };
    let built = |f: &dyn Family| -> Result<Box<dyn family::LanguageModel>> {
        let mut model = f.build(layout_build)?;
        apply_trainable(&mut model, &trainable_patterns(cfg))?;
        Ok(model)
    };
    let family = tensor::rank_family(plan, &knobs)?;
    let mut model = built(family.as_ref())?;
    // What a checkpoint holds: the whole model, whatever the split.
    let (n_params, n_trainable) = match knobs.tensor_parallel > 1 {
        true => {
            let whole = built(plan.family.as_ref())?;
            (whole.layout().n_params() as u64, whole.layout().n_trainable() as u64)
        }
        false => (model.layout().n_params() as u64, model.layout().n_trainable() as u64),
    };
    let traffic = tensor::Traffic::of(model.as_ref());
    let zero = ZeroConfig { stage: knobs.zero_stage, reduce_every_micro_step: knobs.reduce_every_micro_step };
    let slots = crate::setup::state_size(cfg);
    let bucket_elems = bucket_elems(cfg);
    let offload = knobs.offload_optimizer;
    let segments = model.segments();
    let plan_of = |l: &engine::ParamLayout, s: Vec<std::ops::Range<usize>>| {
        Trainer::planned_memory_of((l, s), zero, dp, knobs.precision, slots, bucket_elems, offload)
    };
    let (stages, stack) = if knobs.pipeline_parallel <= 1 {
        let (blocks, layout) = (0..model.n_blocks(), model.layout());
        let report = plan_of(layout, segments.clone())?;
        let (n_params, n_trainable) = (layout.n_params() as u64, layout.n_trainable() as u64);
        (vec![StageStates { blocks, report, n_params, n_trainable }], None)
    } else {
        let stack = pipeline::Stack::of(model.as_ref());
        let cuts = pipeline::cut(&mut model, &stack, knobs.pipeline_parallel, knobs.pipeline_schedule, layers)?;
        let stages = cuts
            .into_iter()
            .map(|c| {
                let l = &c.layout.layout;
                let report = plan_of(l, c.layout.segments.clone())?;
                let (n_params, n_trainable) = (l.n_params() as u64, l.n_trainable() as u64);
                Ok(StageStates { blocks: c.spec.blocks, report, n_params, n_trainable })
            })
            .collect::<Result<Vec<_>>>()?;
        (stages, Some(stack))
    };
    let layout = model.layout();
    let tp = knobs.tensor_parallel.max(1) as u64;
    let largest_tensor = tp * layout.tensors().iter().map(|t| t.numel() as u64).max().unwrap_or(0);
    let largest_segment = tp * segments.iter().map(|r| r.len() as u64).max().unwrap_or(0);
    let embedding = segments.first().cloned().unwrap_or(0..0);
    let embedding_grads = layout
        .tensors()
        .iter()
        .filter(|t| t.trainable && embedding.contains(&t.offset))
        .map(|t| t.numel() as u64)
        .sum();
    Ok(States {
        stages,
        family,
        stack,
        traffic,
        embedding_grads,
        n_params,
        n_trainable,
        slots: slots.checkpoint_slots() as u64,
        converted: !matches!(slots, engine::optim::StateSize::Slots(_)),
        largest_tensor,
        largest_segment,
        n_tensors: layout.tensors().len() as u64,
        n_segments: segments.len() as u64,
        align: slots.shard_align() as u64,
    })
}

/// Bytes the checkpoint writer holds besides the state: its 1 MiB file
/// buffer, a 64 KiB conversion chunk, the header, the SHA-256 reader.
const WRITE_BUFFERS: u64 = 2 << 20;

/// [`estimate`] with the engine's accounting `states` already made (it does
/// not depend on the micro-batch): the peak stage's bytes over all phases,
/// then during a step (the first of equal peaks; the only stage without a
/// pipeline).
fn estimate_at(plan: &Plan, knobs: Knobs, states: &States) -> Result<Estimate> {
    Ok(peak(&stage_estimates(plan, knobs, states)?.0))
}

/// The stage whose process peaks highest over all phases, then during a
/// step (the first of equal peaks).
pub fn peak(stages: &[Estimate]) -> Estimate {
    let mut peak = stages[0];
    for e in stages {
        if (e.per_process(), e.step_peak()) > (peak.per_process(), peak.step_peak()) {
            peak = *e;
        }
    }
    peak
}

/// Every pipeline stage's bytes for `knobs` (one without a pipeline), of
/// one rank of the stage: what each rank of a run is planned to hold.
pub fn per_stage(plan: &Plan, knobs: Knobs) -> Result<Vec<Estimate>> {
    Ok(stage_estimates(plan, knobs, &model_states(plan, knobs)?)?.0)
}

/// Every stage's bytes (one without a pipeline) and, with a pipeline, the
/// schedule of one step.
pub(crate) fn stage_estimates(
    plan: &Plan,
    knobs: Knobs,
    states: &States,
) -> Result<(Vec<Estimate>, Option<engine::Schedule>)> {
    let cfg = &plan.cfg;
    let dp = knobs.data_parallel().max(1);
    // A context rank holds its positions of each sequence (activations,
    // stage boundaries, tensor collectives); the data set's tokens are whole.
    let whole_len = plan.train.seq_len();
    let seq_len = knobs.rank_positions(whole_len);
    let split = knobs.context_parallel > 1;
    let build =
        Build { precision: knobs.precision, checkpointing: knobs.checkpointing, whole_len: split.then_some(whole_len) };
    let accumulation_steps = plan.batch.global / (knobs.micro * dp).max(1);
    let blocks: Vec<_> = states.stages.iter().map(|s| s.blocks.clone()).collect();
    let (specs, schedule) = match &states.stack {
        Some(_) => {
            let (specs, schedule) = pipeline::specs(&knobs, &blocks, accumulation_steps)?;
            (specs, Some(schedule))
        }
        None => (vec![StageSpec::whole(blocks[0].end)], None),
    };
    // What the communicator stages per data-parallel group: thread ranks
    // keep an f64 copy of their largest contribution in their slot, and
    // the group one f64 result; MPI keeps an f32 staging buffer of the
    // largest collective. With a pipeline each stage's data-parallel group
    // reduces its gradient this way, also when it has one rank.
    // dist.overlap_comm adds a second handle on the group (its own
    // staging) and the f32 copies in flight (`overlap_staging_elems`).
    let overlap = plan.cfg.dist.overlap_comm && dp > 1 && knobs.pipeline_parallel <= 1 && knobs.tensor_parallel <= 1;
    let staging = |st: &StageStates| {
        let max = st.report.max_collective_elems as u64;
        let (own, shared) = match knobs.backend {
            Backend::Single => (0, 0),
            Backend::Threads => (8 * max, 8 * max),
            Backend::Mpi => (4 * max, 0),
        };
        match overlap {
            true => (2 * own + 4 * st.report.overlap_staging_elems as u64, 2 * shared),
            false => (own, shared),
        }
    };
    // The tensor-parallel group stages its largest all-reduce the same
    // way (per rank, and once per group for thread ranks).
    let tp = knobs.tensor_parallel.max(1) as u64;
    let micro_tokens = knobs.micro * seq_len;
    let tp_elems = states.traffic.map_or(0, |t| t.max_elems(micro_tokens)) as u64;
    let (per_elem, tp_shared) = match knobs.backend {
        Backend::Single => (0, 0),
        Backend::Threads => (8, 8 * tp_elems),
        Backend::Mpi => (4, 0),
    };
    let tp_staging = states.traffic.map_or(0, |t| t.staging_bytes(micro_tokens, per_elem));
    // Thread ranks: one process holds every rank of every stage: T
    // data-parallel groups per stage, P × D tensor-parallel groups.
    let all_ranks = knobs.ranks_per_process >= knobs.world_size;
    let n_stages = states.stages.len() as u64;
    let comm_shared: u64 = match all_ranks {
        true => tp * states.stages.iter().map(|st| staging(st).1).sum::<u64>() + n_stages * dp as u64 * tp_shared,
        false => staging(&states.stages[0]).1 + tp_shared,
    };
    let tokens = (plan.train.n_samples() + plan.val.n_samples()) as u64 * whole_len as u64;
    let (p, g) = (4 * states.n_params, 4 * states.n_trainable);
    let state = states.slots * g;
    let mut out: Vec<Estimate> = states
        .stages
        .iter()
        .zip(&specs)
        .map(|(st, spec)| {
            let report = &st.report;
            let (comm_staging, _) = staging(st);
            let activations = match &states.stack {
                Some(_) => states.family.stage_activation_bytes(knobs.micro, seq_len, build, spec),
                None => states.family.activation_bytes(knobs.micro, seq_len, build),
            };
            let p2p = states.stack.as_ref().map_or(0, |stack| {
                pipeline::p2p_bytes(spec, stack, knobs.micro * seq_len, states.embedding_grads as usize)
            });
            // Rank 0 gathers the full parameters and optimizer state (the
            // other stages copy theirs to send to it; with tensor
            // parallelism it holds its own copy too and receives its
            // group's T parts of one buffer at a time — the parameters, then
            // each state slot); an offloaded state is read back one slot
            // file at a time.
            let offloaded_slot = (report.offloaded as u64).checked_div(states.slots).unwrap_or(0);
            // Sharded parameters or state are gathered one padded segment at a time.
            let gather = if knobs.zero_stage >= 1 { 4 * report.max_collective_elems as u64 } else { 0 };
            let own = 4 * st.n_params + 4 * states.slots * st.n_trainable;
            let parts = if tp > 1 { own + tp * 4 * st.n_params } else { 0 };
            // A checkpoint written in the background takes a copy of the
            // moving average (rank 0's) with it.
            let ema = if cfg.train.ema_decay > 0.0 && spec.stage == 0 { g } else { 0 };
            let ema_copy = if cfg.train.checkpoint_async { ema } else { 0 };
            // Sharded: every rank writes its share from where it lies — an
            // offloaded slot read back, the state converted to f32 where it
            // is not (8-bit, factored), a piece's values and bytes — and the
            // final model is the last checkpoint. A load reads one whole
            // segment (this rank's values in it) and one piece at a time,
            // then each slot as the rank holds it.
            // One slot as the rank holds it: its shard, each segment's piece
            // rounded up to the optimizer's block (8-bit: 2048).
            let resident = 4 * match knobs.zero_stage >= 1 {
                true => st.n_trainable.div_ceil(dp as u64) + states.n_segments * states.align,
                false => st.n_trainable,
            };
            // 8-bit and factored state is converted to and from f32 every
            // slot at once.
            let converted = if states.converted { states.slots * resident } else { 0 };
            let piece = 8 * states.largest_tensor;
            // Rank 0 also merges every rank's list of pieces into the manifest.
            let manifest = if spec.stage == 0 { states.manifest_bytes(knobs.world_size) } else { 0 };
            let checkpoint = match (cfg.train.checkpoint_sharded, spec.stage) {
                (true, _) => offloaded_slot + converted + piece + WRITE_BUFFERS + manifest,
                (false, 0) => p + state + parts + gather + offloaded_slot + WRITE_BUFFERS + ema_copy,
                (false, _) => own + gather + offloaded_slot,
            };
            let load_buffers = match cfg.train.checkpoint_sharded {
                true => 4 * states.largest_segment + piece + resident.max(converted),
                false => 0,
            };
            let model_states = (report.params + report.master + report.grads + report.optimizer + report.comm_buffers)
                as u64
                + comm_staging
                + tp_staging;
            Estimate {
                knobs,
                accumulation_steps,
                stage: spec.stage,
                blocks: (spec.blocks.start, spec.blocks.end),
                in_flight: spec.in_flight,
                stage_params: st.n_params,
                params: report.params as u64,
                master: report.master as u64,
                grads: report.grads as u64,
                optimizer: report.optimizer as u64,
                comm_buffers: report.comm_buffers as u64,
                comm_staging,
                tp_staging,
                comm_shared,
                other_ranks: 0,
                activations: u64::try_from(activations).unwrap_or(u64::MAX),
                p2p,
                // inputs (u32) and targets (i32) of K micro-batches.
                batches: 8 * (accumulation_steps * knobs.micro * seq_len) as u64,
                data: 4 * tokens,
                runtime: runtime_bytes(),
                checkpoint,
                // Loading: the weights file's bytes beside the parameters,
                // then the optimizer file's bytes beside its converted
                // values; afterwards the loaded state is held while every
                // rank allocates its model states (counted below).
                load: model_states + load_buffers,
                workspace: WORKSPACE_PER_THREAD * compute_threads(cfg) as u64,
                frozen: frozen_bytes(plan),
                // Rank 0 averages every trainable weight (the only layouts
                // it runs in are unsplit: one stage).
                ema,
                checkpoint_rank: checkpoint,
                load_rank: model_states + load_buffers,
            }
        })
        .collect();
    // The process's other ranks, and the model states every rank of the
    // process allocates while the loaded state is held.
    let rpp = knobs.ranks_per_process as u64;
    let stage_ranks = knobs.stage_ranks() as u64;
    let ranks_total: u64 = out.iter().map(|e| stage_ranks * e.per_rank()).sum();
    let states_total: u64 = out.iter().map(|e| stage_ranks * e.load).sum();
    let read = p + p.max(2 * state);
    // The process's ranks checkpoint at once when each writes its own share.
    let writers = if cfg.train.checkpoint_sharded {
        if all_ranks {
            knobs.world_size as u64
        } else {
            rpp
        }
    } else {
        1
    };
    for e in &mut out {
        let (others, held) = match all_ranks {
            true => (ranks_total - e.per_rank(), states_total),
            false => ((rpp - 1) * e.per_rank(), e.load * rpp),
        };
        e.other_ranks = others;
        e.checkpoint *= writers;
        // Sharded: no rank reads or holds the whole state.
        e.load = match cfg.train.checkpoint_sharded {
            true => held + comm_shared,
            false => read.max(p + state + held + comm_shared),
        };
    }
    Ok((out, schedule))
}

/// Bytes of the frozen base packed outside the parameters (0: none).
pub fn frozen_bytes(plan: &Plan) -> u64 {
    plan.family.frozen_bytes().map_or(0, |f| u64::try_from(f.bytes).unwrap_or(u64::MAX))
}

/// The compute threads a run uses: `train.threads`, or the pool's default.
pub fn compute_threads(cfg: &config::Config) -> usize {
    if cfg.train.threads > 0 {
        cfg.train.threads
    } else {
        rayon::current_num_threads()
    }
}

/// Micro-batch sizes that keep the global batch: `micro · W` divides it.
pub fn micro_candidates(global: usize, world_size: usize) -> Vec<usize> {
    let per_rank = if global.is_multiple_of(world_size.max(1)) { global / world_size.max(1) } else { 0 };
    (1..=per_rank).rev().filter(|&m| per_rank.is_multiple_of(m)).collect()
}

/// The largest micro-batch whose per-process bytes fit `budget`, if any.
pub fn largest_fitting(plan: &Plan, knobs: Knobs, budget: u64) -> Result<Option<Estimate>> {
    fitting_at(plan, knobs, budget, &model_states(plan, knobs)?)
}

/// [`largest_fitting`] with the engine's accounting already made.
fn fitting_at(plan: &Plan, knobs: Knobs, budget: u64, states: &States) -> Result<Option<Estimate>> {
    for micro in micro_candidates(plan.batch.global, knobs.data_parallel()) {
        let e = estimate_at(plan, Knobs { micro, ..knobs }, states)?;
        if e.needed() <= budget {
            return Ok(Some(e));
        }
    }
    Ok(None)
}

/// Bytes as `12.3 GiB`.
pub fn human(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// The memory check of a training plan: per-process need against what is available.
pub fn check_memory(plan: &Plan) -> Result<()> {
    let cfg = &plan.cfg;
    let advice = "use a smaller batch.micro (more batch.accumulation_steps keep the global batch), train.activation_checkpointing = \"blocks\", a higher dist.zero_stage with more ranks, train.precision = bf16, or a smaller model (`macrobatch plan` shows what fits)";
    // Shapes whose byte counts overflow 64 bits cannot be planned element by
    // element; their parameters alone rule them out.
    let n_params = plan.family.n_params();
    let threads = memory::allocating_threads(compute_threads(cfg), plan.backend.ranks_per_process());
    if n_params > (u64::MAX / 64) as u128 {
        return memory::check("this run", 4 * n_params, threads, &format!("{n_params} parameters × 4 bytes"), advice);
    }
    let e = estimate(plan, Knobs::of(plan))?;
    let auto = if plan.memory_budget.is_some() { " (chosen by batch.micro = \"auto\")" } else { "" };
    let mut stage = match e.knobs.pipeline_parallel {
        0 | 1 => String::new(),
        p => format!(
            " (pipeline stage {} of {p}, the peak; layers {}–{})",
            e.stage,
            e.blocks.0,
            e.blocks.1.saturating_sub(1)
        ),
    };
    if e.knobs.tensor_parallel > 1 {
        stage += &format!(
            " (a tensor rank of {}: {} parameters of the stage, {} bytes of tensor-parallel staging)",
            e.knobs.tensor_parallel, e.stage_params, e.tp_staging
        );
    }
    let breakdown = format!(
        "{n_params} parameters; per rank{stage} {} bytes of parameters, gradients and optimizer state at ZeRO stage {} in {}, {} bytes of collective buffers and {} bytes of activations for batch.micro = {}{auto} × seq {} (checkpointing {}); {} rank(s) in this process; {} bytes at the peak of all phases (a step: {}, + {} while a checkpoint or the model is saved), + the {}% + {} MiB margin",
        e.params + e.master + e.grads + e.optimizer,
        cfg.dist.zero_stage,
        cfg.train.precision,
        e.comm_buffers,
        e.activations,
        plan.batch.micro,
        plan.train.seq_len(),
        cfg.train.activation_checkpointing,
        e.knobs.ranks_per_process,
        e.per_process(),
        e.step_peak(),
        e.checkpoint,
        MARGIN_PERCENT,
        MARGIN_FIXED >> 20
    );
    memory::check("this run", e.needed() as u128, threads, &breakdown, advice)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dist.overlap_comm` on two thread ranks adds the second group's
    /// staging (its own and the group's shared) and the f32 copies in
    /// flight: this small model's whole gradient (below the 50 MiB floor);
    /// nothing else moves, and one rank plans nothing for it.
    #[test]
    fn overlap_comm_plans_its_copies_and_second_group() {
        use super::measure::plan;
        use super::tensor_shapes::GPT;
        let at = |world: usize, on: bool| {
            let set = format!("dist.overlap_comm={on}");
            let pl = plan(&[GPT, &["batch.global=8", "batch.micro=1", &set]].concat(), world);
            estimate(&pl, Knobs::of(&pl)).unwrap()
        };
        let (off, on) = (at(2, false), at(2, true));
        assert_eq!(on.comm_staging, 2 * off.comm_staging + off.grads);
        assert_eq!(on.comm_shared, 2 * off.comm_shared);
        assert_eq!(
            (on.params, on.grads, on.optimizer, on.activations),
            (off.params, off.grads, off.optimizer, off.activations)
        );
        let (one_off, one_on) = (at(1, false), at(1, true));
        assert_eq!(one_off.comm_staging, one_on.comm_staging);
    }

    #[test]
    fn micro_candidates_keep_the_global_batch() {
        assert_eq!(micro_candidates(16, 2), [8, 4, 2, 1]);
        assert_eq!(micro_candidates(12, 1), [12, 6, 4, 3, 2, 1]);
        assert!(micro_candidates(10, 4).is_empty());
    }
}
