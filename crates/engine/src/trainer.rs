//! One optimizer step: K micro-steps accumulated into the flat gradient
//! buffer, then — once, at the boundary — the gradient collective,
//! normalisation, clipping, the optimizer update and the schedule step, for
//! every ZeRO stage.
//!
//! The trainer's other concerns live in submodules over the same private
//! buffers: `step_store` (the store a model sees during a step), `boundary`
//! (collective, norm, update, sharing), `clip`, `memory` (accounting),
//! `state` (gather for checkpoints, restore) and `offload` (optimizer state
//! on disk).

mod boundary;
mod clip;
mod decay;
mod memory;
mod offload;
mod overlap;
mod pipeline;
mod state;
pub use state::Held;
mod step_store;
mod tensor;

pub use clip::{clip_grad_norm, grad_norm};
pub use memory::MemoryReport;
pub use overlap::OverlapReport;
pub use pipeline::PipelineStage;

use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::model::Model;
use crate::optim::offload::OffloadedState;
use crate::optim::{Optimizer, CHUNK};
use crate::precision::Precision;
use crate::scaler::{LossScaler, LossScalerConfig};
use crate::schedule::LrSchedule;
use crate::store::{GradSpace, Written};
use crate::zero::{Accumulation, Partition, ZeroConfig, ZeroStage};
use boundary::{state_runs, update_chunks, UpdateChunk};
use comm::Communicator;
use memory::BufferSizes;
use rayon::prelude::*;
use std::borrow::Cow;

/// The initial values of model segment `seg`, asked for one segment at a
/// time: borrowed from parameters already in memory (copied once, into the
/// trainer), or made on the spot.
pub type InitSegment<'a> = dyn Fn(usize) -> Cow<'a, [f32]> + 'a;

/// How the accumulated gradient is normalised at the boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossNormalization {
    /// Mean over all target tokens of the global batch (docs/contract.md, batch contract; default).
    /// K micro-steps then equal one big batch even when micro-batches hold
    /// different numbers of targets.
    #[default]
    Token,
    /// The tutorials' minimal recipe: each micro-batch's mean loss divided by K.
    /// Wrong when micro-batches hold different numbers of targets; kept for
    /// comparison.
    MicroBatchMean,
}

/// Boundary settings of the trainer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainerOptions {
    /// `clip_grad_norm_` max norm; `None` disables clipping.
    pub grad_clip: Option<f32>,
    /// Loss normalisation.
    pub normalization: LossNormalization,
    /// Elements per gradient all-reduce bucket.
    pub bucket_elems: usize,
    /// Storage precision of the model's parameter copy (kernels compute in
    /// f32; the optimizer keeps f32 master weights).
    pub precision: Precision,
    /// Dynamic loss scaling (used with f16).
    pub loss_scaler: LossScalerConfig,
    /// Start the boundary's gradient collectives under the last
    /// micro-step's backward, on a thread of their own (stages 0–2 with
    /// more than one data rank; bit-identical results).
    pub overlap_comm: bool,
}

/// PyTorch DDP's default bucket: 25 MiB of f32.
pub const DEFAULT_BUCKET_ELEMS: usize = 25 * (1 << 20) / 4;

impl Default for TrainerOptions {
    fn default() -> Self {
        Self {
            grad_clip: None,
            normalization: LossNormalization::Token,
            bucket_elems: DEFAULT_BUCKET_ELEMS,
            precision: Precision::F32,
            loss_scaler: LossScalerConfig::default(),
            overlap_comm: false,
        }
    }
}

/// What one optimizer step reports.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// 0-based index of the step just taken.
    pub step_idx: u64,
    /// Global-batch mean loss (never divided by K): plain cross-entropy
    /// for a language model, whatever its [`crate::LossTerms`].
    pub loss: f64,
    /// What the training loss adds to `loss` per target token (label
    /// smoothing, z-loss; [`crate::MicroStepStats::aux_sum`] over the
    /// global batch's targets): the gradient is that of `loss + aux_loss`.
    pub aux_loss: f64,
    /// Mean loss of each micro-batch (NaN for a micro-batch without targets).
    pub micro_losses: Vec<f64>,
    /// Number of targets in the global batch.
    pub n_targets: u64,
    /// The model's own sums ([`crate::Model::take_aux_stats`]) over the
    /// global batch (zeros for a model that gathers none).
    pub aux: crate::AuxStats,
    /// Number of micro-steps taken.
    pub n_micro_steps: usize,
    /// Gradient L2 norm before clipping.
    pub grad_norm: f64,
    /// Whether clipping scaled the gradient.
    pub clipped: bool,
    /// Learning rate used by this step.
    pub lr: f32,
    /// Bytes this rank handed to collectives during the step.
    pub comm_bytes: u64,
    /// Collective calls during the step.
    pub comm_calls: u64,
    /// Seconds this rank spent inside the step's data-parallel collectives
    /// (gradient reduction, norm, ZeRO gathers), waiting for others included.
    pub comm_s: f64,
    /// Seconds spent inside the model's micro-steps (forward + backward).
    pub model_s: f64,
    /// Seconds of the forward-only pass over the step's micro-batches that
    /// gathers what the model needs before its first backward
    /// ([`crate::Model::step_stats_len`]: a mixture's global-batch routing
    /// counts), their all-reduce included; 0 without one.
    pub step_stats_s: f64,
    /// The model's sums over the step's whole batch
    /// ([`crate::Model::step_stats_len`]; empty without them).
    pub step_stats: Vec<f64>,
    /// The gradient overflowed (f16): nothing was updated, the scale backed off.
    pub skipped: bool,
    /// Loss scale used by this step (1 without f16).
    pub loss_scale: f32,
    /// Pipeline parallelism: the schedule's bubble and the time this rank
    /// waited for its neighbours.
    pub pipeline: Option<PipelineReport>,
    /// Tensor parallelism: this rank's all-reduces inside the model
    /// during the step (calls, bytes, seconds).
    pub tensor: Option<crate::tensor::TpTraffic>,
    /// Context parallelism: this rank's key/value gathers and gradient
    /// reduce-scatters inside attention during the step.
    pub context: Option<crate::tensor::TpTraffic>,
    /// `overlap_comm`: when this rank's gradient collectives ran, and how
    /// long the step waited for them (that wait is in `comm_s`).
    pub overlap: Option<OverlapReport>,
}

/// What a pipeline step reports.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PipelineReport {
    /// This rank's stage.
    pub stage: usize,
    /// The schedule's bubble: idle ticks over all ticks in its ideal
    /// timeline ((P−1)/(K+P−1)).
    pub bubble: f64,
    /// Measured seconds each stage (of this rank's pipeline) waited for
    /// activations or gradients from its neighbours during the step.
    pub idle_s: Vec<f64>,
    /// Bytes of activations and gradients this rank sent to its neighbours.
    pub p2p_bytes: u64,
}

/// Owns the flat parameter and gradient buffers (or this rank's shards of
/// them), the optimizer and the schedule.
#[derive(Debug)]
pub struct Trainer {
    /// Elements of the largest collective buffer (memory accounting).
    max_collective: usize,
    layout: ParamLayout,
    part: Partition,
    zero_stage: ZeroStage,
    /// Stages 0–2 in f32: every parameter; otherwise this rank's shard
    /// (the f32 master weights under mixed precision).
    params: Vec<f32>,
    /// Gradient space: the full local accumulator, or (per-segment
    /// reduction) the shard accumulator.
    grads: Vec<f32>,
    /// Per-segment reduction: one segment's gradient, room for `W·t_j`.
    seg_grads: Vec<f32>,
    /// Per tensor: its gradient already holds this step's values.
    written: Vec<bool>,
    /// Stage 3: the gathered segment (padded), and which one it is.
    gathered: Vec<f32>,
    gathered_seg: Option<usize>,
    /// Padding scratch for reduce-scatter inputs and outputs.
    scratch: Vec<f32>,
    /// This rank's tensor-parallel all-reduces since the last step report.
    tp_traffic: crate::tensor::TpTraffic,
    /// The context-parallel group's traffic this step.
    cp_traffic: crate::tensor::TpTraffic,
    /// Mixed precision (stages 0–2): the 16-bit parameter copy the model
    /// reads, one segment of it decoded for the kernels, and which.
    model_copy: Option<ModelCopy>,
    scaler: Option<LossScaler>,
    optimizer: Optimizer,
    /// The optimizer state's files when offloaded to disk (removed on drop).
    offload: Option<OffloadedState>,
    /// This rank's update, piece by piece (derived from the partition once).
    update: Vec<UpdateChunk>,
    schedule: LrSchedule,
    options: TrainerOptions,
    n_steps: u64,
    /// Factor the last step applied to the accumulated buffer.
    grad_scale: f32,
    /// `overlap_comm`: the gradient thread, started by the first step.
    overlap: Option<overlap::Overlap>,
}

/// The 16-bit parameter copy of mixed precision at stages 0–2, and the
/// segments decoded from it for the kernels. The largest segment (the
/// embedding, or an untied head) has a slot of its own, decoded once per
/// update and kept until the next; any other segment is decoded into a
/// shared slot on each use. The largest is read at both ends of every pass
/// (a tied head reads the embedding's segment after the last layer and
/// again before the layers' backward), so with one shared slot it was
/// decoded three or four times a micro-step: for a small model with a large
/// vocabulary, most of the step's conversion time. The slot costs the
/// second-largest segment's f32 values beside the largest's.
#[derive(Debug, Clone)]
struct ModelCopy {
    bits: Vec<u16>,
    /// The largest segment, its decoded values and whether they are current.
    pinned: Option<usize>,
    pinned_buf: Vec<f32>,
    pinned_current: bool,
    /// Any other segment's decoded values, and which segment they are.
    shared: Vec<f32>,
    shared_seg: Option<usize>,
}

/// The decoded slots of a 16-bit copy over `segments`: the largest segment
/// (the first of equals) and its length, and the longest of the others.
pub(crate) fn decode_slots(segments: &[std::ops::Range<usize>]) -> (Option<usize>, usize, usize) {
    let pinned = (0..segments.len()).rev().max_by_key(|&j| segments[j].len());
    let len = |j: usize| segments[j].len();
    let shared = (0..segments.len()).filter(|&j| Some(j) != pinned).map(len).max().unwrap_or(0);
    (pinned, pinned.map_or(0, len), shared)
}

impl ModelCopy {
    fn new(n_params: usize, segments: &[std::ops::Range<usize>]) -> Self {
        let (pinned, pinned_len, shared_len) = decode_slots(segments);
        Self {
            bits: vec![0u16; n_params],
            pinned,
            pinned_buf: vec![0.0; pinned_len],
            pinned_current: false,
            shared: vec![0.0; shared_len],
            shared_seg: None,
        }
    }

    /// The 16-bit values changed: nothing decoded is current.
    fn stale(&mut self) {
        self.pinned_current = false;
        self.shared_seg = None;
    }

    /// Elements held decoded (both slots).
    fn decoded_len(&self) -> usize {
        self.pinned_buf.len() + self.shared.len()
    }

    /// Segment `seg` (elements `r` of the copy) decoded, from its slot when
    /// current.
    fn decoded(&mut self, seg: usize, r: std::ops::Range<usize>, precision: Precision) -> &[f32] {
        let n = r.len();
        if Some(seg) == self.pinned {
            if !self.pinned_current {
                precision.decode(&self.bits[r], &mut self.pinned_buf[..n]);
                self.pinned_current = true;
            }
            return &self.pinned_buf[..n];
        }
        if self.shared_seg != Some(seg) {
            precision.decode(&self.bits[r], &mut self.shared[..n]);
            self.shared_seg = Some(seg);
        }
        &self.shared[..n]
    }
}

impl Trainer {
    /// A single-process trainer (no sharding).
    pub fn new<M: Model>(
        model: &M,
        params: Vec<f32>,
        optimizer: Optimizer,
        schedule: LrSchedule,
        options: TrainerOptions,
    ) -> Result<Self, EngineError> {
        Self::distributed(
            model,
            params,
            optimizer,
            schedule,
            options,
            ZeroConfig::default(),
            &mut comm::SingleProcess::new(),
        )
    }

    /// A trainer for this rank of `comm` from full initial parameters:
    /// rank 0's are broadcast so every rank starts alike, then partitioned
    /// as `zero` says. `optimizer` is resized to this rank's shard of the
    /// trainable parameters.
    pub fn distributed<M: Model>(
        model: &M,
        params: Vec<f32>,
        optimizer: Optimizer,
        schedule: LrSchedule,
        options: TrainerOptions,
        zero: ZeroConfig,
        comm: &mut dyn Communicator,
    ) -> Result<Self, EngineError> {
        if params.len() != model.layout().n_params() {
            return Err(EngineError::ParamCount { expected: model.layout().n_params(), got: params.len() });
        }
        let segments = model.segments();
        let init = |seg: usize| Cow::Borrowed(segments.get(seg).map_or(&[][..], |r| &params[r.clone()]));
        Self::distributed_with(model, &init, optimizer, schedule, options, zero, comm)
    }

    /// [`Trainer::distributed`] with the initial values produced one segment
    /// at a time by `init(seg)`: at ZeRO-3 no rank ever holds all parameters,
    /// not even while starting.
    pub fn distributed_with<M: Model>(
        model: &M,
        init: &InitSegment<'_>,
        optimizer: Optimizer,
        schedule: LrSchedule,
        options: TrainerOptions,
        zero: ZeroConfig,
        comm: &mut dyn Communicator,
    ) -> Result<Self, EngineError> {
        Self::build((model.layout().clone(), model.segments()), init, optimizer, schedule, options, zero, comm)
    }

    /// A trainer over `layout` cut into `segments` (a model's, or one
    /// pipeline stage's), initialised segment by segment.
    fn build(
        (layout, segments): (ParamLayout, Vec<std::ops::Range<usize>>),
        init: &InitSegment<'_>,
        optimizer: Optimizer,
        schedule: LrSchedule,
        options: TrainerOptions,
        zero: ZeroConfig,
        comm: &mut dyn Communicator,
    ) -> Result<Self, EngineError> {
        let stage = ZeroStage::new(zero)?;
        let space = GradSpace::new(&layout, segments)?;
        let (rank, world) = stage.partition_of(comm.rank(), comm.world_size());
        let part = Partition::aligned(space, rank, world, optimizer.state_size().shard_align());
        let precision = options.precision;
        let master_sharded = stage.shards_master(precision);
        let sizes = BufferSizes::new(&part, stage, precision, options.bucket_elems);
        let mut model_copy =
            stage.keeps_model_copy(precision).then(|| ModelCopy::new(sizes.model_copy, &part.space.segments));
        // Segment by segment: rank 0's values to everyone; keep all of it,
        // or this rank's piece.
        let mut params = Vec::with_capacity(sizes.params);
        let broadcast = |seg: &mut [f32], comm: &mut dyn Communicator| {
            comm.broadcast(seg, 0).map_err(|source| EngineError::Comm { step: 0, source })
        };
        for j in 0..part.n_segments() {
            let r = part.segment(j);
            let seg = init(j);
            if seg.len() != r.len() {
                return Err(EngineError::ParamCount { expected: r.len(), got: seg.len() });
            }
            if master_sharded {
                let mut seg = seg.into_owned();
                broadcast(&mut seg, comm)?;
                if let Some(c) = model_copy.as_mut() {
                    precision.encode(&seg, &mut c.bits[r.clone()]);
                }
                let own = part.owned(j, rank);
                let piece = &seg[own.start - r.start..own.end - r.start];
                params.extend_from_slice(piece);
                params.resize(params.len() + part.piece[j] - piece.len(), 0.0);
            } else {
                // Straight into the parameters: no copy of the segment
                // beside them (a pretrained embedding is the largest).
                let at = params.len();
                params.extend_from_slice(&seg);
                drop(seg);
                broadcast(&mut params[at..], comm)?;
                if let Some(c) = model_copy.as_mut() {
                    precision.encode(&params[at..], &mut c.bits[r.clone()]);
                }
            }
        }
        let optimizer =
            optimizer.for_state(sizes.optimizer, &state_runs(&part, &layout, stage.update_sharding(precision)))?;
        let grads = vec![0.0; sizes.grads];
        let seg_grads = vec![0.0; sizes.seg_grads];
        let gathered = vec![0.0; sizes.gathered];
        let scaler = (precision == Precision::F16).then(|| LossScaler::new(options.loss_scaler));
        let update = update_chunks(&part, &layout, stage.update_sharding(precision));
        Ok(Self {
            max_collective: sizes.max_collective,
            update,
            written: vec![false; layout.tensors().len()],
            layout,
            part,
            zero_stage: stage,
            params,
            grads,
            seg_grads,
            gathered,
            gathered_seg: None,
            scratch: vec![0.0; sizes.scratch],
            tp_traffic: Default::default(),
            cp_traffic: Default::default(),
            model_copy,
            scaler,
            optimizer,
            offload: None,
            schedule,
            options,
            n_steps: 0,
            grad_scale: 1.0,
            overlap: None,
        })
    }

    /// The partitioning in force.
    pub fn zero(&self) -> ZeroConfig {
        self.zero_stage.config()
    }

    /// The ZeRO stage in force.
    pub fn zero_stage(&self) -> ZeroStage {
        self.zero_stage
    }

    /// The segments and the gradient space (trainable tensors back to back).
    pub fn grad_space(&self) -> &GradSpace {
        &self.part.space
    }

    /// Parameters resident on this rank: all of them unless sharded
    /// (use [`Trainer::full_params`] there).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Number of optimizer steps taken: the schedule's position.
    pub fn n_steps(&self) -> u64 {
        self.n_steps
    }

    /// The optimizer (its state covers this rank's shard at stages ≥ 1).
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    /// The learning rate the next step will use.
    pub fn next_lr(&self) -> f32 {
        self.schedule.lr(self.n_steps)
    }

    /// Whether this rank holds only its shard of the f32 parameters (the
    /// master weights): stage 3, and stages 1–2 under mixed precision. Then
    /// [`Trainer::full_params`] is a collective.
    pub fn master_sharded(&self) -> bool {
        self.zero_stage.shards_master(self.options.precision)
    }

    /// Forward-only loss of `batch` with the current parameters. At stage 3
    /// this gathers segments: every rank must call it with its own batch.
    pub fn loss<M: Model>(
        &mut self,
        model: &mut M,
        comm: &mut dyn Communicator,
        batch: &M::Batch,
    ) -> Result<crate::MicroStepStats, EngineError> {
        let step = self.n_steps;
        if let Some(o) = self.overlap.as_mut() {
            o.abandon(); // a step that failed midway
        }
        model.loss(&mut self.store(comm, false), batch).map_err(|e| EngineError::Model {
            step,
            micro_step_idx: 0,
            source: Box::new(e),
        })
    }

    /// One optimizer step over this rank's `micro_batches` (K = its length;
    /// every rank must pass the same K). Reads as the step flow in
    /// ARCHITECTURE.md: accumulate, then once at the boundary reduce,
    /// measure, clip, update, share.
    pub fn step<M: Model>(
        &mut self,
        model: &mut M,
        comm: &mut dyn Communicator,
        micro_batches: &[M::Batch],
    ) -> Result<StepReport, EngineError> {
        if micro_batches.is_empty() {
            return Err(EngineError::NoMicroBatches);
        }
        let step_idx = self.n_steps;
        let step_t0 = std::time::Instant::now();
        if let Some(o) = self.overlap.as_mut() {
            o.abandon(); // a step that failed midway
        }
        model.begin_step(step_idx);
        let before = comm.counters();
        // The loss scale of this step: fixed until the boundary.
        let loss_scale = self.scaler.map_or(1.0, |s| s.scale);
        let mut groups = Groups { dp: comm, pipe: None, tp: None };
        let seeds = self.backward_seeds(model, &mut groups, micro_batches, loss_scale, true)?;
        let (step_stats_s, step_stats) = self.step_stats(model, &mut groups, micro_batches)?;

        // Accumulate: K micro-steps add into the gradient buffers; at
        // stages 0–2 (local accumulation) nothing is communicated.
        self.begin_accumulation();
        let overlap = self.overlap_applies(groups.dp.world_size());
        if overlap {
            self.overlap_start(groups.dp)?;
        }
        let mut acc = Accumulated::new(micro_batches.len());
        (acc.step_stats_s, acc.step_stats) = (step_stats_s, step_stats);
        let last = micro_batches.len() - 1;
        for (micro_step_idx, (batch, &loss_seed)) in micro_batches.iter().zip(&seeds.per_micro).enumerate() {
            let t0 = std::time::Instant::now();
            if let Some(o) = self.overlap.as_mut().filter(|_| overlap) {
                // A boundary reduction: only the last micro-step's backward
                // completes gradients; a per-segment one sends every `done`.
                let first = if o.per_segment() { 0 } else { last };
                if micro_step_idx == first {
                    o.begin(step_t0, self.part.n_segments());
                }
                o.next_micro_step();
            }
            let stats = model
                .micro_step(&mut self.store(groups.dp, true), batch, loss_seed)
                .map_err(|e| EngineError::Model { step: step_idx + 1, micro_step_idx, source: Box::new(e) })?;
            acc.model_s += t0.elapsed().as_secs_f64();
            acc.record(micro_step_idx, stats, model.take_aux_stats());
        }
        self.end_accumulation();
        if let Some(o) = self.overlap.as_mut().filter(|o| o.in_step()) {
            o.backward_ended();
            o.launch_rest(&self.part, &mut self.grads, step_idx + 1)?;
        }
        self.boundary(&mut groups, acc, &seeds, loss_scale, before)
    }

    /// The model's sums over the whole step's batch
    /// ([`Model::step_stats_len`]): a forward-only pass over this rank's
    /// micro-batches, all-reduced over the data-parallel ranks, handed to
    /// the model; its seconds (0 when the model needs none) and the sums.
    fn step_stats<M: Model>(
        &mut self,
        model: &mut M,
        groups: &mut Groups<'_>,
        micro_batches: &[M::Batch],
    ) -> Result<(f64, Vec<f64>), EngineError> {
        let len = model.step_stats_len();
        if len == 0 {
            return Ok((0.0, Vec::new()));
        }
        let (t0, step) = (std::time::Instant::now(), self.n_steps + 1);
        let mut sums = vec![0.0f64; len];
        for (micro_step_idx, batch) in micro_batches.iter().enumerate() {
            model
                .collect_step_stats(&mut self.store(groups.dp, false), batch, &mut sums)
                .map_err(|e| EngineError::Model { step, micro_step_idx, source: Box::new(e) })?;
        }
        groups.all_reduce_f64(&mut sums).map_err(|source| EngineError::Comm { step, source })?;
        model.set_step_stats(&sums);
        Ok((t0.elapsed().as_secs_f64(), sums))
    }

    /// The factor each micro-step seeds its backward with. Token
    /// normalisation under f16: `loss_scale / N_global` (the targets of the
    /// whole global batch, counted before the first micro-step with one
    /// scalar collective — by the ranks that `count`: with a pipeline, the
    /// last stage's), so gradients have a mean loss's magnitude and the
    /// scaler's range is not spent on the token count. Otherwise f32/bf16
    /// seed 1 and divide by `N_global` at the boundary; the tutorials'
    /// micro-batch mean seeds `1 / (n_k · K · W)` (W: the data-parallel ranks).
    fn backward_seeds<M: Model>(
        &self,
        model: &M,
        groups: &mut Groups<'_>,
        micro_batches: &[M::Batch],
        loss_scale: f32,
        count: bool,
    ) -> Result<Seeds, EngineError> {
        let n_micro = micro_batches.len();
        match self.options.normalization {
            LossNormalization::Token if self.scaler.is_some() => {
                let local = if count { micro_batches.iter().map(|b| model.n_targets(b)).sum::<u64>() } else { 0 };
                let mut n = [local as f64];
                groups.all_reduce_f64(&mut n).map_err(|source| EngineError::Comm { step: self.n_steps + 1, source })?;
                let loss_seed = if n[0] > 0.0 { (loss_scale as f64 / n[0]) as f32 } else { 0.0 };
                Ok(Seeds { per_micro: vec![loss_seed; n_micro], divided_by_targets: true })
            }
            LossNormalization::Token => Ok(Seeds { per_micro: vec![loss_scale; n_micro], divided_by_targets: false }),
            LossNormalization::MicroBatchMean => {
                let k_w = (n_micro * groups.dp.world_size()) as f64;
                let per_micro = micro_batches
                    .iter()
                    .map(|b| match model.n_targets(b) {
                        0 => 0.0,
                        n => loss_scale * (1.0 / (n as f64 * k_w)) as f32,
                    })
                    .collect();
                Ok(Seeds { per_micro, divided_by_targets: true })
            }
        }
    }

    /// Before micro-step 0: no tensor holds this step's gradient yet (the
    /// first write to each overwrites, so the local buffer is never zeroed);
    /// a shard accumulator is summed into, so it is.
    fn begin_accumulation(&mut self) {
        self.written.fill(false);
        if self.zero_stage.accumulation() == Accumulation::PerSegment {
            self.grads.par_chunks_mut(CHUNK).for_each(|c| c.fill(0.0));
        }
    }

    /// After the last micro-step: a tensor the model never wrote contributed zero.
    fn end_accumulation(&mut self) {
        if self.zero_stage.accumulation() == Accumulation::Local {
            let mut w = Written { space: &self.part.space, flags: &mut self.written };
            for j in 0..self.part.n_segments() {
                w.clear_unwritten(j, &mut self.grads[self.part.space.grad_segments[j].clone()]);
            }
        }
    }

    /// The loss scaler's state (f16 only).
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Restores the loss scaler's state from a checkpoint.
    pub fn set_loss_scaler(&mut self, scale: f32, good_steps: u64, hysteresis_left: u32, n_skipped: u64) {
        if let Some(s) = self.scaler.as_mut() {
            s.scale = scale;
            s.good_steps = good_steps;
            s.hysteresis_left = hysteresis_left;
            s.n_skipped = n_skipped;
        }
    }
}

/// The communicators of a step: the data-parallel group (gradients,
/// ZeRO) and, with a pipeline, the stages holding the same data.
pub(crate) struct Groups<'a> {
    pub(crate) dp: &'a mut dyn Communicator,
    pub(crate) pipe: Option<PipeGroup<'a>>,
    /// The tensor-parallel group, when tensors are split: the ranks of
    /// one (stage, data rank). Statistics are never reduced over it (every
    /// rank of it computed the same ones).
    pub(crate) tp: Option<tensor::TpGroup<'a>>,
}

/// The pipeline group of a step: this rank's stage among its `P` ranks.
pub(crate) struct PipeGroup<'a> {
    pub(crate) comm: &'a mut dyn Communicator,
    pub(crate) info: PipeInfo,
}

/// Where this rank's stage sits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PipeInfo {
    pub(crate) stage: usize,
    pub(crate) n_stages: usize,
    /// Both the first and the last stage hold the embedding (local segment 0).
    pub(crate) tied: bool,
}

impl PipeInfo {
    /// The last stage: it holds the head and the loss.
    pub(crate) fn last(&self) -> bool {
        self.stage + 1 == self.n_stages
    }
}

impl Groups<'_> {
    /// Sum over every rank: the data-parallel group, then the stages.
    fn all_reduce_f64(&mut self, buf: &mut [f64]) -> Result<(), comm::CommError> {
        self.dp.all_reduce_sum_f64(buf)?;
        if let Some(p) = self.pipe.as_mut() {
            p.comm.all_reduce_sum_f64(buf)?;
        }
        Ok(())
    }
}

/// What the micro-steps of one step gathered on this rank.
struct Accumulated {
    loss_sums: Vec<f64>,
    /// Σ over micro-steps of [`crate::MicroStepStats::aux_sum`].
    aux_sum: f64,
    n_targets: Vec<u64>,
    aux: crate::AuxStats,
    model_s: f64,
    step_stats_s: f64,
    step_stats: Vec<f64>,
    pipeline: Option<PipelineReport>,
    tensor: Option<crate::tensor::TpTraffic>,
    context: Option<crate::tensor::TpTraffic>,
    /// Filled by the boundary's gradient reduction under `overlap_comm`.
    overlap: Option<OverlapReport>,
}

impl Accumulated {
    fn new(n_micro: usize) -> Self {
        Accumulated {
            loss_sums: vec![0.0; n_micro],
            aux_sum: 0.0,
            n_targets: vec![0; n_micro],
            aux: [0.0; crate::AUX_STATS],
            model_s: 0.0,
            step_stats_s: 0.0,
            step_stats: Vec::new(),
            pipeline: None,
            tensor: None,
            context: None,
            overlap: None,
        }
    }

    fn record(&mut self, k: usize, stats: crate::MicroStepStats, aux: crate::AuxStats) {
        self.loss_sums[k] = stats.loss_sum;
        self.aux_sum += stats.aux_sum;
        self.n_targets[k] = stats.n_targets;
        self.aux.iter_mut().zip(aux).for_each(|(a, x)| *a += x);
    }

    /// Each micro-batch's mean loss on this data rank (NaN without
    /// targets); with a pipeline the last stage's, shared with the others.
    fn micro_losses(&mut self, groups: &mut Groups<'_>) -> Result<Vec<f64>, comm::CommError> {
        if let Some(p) = groups.pipe.as_mut() {
            let k = self.loss_sums.len();
            let mut v: Vec<f64> =
                self.loss_sums.iter().copied().chain(self.n_targets.iter().map(|&n| n as f64)).collect();
            if !p.info.last() {
                v.fill(0.0);
            }
            p.comm.all_reduce_sum_f64(&mut v)?;
            // The other stages added zeros: the last stage's values, exactly.
            self.loss_sums.copy_from_slice(&v[..k]);
            self.n_targets.iter_mut().zip(&v[k..]).for_each(|(n, &x)| *n = x as u64);
        }
        Ok(self.loss_sums.iter().zip(&self.n_targets).map(|(l, &n)| l / n as f64).collect())
    }
}

/// Loss seeds of one step's backward passes ([`Model::micro_step`]'s `loss_seed`).
struct Seeds {
    per_micro: Vec<f32>,
    /// The seeds already divide by the targets (global or per micro-batch).
    divided_by_targets: bool,
}

#[cfg(test)]
mod model_copy_tests {
    use super::{decode_slots, ModelCopy};
    use crate::precision::Precision;

    /// The largest segment (the first of equals) gets its own slot; the
    /// shared slot fits every other one.
    #[test]
    fn the_largest_segment_has_its_own_slot() {
        assert_eq!(decode_slots(&[0..10, 10..13, 13..23, 23..27]), (Some(0), 10, 10));
        assert_eq!(decode_slots(&[0..2, 2..9, 9..12]), (Some(1), 7, 3));
        assert_eq!(decode_slots(std::slice::from_ref(&(0..5))), (Some(0), 5, 0));
        assert_eq!(decode_slots(&[]), (None, 0, 0));
    }

    /// Each slot decodes the copy's current bits, the pinned one once until
    /// the copy goes stale, and the shared one whenever another segment
    /// took it.
    #[test]
    fn slots_decode_once_until_stale() {
        let segs = [0..4, 4..6, 6..9];
        let mut c = ModelCopy::new(9, &segs);
        let vals: Vec<f32> = (0..9).map(|i| i as f32).collect();
        Precision::Bf16.encode(&vals, &mut c.bits);
        let p = Precision::Bf16;
        assert_eq!(c.decoded(0, 0..4, p), &vals[0..4]);
        assert_eq!(c.decoded(1, 4..6, p), &vals[4..6]);
        assert_eq!(c.decoded(2, 6..9, p), &vals[6..9]);
        // New bits not yet marked stale: the pinned slot keeps what it
        // decoded, the shared slot re-decodes a segment it does not hold.
        let twice: Vec<f32> = vals.iter().map(|v| 2.0 * v).collect();
        Precision::Bf16.encode(&twice, &mut c.bits);
        assert_eq!(c.decoded(0, 0..4, p), &vals[0..4]);
        assert_eq!(c.decoded(1, 4..6, p), &twice[4..6]);
        c.stale();
        assert_eq!(c.decoded(0, 0..4, p), &twice[0..4]);
        assert_eq!(c.decoded_len(), 4 + 3);
    }
}
