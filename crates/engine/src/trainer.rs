//! One optimizer step: K micro-steps accumulated into the flat gradient
//! buffer, then — once, at the boundary — the gradient collective,
//! normalisation, clipping, the optimizer update and the schedule step, for
//! every ZeRO stage.

use crate::alloc::{try_copy, try_zeros};
use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::model::Model;
use crate::offload::{window_len, OffloadedState, WINDOW_ELEMS};
use crate::optim::{split, Optimizer, Piece, CHUNK};
use crate::precision::Precision;
use crate::scaler::{LossScaler, LossScalerConfig};
use crate::schedule::LrSchedule;
use crate::store::{GradSpace, ParamStore, SegmentGrads, SegmentView, Written};
use crate::zero::{Accumulation, Partition, Reduction, Stage, UpdateSharding, ZeroConfig};
use comm::Communicator;
use rayon::prelude::*;
use std::ops::Range;

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
        }
    }
}

/// What one optimizer step reports.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// 0-based index of the step just taken.
    pub step_idx: u64,
    /// Global-batch mean loss (never divided by K).
    pub loss: f64,
    /// Mean loss of each micro-batch (NaN for a micro-batch without targets).
    pub micro_losses: Vec<f64>,
    /// Number of targets in the global batch.
    pub n_targets: u64,
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
    /// Seconds spent inside the model's micro-steps (forward + backward).
    pub model_s: f64,
    /// The gradient overflowed (f16): nothing was updated, the scale backed off.
    pub skipped: bool,
    /// Loss scale used by this step (1 without f16).
    pub loss_scale: f32,
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
}

impl MemoryReport {
    /// Parameters + gradients + optimizer state + master weights.
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer + self.master
    }
}

/// Owns the flat parameter and gradient buffers (or this rank's shards of
/// them), the optimizer and the schedule.
#[derive(Debug)]
pub struct Trainer {
    /// Elements of the largest collective buffer (memory accounting).
    max_collective: usize,
    layout: ParamLayout,
    part: Partition,
    stage: Stage,
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
}

/// The 16-bit parameter copy of mixed precision at stages 0–2.
#[derive(Debug, Clone)]
struct ModelCopy {
    bits: Vec<u16>,
    decoded: Vec<f32>,
    decoded_seg: Option<usize>,
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
        let init = |seg: usize| segments.get(seg).map(|r| params[r.clone()].to_vec()).unwrap_or_default();
        Self::distributed_with(model, &init, optimizer, schedule, options, zero, comm)
    }

    /// [`Trainer::distributed`] with the initial values produced one segment
    /// at a time by `init(seg)`: at ZeRO-3 no rank ever holds all parameters,
    /// not even while starting.
    pub fn distributed_with<M: Model>(
        model: &M,
        init: &dyn Fn(usize) -> Vec<f32>,
        optimizer: Optimizer,
        schedule: LrSchedule,
        options: TrainerOptions,
        zero: ZeroConfig,
        comm: &mut dyn Communicator,
    ) -> Result<Self, EngineError> {
        let layout = model.layout().clone();
        let stage = Stage::new(zero)?;
        let space = GradSpace::new(&layout, model.segments())?;
        let (rank, world) = if stage.shards_optimizer() { (comm.rank(), comm.world_size()) } else { (0, 1) };
        let part = Partition::new(space, rank, world);
        let precision = options.precision;
        let master_sharded = master_sharded(stage, precision);
        let sizes = BufferSizes::new(&part, stage, precision, options.bucket_elems);
        let mut model_copy = (precision.is_low() && !stage.shards_parameters()).then(|| ModelCopy {
            bits: vec![0u16; sizes.model_copy],
            decoded: vec![0.0; sizes.decoded],
            decoded_seg: None,
        });
        // Segment by segment: rank 0's values to everyone; keep all of it,
        // or this rank's piece.
        let mut params = Vec::with_capacity(sizes.params);
        for j in 0..part.n_segments() {
            let r = part.segment(j);
            let mut seg = init(j);
            if seg.len() != r.len() {
                return Err(EngineError::ParamCount { expected: r.len(), got: seg.len() });
            }
            comm.broadcast(&mut seg, 0).map_err(|source| EngineError::Comm { step: 0, source })?;
            if let Some(c) = model_copy.as_mut() {
                precision.encode(&seg, &mut c.bits[r.clone()]);
            }
            if master_sharded {
                let own = part.owned(j, rank);
                let piece = &seg[own.start - r.start..own.end - r.start];
                params.extend_from_slice(piece);
                params.resize(params.len() + part.piece[j] - piece.len(), 0.0);
            } else {
                params.extend_from_slice(&seg);
            }
        }
        let optimizer = optimizer.with_len(sizes.optimizer);
        let grads = vec![0.0; sizes.grads];
        let seg_grads = vec![0.0; sizes.seg_grads];
        let gathered = vec![0.0; sizes.gathered];
        let scaler = (precision == Precision::F16).then(|| LossScaler::new(options.loss_scaler));
        let update = update_chunks(&part, &layout, stage, master_sharded);
        Ok(Self {
            max_collective: sizes.max_collective,
            update,
            written: vec![false; layout.tensors().len()],
            layout,
            part,
            stage,
            params,
            grads,
            seg_grads,
            gathered,
            gathered_seg: None,
            scratch: vec![0.0; sizes.scratch],
            model_copy,
            scaler,
            optimizer,
            offload: None,
            schedule,
            options,
            n_steps: 0,
            grad_scale: 1.0,
        })
    }

    /// The partitioning in force.
    pub fn zero(&self) -> ZeroConfig {
        self.stage.config()
    }

    /// The ZeRO stage in force.
    pub fn stage(&self) -> Stage {
        self.stage
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

    /// Every parameter, assembled from the shards where sharded (a
    /// collective there: every rank must call it).
    pub fn full_params(&mut self, comm: &mut dyn Communicator) -> Result<Vec<f32>, EngineError> {
        if !self.master_sharded() {
            return Ok(self.params.clone());
        }
        self.gather_params(comm, true)
    }

    /// [`Trainer::full_params`] for rank 0 only: the other ranks take part in
    /// the collectives but never hold more than one segment (`None`).
    pub fn full_params_to_rank0(&mut self, comm: &mut dyn Communicator) -> Result<Option<Vec<f32>>, EngineError> {
        let keep = comm.rank() == 0;
        if !self.master_sharded() {
            return Ok(if keep { Some(try_copy(&self.params, "the full parameters")?) } else { None });
        }
        let full = self.gather_params(comm, keep)?;
        Ok(keep.then_some(full))
    }

    /// Assembles every parameter from every rank's parameter shard.
    fn gather_params(&self, comm: &mut dyn Communicator, keep: bool) -> Result<Vec<f32>, EngineError> {
        let mut full = try_zeros(if keep { self.layout.n_params() } else { 0 }, "the full parameters")?;
        let w = self.part.world_size;
        for j in 0..self.part.n_segments() {
            let seg = self.part.segment(j);
            let mut buf = vec![0.0; self.part.piece[j] * w];
            comm.all_gather(&self.params[self.part.shard_range(j)], &mut buf)
                .map_err(|source| EngineError::Comm { step: self.n_steps, source })?;
            if keep {
                full[seg.clone()].copy_from_slice(&buf[..seg.len()]);
            }
        }
        Ok(full)
    }

    /// Assembles a full gradient-space buffer from every rank's gradient shard.
    fn gather_grad_space(
        &self,
        comm: &mut dyn Communicator,
        shard: &[f32],
        keep: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let mut full = try_zeros(if keep { self.part.space.n_grads } else { 0 }, "a full gradient-space buffer")?;
        let w = self.part.world_size;
        for j in 0..self.part.n_segments() {
            let t = self.part.grad_piece[j];
            if t == 0 {
                continue;
            }
            let mut buf = vec![0.0; t * w];
            comm.all_gather(&shard[self.part.grad_shard_range(j)], &mut buf)
                .map_err(|source| EngineError::Comm { step: self.n_steps, source })?;
            if keep {
                for r in 0..w {
                    let own = self.part.grad_owned(j, r);
                    full[own.clone()].copy_from_slice(&buf[r * t..r * t + own.len()]);
                }
            }
        }
        Ok(full)
    }

    /// The gradient the last optimizer step applied (normalised and
    /// clipped), in the gradient space: all of it with local accumulation
    /// (for stage 2 only this rank's pieces are reduced), this rank's
    /// shard with per-segment reduction.
    pub fn gradient(&self) -> Vec<f32> {
        let s = self.grad_scale;
        self.grads.iter().map(|g| g * s).collect()
    }

    /// The full gradient the last step applied, in the gradient space,
    /// assembled from the shards at stages ≥ 2 (a collective there: every
    /// rank must call it).
    pub fn full_gradient(&mut self, comm: &mut dyn Communicator) -> Result<Vec<f32>, EngineError> {
        let raw = match (self.stage.reduction(), self.stage.accumulation()) {
            (Reduction::AllReduce, _) => return Ok(self.gradient()),
            (_, Accumulation::Local) => {
                let mut shard = vec![0.0; self.part.grad_shard_len()];
                self.part.gather_own_grads(&self.grads, &mut shard);
                self.gather_grad_space(comm, &shard, true)?
            }
            (_, Accumulation::PerSegment) => self.gather_grad_space(comm, &self.grads, true)?,
        };
        Ok(raw.into_iter().map(|g| g * self.grad_scale).collect())
    }

    /// Number of optimizer steps taken: the schedule's position.
    pub fn n_steps(&self) -> u64 {
        self.n_steps
    }

    /// The optimizer (its state covers this rank's shard at stages ≥ 1).
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    /// Bytes this rank holds for model states and collectives.
    /// The [`Trainer::memory`] a trainer of `model` would report on rank 0
    /// of `world_size` ranks, computed from the layout alone: nothing is
    /// allocated, so shapes too large for this machine can be planned.
    /// `optimizer_slots`: f32 state values per trainable parameter (AdamW 2);
    /// `bucket_elems`: [`TrainerOptions::bucket_elems`].
    pub fn planned_memory<M: Model>(
        model: &M,
        zero: ZeroConfig,
        world_size: usize,
        precision: Precision,
        optimizer_slots: usize,
        bucket_elems: usize,
        offload: bool,
    ) -> Result<MemoryReport, EngineError> {
        let stage = Stage::new(zero)?;
        let space = GradSpace::new(model.layout(), model.segments())?;
        let world = if stage.shards_optimizer() { world_size.max(1) } else { 1 };
        let part = Partition::new(space, 0, world);
        let s = BufferSizes::new(&part, stage, precision, bucket_elems);
        let state = 4 * optimizer_slots * s.optimizer;
        Ok(match offload {
            true => s.report(precision, 4 * optimizer_slots * window_len(s.optimizer, WINDOW_ELEMS), state),
            false => s.report(precision, state, 0),
        })
    }

    /// Moves the optimizer state to files in `dir` (one per state slot,
    /// removed when the trainer is dropped): each update then streams it
    /// window by window ([`Optimizer::update_offloaded`]), bit-identical to
    /// the in-memory update. A no-op for an optimizer without state.
    pub fn offload_optimizer(&mut self, dir: &std::path::Path) -> Result<(), EngineError> {
        self.offload_optimizer_windowed(dir, WINDOW_ELEMS)
    }

    /// [`Trainer::offload_optimizer`] with windows of `window` elements
    /// (tests use small ones to cross many window boundaries).
    pub fn offload_optimizer_windowed(&mut self, dir: &std::path::Path, window: usize) -> Result<(), EngineError> {
        if self.offload.is_some() {
            return Ok(());
        }
        let bufs = self.optimizer.state_buffers();
        if bufs.is_empty() {
            return Ok(());
        }
        let names: Vec<&'static str> = bufs.iter().map(|(n, _)| *n).collect();
        let values: Vec<&[f32]> = bufs.iter().map(|(_, b)| *b).collect();
        let disk = OffloadedState::create(dir, &names, self.optimizer.state_len(), window, &values)?;
        self.optimizer.release_state();
        self.offload = Some(disk);
        Ok(())
    }

    /// The offloaded optimizer state, if any.
    pub fn offloaded(&self) -> Option<&OffloadedState> {
        self.offload.as_ref()
    }

    pub fn memory(&self) -> MemoryReport {
        let copy = self.model_copy.as_ref();
        let sizes = BufferSizes {
            params: self.params.len(),
            model_copy: copy.map_or(0, |c| c.bits.len()),
            decoded: copy.map_or(0, |c| c.decoded.len()),
            optimizer: 0,
            grads: self.grads.len(),
            seg_grads: self.seg_grads.len(),
            gathered: self.gathered.len(),
            scratch: self.scratch.len(),
            max_collective: self.max_collective,
        };
        let (resident, offloaded) = self.offload.as_ref().map_or((0, 0), |d| (d.resident_bytes(), d.offloaded_bytes()));
        sizes.report(self.options.precision, self.optimizer.state_bytes() + resident, offloaded)
    }

    /// The full optimizer state by name, in the gradient space (trainable
    /// tensors only), assembled from every rank's shard (a collective at
    /// stages ≥ 1), for checkpoints; ranks other than 0 get empty buffers
    /// unless `all_ranks`.
    pub fn full_optimizer_state(
        &mut self,
        comm: &mut dyn Communicator,
        all_ranks: bool,
    ) -> Result<Vec<(String, Vec<f32>)>, EngineError> {
        let keep = all_ranks || comm.rank() == 0;
        let mut out = Vec::new();
        for name in self.optimizer.slot_names() {
            let disk = match self.offload.as_mut() {
                Some(d) => Some(d.read_all(name)?),
                None => None,
            };
            let buf = match &disk {
                Some(v) => v.as_slice(),
                None => self.optimizer.state_buffers().into_iter().find(|(n, _)| *n == name).map_or(&[][..], |b| b.1),
            };
            let full = if self.stage.shards_optimizer() {
                self.gather_grad_space(comm, buf, keep)?
            } else {
                try_copy(buf, "the full optimizer state")?
            };
            out.push((name.to_string(), full));
        }
        Ok(out)
    }

    /// Restores a checkpointed state from full buffers (each rank keeps its
    /// pieces): parameters, optimizer state (gradient space) and the number
    /// of steps taken.
    pub fn restore(
        &mut self,
        params: Vec<f32>,
        n_steps: u64,
        n_updates: u64,
        optimizer_state: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        if params.len() != self.layout.n_params() {
            return Err(EngineError::ParamCount { expected: self.layout.n_params(), got: params.len() });
        }
        self.restore_optimizer(n_steps, n_updates, optimizer_state)?;
        self.set_params(params)
    }

    /// [`Trainer::restore`] for a trainer already built from the
    /// checkpoint's parameters: the optimizer state and the schedule position.
    pub fn restore_optimizer(
        &mut self,
        n_steps: u64,
        n_updates: u64,
        mut optimizer_state: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        let (part, sharded, n_grads) = (&self.part, self.stage.shards_optimizer(), self.part.space.n_grads);
        let shard_of = |full: Vec<f32>| {
            if !sharded {
                return full;
            }
            let mut shard = vec![0.0; part.grad_shard_len()];
            part.gather_own_grads(&full, &mut shard);
            shard
        };
        if let Some(disk) = self.offload.as_mut() {
            for (i, name) in self.optimizer.slot_names().into_iter().enumerate() {
                let full = optimizer_state(name).ok_or(EngineError::MissingState { name })?;
                if full.len() != n_grads {
                    return Err(EngineError::ParamCount { expected: n_grads, got: full.len() });
                }
                disk.write_all(i, &shard_of(full))?;
            }
            self.optimizer.set_n_updates(n_updates);
            self.n_steps = n_steps;
            return Ok(());
        }
        let mut err = None;
        self.optimizer.restore(n_updates, |name| {
            let full = optimizer_state(name)?;
            if full.len() != n_grads {
                err = Some(EngineError::ParamCount { expected: n_grads, got: full.len() });
                return None;
            }
            Some(shard_of(full))
        })?;
        if let Some(e) = err {
            return Err(e);
        }
        self.n_steps = n_steps;
        Ok(())
    }

    /// Replaces the parameters (e.g. `--init-from` a pretrained model, or a
    /// checkpoint) from a full buffer; each rank keeps what it holds.
    pub fn set_params(&mut self, params: Vec<f32>) -> Result<(), EngineError> {
        if params.len() != self.layout.n_params() {
            return Err(EngineError::ParamCount { expected: self.layout.n_params(), got: params.len() });
        }
        if let Some(c) = self.model_copy.as_mut() {
            self.options.precision.encode(&params, &mut c.bits);
            c.decoded_seg = None;
        }
        self.params = if self.master_sharded() {
            let mut shard = vec![0.0; self.part.shard_len()];
            self.part.gather_own(&params, &mut shard);
            shard
        } else {
            params
        };
        Ok(())
    }

    /// The learning rate the next step will use.
    pub fn next_lr(&self) -> f32 {
        self.schedule.lr(self.n_steps)
    }

    /// FNV-1a hash of the resident parameter bits.
    pub fn params_checksum(&self) -> u64 {
        fnv1a(self.params.iter().flat_map(|x| x.to_bits().to_le_bytes()))
    }

    /// Errors unless every rank holds bit-identical parameters (stages 0–2;
    /// at stage 3 each rank holds a different shard by design).
    pub fn check_params_agree(&mut self, comm: &mut dyn Communicator) -> Result<(), EngineError> {
        if self.stage.shards_parameters() {
            return Ok(());
        }
        let h = match (&self.model_copy, self.master_sharded()) {
            // Mixed precision, stages 1–2: the replicated 16-bit copy must agree.
            (Some(c), true) => fnv1a(c.bits.iter().flat_map(|x| x.to_le_bytes())),
            _ => self.params_checksum(),
        };
        // Four 16-bit pieces: exact in f32, so the all-gather carries the hash losslessly.
        let mine: Vec<f32> = (0..4).map(|i| ((h >> (16 * i)) & 0xffff) as f32).collect();
        let mut all = vec![0.0f32; 4 * comm.world_size()];
        comm.all_gather(&mine, &mut all).map_err(|source| EngineError::Comm { step: self.n_steps, source })?;
        let checksums: Vec<u64> =
            all.chunks(4).map(|c| c.iter().enumerate().fold(0u64, |h, (i, &x)| h | ((x as u64) << (16 * i)))).collect();
        if checksums.iter().any(|&c| c != checksums[0]) {
            return Err(EngineError::RanksDiverged { step: self.n_steps, checksums });
        }
        Ok(())
    }

    /// Whether this rank holds only its shard of the f32 parameters (the
    /// master weights): stage 3, and stages 1–2 under mixed precision. Then
    /// [`Trainer::full_params`] is a collective.
    pub fn master_sharded(&self) -> bool {
        master_sharded(self.stage, self.options.precision)
    }

    /// A store over this trainer's buffers for one pass of the model.
    fn store<'a>(&'a mut self, comm: &'a mut dyn Communicator, with_grads: bool) -> StepStore<'a> {
        StepStore {
            part: &self.part,
            stage: self.stage,
            with_grads,
            precision: self.options.precision,
            model_copy: self.model_copy.as_mut(),
            params: &self.params,
            grads: &mut self.grads,
            seg_grads: &mut self.seg_grads,
            gathered: &mut self.gathered,
            gathered_seg: &mut self.gathered_seg,
            written: &mut self.written,
            scratch: &mut self.scratch,
            comm,
            step: self.n_steps + 1,
        }
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
        let comm_err = |source| EngineError::Comm { step: step_idx + 1, source };
        let (n_micro, world) = (micro_batches.len(), comm.world_size());
        let before = comm.counters();
        // The loss scale of this step: fixed until the boundary.
        let loss_scale = self.scaler.map_or(1.0, |s| s.scale);
        let seed = self.backward_seeds(model, comm, micro_batches, loss_scale)?;

        // Accumulate: K micro-steps add into the gradient buffers; at
        // stages 0–2 (local accumulation) nothing is communicated.
        self.begin_accumulation();
        let (mut loss_sum, mut n_targets, mut model_s) = (0.0f64, 0u64, 0.0);
        let mut micro_losses = Vec::with_capacity(n_micro);
        for (micro_step_idx, (batch, seed)) in micro_batches.iter().zip(seed.per_micro).enumerate() {
            let t0 = std::time::Instant::now();
            let stats = model.micro_step(&mut self.store(comm, true), batch, seed).map_err(|e| EngineError::Model {
                step: step_idx + 1,
                micro_step_idx,
                source: Box::new(e),
            })?;
            model_s += t0.elapsed().as_secs_f64();
            loss_sum += stats.loss_sum;
            n_targets += stats.n_targets;
            micro_losses.push(stats.loss_sum / stats.n_targets as f64);
        }
        self.end_accumulation();

        // The boundary: everything below runs exactly once per optimizer step.
        let micro_mean_sum: f64 = micro_losses.iter().filter(|l| l.is_finite()).sum();
        let n_valid_micro = micro_losses.iter().filter(|l| l.is_finite()).count();
        let mut stats = [loss_sum, n_targets as f64, micro_mean_sum, n_valid_micro as f64];
        comm.all_reduce_sum_f64(&mut stats).map_err(comm_err)?;
        let [loss_sum, n_targets, micro_mean_sum, n_valid_micro] = stats;
        let n_targets = n_targets as u64;
        let loss = match self.options.normalization {
            LossNormalization::Token if n_targets > 0 => loss_sum / n_targets as f64,
            LossNormalization::MicroBatchMean if n_valid_micro > 0.0 => micro_mean_sum / (n_micro * world) as f64,
            _ => return Err(EngineError::NoTargets { step: step_idx + 1 }),
        };
        // What turns the accumulated buffer into the gradient of the mean
        // loss: what the seeds left to do, and the loss scale undone
        // (unscaled before the norm, and so before clipping).
        let normalize = match (self.options.normalization, seed.divided_by_targets) {
            (LossNormalization::Token, false) => 1.0 / n_targets as f64,
            _ => 1.0,
        } / loss_scale as f64;

        self.reduce_gradients(comm).map_err(comm_err)?;
        let grad_norm = self.global_norm(comm).map_err(comm_err)? * normalize;
        let report = |grad_norm, clipped, skipped, lr, comm: &mut dyn Communicator| {
            let after = comm.counters();
            StepReport {
                step_idx,
                loss,
                micro_losses: micro_losses.clone(),
                n_targets,
                n_micro_steps: n_micro,
                grad_norm,
                clipped,
                lr,
                comm_bytes: after.bytes_sent - before.bytes_sent,
                comm_calls: after.n_calls - before.n_calls,
                model_s,
                skipped,
                loss_scale,
            }
        };
        if !grad_norm.is_finite() {
            // The norm is global (all ranks reduced the same values), so every
            // rank takes this branch together: under f16 the step is skipped —
            // no parameter, optimizer state or schedule position changes.
            let Some(scaler) = self.scaler.as_mut() else {
                return Err(EngineError::NonFiniteGradient { step: step_idx + 1, norm: grad_norm });
            };
            scaler.update(true);
            return Ok(report(grad_norm, false, true, self.schedule.lr(step_idx), comm));
        }
        let clip_coef = self.options.grad_clip.map_or(1.0, |max_norm| clip_coefficient(grad_norm, max_norm));
        self.grad_scale = (normalize * clip_coef) as f32;
        let lr = self.schedule.lr(step_idx);
        self.apply_update(lr)?;
        self.share_updated_params(comm).map_err(comm_err)?;
        if let Some(s) = self.scaler.as_mut() {
            s.update(false);
        }
        self.n_steps += 1;
        Ok(report(grad_norm, clip_coef < 1.0, false, lr, comm))
    }

    /// The factor each micro-step seeds its backward with. Token
    /// normalisation under f16: `loss_scale / N_global` (the targets of the
    /// whole global batch, counted before the first micro-step with one
    /// scalar collective), so gradients have a mean loss's magnitude and the
    /// scaler's range is not spent on the token count. Otherwise f32/bf16
    /// seed 1 and divide by `N_global` at the boundary; the tutorials'
    /// micro-batch mean seeds `1 / (n_k · K · W)`.
    fn backward_seeds<M: Model>(
        &self,
        model: &M,
        comm: &mut dyn Communicator,
        micro_batches: &[M::Batch],
        loss_scale: f32,
    ) -> Result<Seeds, EngineError> {
        let n_micro = micro_batches.len();
        match self.options.normalization {
            LossNormalization::Token if self.scaler.is_some() => {
                let mut n = [micro_batches.iter().map(|b| model.n_targets(b)).sum::<u64>() as f64];
                comm.all_reduce_sum_f64(&mut n)
                    .map_err(|source| EngineError::Comm { step: self.n_steps + 1, source })?;
                let seed = if n[0] > 0.0 { (loss_scale as f64 / n[0]) as f32 } else { 0.0 };
                Ok(Seeds { per_micro: vec![seed; n_micro], divided_by_targets: true })
            }
            LossNormalization::Token => Ok(Seeds { per_micro: vec![loss_scale; n_micro], divided_by_targets: false }),
            LossNormalization::MicroBatchMean => {
                let k_w = (n_micro * comm.world_size()) as f64;
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
        if self.stage.accumulation() == Accumulation::PerSegment {
            self.grads.par_chunks_mut(CHUNK).for_each(|c| c.fill(0.0));
        }
    }

    /// After the last micro-step: a tensor the model never wrote contributed zero.
    fn end_accumulation(&mut self) {
        if self.stage.accumulation() == Accumulation::Local {
            let mut w = Written { space: &self.part.space, flags: &mut self.written };
            for j in 0..self.part.n_segments() {
                w.clear_unwritten(j, &mut self.grads[self.part.space.grad_segments[j].clone()]);
            }
        }
    }

    /// The boundary's gradient collective: afterwards `self.grads` holds
    /// this rank's part of the global sum (all of it after an all-reduce).
    fn reduce_gradients(&mut self, comm: &mut dyn Communicator) -> Result<(), comm::CommError> {
        match self.stage.reduction() {
            Reduction::AllReduce => {
                for bucket in self.grads.chunks_mut(self.options.bucket_elems.max(1)) {
                    comm.all_reduce_sum(bucket)?;
                }
            }
            Reduction::ReduceScatter => {
                // Each segment: pack, reduce-scatter, and this rank's reduced
                // piece back into its own range of the local buffer.
                let w = self.part.world_size;
                for j in 0..self.part.n_segments() {
                    let t = self.part.grad_piece[j];
                    if t == 0 {
                        continue; // nothing trainable: no communication
                    }
                    let g = self.part.space.grad_segments[j].clone();
                    self.scratch[..g.len()].copy_from_slice(&self.grads[g]);
                    self.part.pack_grads_in_place(j, &mut self.scratch[..t * w]);
                    let mut out = vec![0.0; t];
                    comm.reduce_scatter_sum(&self.scratch[..t * w], &mut out)?;
                    let own = self.part.grad_owned(j, self.part.rank);
                    self.grads[own.clone()].copy_from_slice(&out[..own.len()]);
                }
            }
            Reduction::Done => {}
        }
        Ok(())
    }

    /// The L2 norm of the global (reduced, unnormalised) gradient: local
    /// when every rank holds all of it, else a sum of the shards' squares.
    fn global_norm(&self, comm: &mut dyn Communicator) -> Result<f64, comm::CommError> {
        if self.stage.reduction() == Reduction::AllReduce {
            return Ok(grad_norm(&self.grads));
        }
        let mut sq = [match self.stage.accumulation() {
            Accumulation::PerSegment => sum_of_squares(&self.grads),
            Accumulation::Local => (0..self.part.n_segments())
                .map(|j| sum_of_squares(&self.grads[self.part.grad_owned(j, self.part.rank)]))
                .sum(),
        }];
        comm.all_reduce_sum_f64(&mut sq)?;
        Ok(sq[0].sqrt())
    }

    /// The optimizer update of this rank's part (every trainable parameter
    /// at stage 0), reading the gradient scaled by `grad_scale`.
    fn apply_update(&mut self, lr: f32) -> Result<(), EngineError> {
        let ranges: Vec<Range<usize>> = self.update.iter().map(|c| c.params.clone()).collect();
        let grads = &self.grads;
        let pieces: Vec<Piece<'_>> = split(&mut self.params, &ranges)
            .into_iter()
            .zip(&self.update)
            .map(|(params, c)| Piece {
                params,
                grads: &grads[c.grads..c.grads + c.params.len()],
                state: c.state..c.state + c.params.len(),
                decay: c.decay,
            })
            .collect();
        match self.offload.as_mut() {
            Some(disk) => self.optimizer.update_offloaded(pieces, lr, self.grad_scale, disk),
            None => {
                self.optimizer.update_pieces(pieces, lr, self.grad_scale);
                Ok(())
            }
        }
    }

    /// After the update: stages 1–2 all-gather every rank's updated
    /// (trainable) pieces of each segment into every rank's parameters — the
    /// f32 ones, or under mixed precision the 16-bit copy the model reads;
    /// stage 0 re-encodes its 16-bit copy; stage 3 keeps only its shard.
    fn share_updated_params(&mut self, comm: &mut dyn Communicator) -> Result<(), comm::CommError> {
        if !self.stage.gathers_after_update() {
            if let Some(c) = self.model_copy.as_mut() {
                self.options.precision.encode(&self.params, &mut c.bits);
                c.decoded_seg = None;
            }
            return Ok(());
        }
        let (w, rank, sharded) = (self.part.world_size, self.part.rank, self.master_sharded());
        for j in 0..self.part.n_segments() {
            let t = self.part.grad_piece[j];
            if t == 0 {
                continue; // frozen: never changes
            }
            // This rank's trainable values, packed like its gradient piece.
            let own = self.part.owned(j, rank);
            let mut mine = vec![0.0; t];
            let mut at = 0;
            for (pr, _, _) in self.part.space.trainable_runs(j, own.clone()) {
                let src = if sharded { self.part.shard_range(j).start + (pr.start - own.start) } else { pr.start };
                mine[at..at + pr.len()].copy_from_slice(&self.params[src..src + pr.len()]);
                at += pr.len();
            }
            let mut all = vec![0.0; t * w];
            comm.all_gather(&mine, &mut all)?;
            for r in 0..w {
                let mut at = r * t;
                for (pr, _, _) in self.part.space.trainable_runs(j, self.part.owned(j, r)) {
                    let vals = &all[at..at + pr.len()];
                    match self.model_copy.as_mut() {
                        Some(c) if sharded => self.options.precision.encode(vals, &mut c.bits[pr.clone()]),
                        _ => self.params[pr.clone()].copy_from_slice(vals),
                    }
                    at += pr.len();
                }
            }
        }
        if let Some(c) = self.model_copy.as_mut() {
            if !sharded {
                self.options.precision.encode(&self.params, &mut c.bits);
            }
            c.decoded_seg = None;
        }
        Ok(())
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

/// One piece of this rank's optimizer update: where its parameters,
/// gradient and optimizer state live, and whether weight decay applies.
#[derive(Debug, Clone)]
struct UpdateChunk {
    params: Range<usize>,
    grads: usize,
    state: usize,
    decay: bool,
}

/// The pieces of this rank's update, at most CHUNK elements each (the unit
/// of parallel work), fixed for the trainer's life.
fn update_chunks(part: &Partition, layout: &ParamLayout, stage: Stage, master_sharded: bool) -> Vec<UpdateChunk> {
    let runs = part.update_runs(UpdateSharding {
        params: master_sharded,
        grads: stage.accumulation() == Accumulation::PerSegment,
        state: stage.shards_optimizer(),
    });
    let mut chunks = Vec::with_capacity(runs.len());
    for r in runs {
        let decay = layout.tensors()[r.tensor].decay;
        for at in (0..r.len).step_by(CHUNK) {
            let m = CHUNK.min(r.len - at);
            chunks.push(UpdateChunk {
                params: r.param + at..r.param + at + m,
                grads: r.grad + at,
                state: r.state + at,
                decay,
            });
        }
    }
    chunks
}

/// Seeds of one step's backward passes.
struct Seeds {
    per_micro: Vec<f32>,
    /// The seeds already divide by the targets (global or per micro-batch).
    divided_by_targets: bool,
}

fn master_sharded(stage: Stage, precision: Precision) -> bool {
    stage.shards_parameters() || (precision.is_low() && stage.shards_optimizer())
}

/// Element counts of a trainer's buffers on one rank: what
/// [`Trainer::distributed_with`] allocates and [`Trainer::planned_memory`]
/// predicts (one definition, so the plan cannot drift from the engine).
#[derive(Debug, Clone, Copy)]
struct BufferSizes {
    /// f32 parameters (all, or this rank's shard).
    params: usize,
    /// 16-bit model copy (mixed precision, stages 0–2).
    model_copy: usize,
    /// One segment decoded from the 16-bit copy.
    decoded: usize,
    /// Optimizer-state elements per slot.
    optimizer: usize,
    /// Gradient accumulator.
    grads: usize,
    /// One segment's gradient awaiting its reduce-scatter (per-segment accumulation).
    seg_grads: usize,
    /// Stage 3's gathered segment.
    gathered: usize,
    /// Packing / result scratch of the reduction.
    scratch: usize,
    /// The largest buffer one collective carries.
    max_collective: usize,
}

impl BufferSizes {
    fn new(part: &Partition, stage: Stage, precision: Precision, bucket_elems: usize) -> Self {
        let world = part.world_size;
        let n_params = part.space.segments.last().map_or(0, |r| r.end);
        let low_copy = precision.is_low() && !stage.shards_parameters();
        let max_grad_padded = (0..part.n_segments()).map(|j| part.grad_piece[j] * world).max().unwrap_or(0);
        let max_grad_piece = part.grad_piece.iter().copied().max().unwrap_or(0);
        let per_segment = stage.accumulation() == Accumulation::PerSegment;
        let max_padded = (0..part.n_segments()).map(|j| part.piece[j] * world).max().unwrap_or(0);
        Self {
            params: if master_sharded(stage, precision) { part.shard_len() } else { n_params },
            model_copy: if low_copy { n_params } else { 0 },
            decoded: if low_copy { part.space.segments.iter().map(|r| r.len()).max().unwrap_or(0) } else { 0 },
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
        }
    }
}

fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The store a model sees during a step.
struct StepStore<'a> {
    part: &'a Partition,
    stage: Stage,
    with_grads: bool,
    precision: Precision,
    model_copy: Option<&'a mut ModelCopy>,
    params: &'a [f32],
    grads: &'a mut [f32],
    seg_grads: &'a mut [f32],
    gathered: &'a mut [f32],
    gathered_seg: &'a mut Option<usize>,
    written: &'a mut [bool],
    scratch: &'a mut [f32],
    comm: &'a mut dyn Communicator,
    step: u64,
}

/// Segment `seg`'s gradient buffer during a step: its range of the local
/// accumulator, or the front of the transient per-segment buffer.
fn grad_buf<'b>(
    part: &Partition,
    stage: Stage,
    grads: &'b mut [f32],
    seg_grads: &'b mut [f32],
    seg: usize,
) -> &'b mut [f32] {
    let g = part.space.grad_segments[seg].clone();
    match stage.accumulation() {
        Accumulation::Local => &mut grads[g],
        Accumulation::PerSegment => &mut seg_grads[..g.len()],
    }
}

impl ParamStore for StepStore<'_> {
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError> {
        if seg >= self.part.n_segments() {
            return Err(EngineError::NoSuchSegment { seg });
        }
        let r = self.part.segment(seg);
        let n = r.len();
        if self.stage.shards_parameters() && *self.gathered_seg != Some(seg) {
            // Just before use: every rank's piece of this segment.
            let s = self.part.piece[seg];
            let w = self.part.world_size;
            self.comm
                .all_gather(&self.params[self.part.shard_range(seg)], &mut self.gathered[..s * w])
                .map_err(|source| EngineError::Comm { step: self.step, source })?;
            *self.gathered_seg = Some(seg);
            // Mixed precision: the model reads the segment in 16 bits.
            self.precision.round(&mut self.gathered[..n]);
        }
        let params: &[f32] = match self.model_copy.as_deref_mut() {
            _ if self.stage.shards_parameters() => &self.gathered[..n],
            Some(c) => {
                if c.decoded_seg != Some(seg) {
                    self.precision.decode(&c.bits[r.clone()], &mut c.decoded[..n]);
                    c.decoded_seg = Some(seg);
                }
                &c.decoded[..n]
            }
            None => &self.params[r],
        };
        if !self.with_grads {
            return Ok(SegmentView { params, grads: SegmentGrads::none() });
        }
        let buf = grad_buf(self.part, self.stage, self.grads, self.seg_grads, seg);
        let grads = Written { space: &self.part.space, flags: self.written }.into_view(seg, buf);
        Ok(SegmentView { params, grads })
    }

    fn done(&mut self, seg: usize, backward: bool) -> Result<(), EngineError> {
        if self.with_grads && backward {
            let part = self.part;
            let buf = grad_buf(part, self.stage, self.grads, self.seg_grads, seg);
            let mut written = Written { space: &part.space, flags: self.written };
            written.clear_unwritten(seg, buf);
            let t = part.grad_piece[seg];
            if self.stage.accumulation() == Accumulation::PerSegment && t > 0 {
                // Reduce-scatter this segment's gradient now; accumulate this
                // rank's piece into the shard accumulator.
                let w = part.world_size;
                part.pack_grads_in_place(seg, &mut self.seg_grads[..t * w]);
                let out = &mut self.scratch[..t];
                self.comm
                    .reduce_scatter_sum(&self.seg_grads[..t * w], out)
                    .map_err(|source| EngineError::Comm { step: self.step, source })?;
                let acc = &mut self.grads[part.grad_shard_range(seg)];
                acc.iter_mut().zip(out.iter()).for_each(|(a, o)| *a += o);
                // Reduced and accumulated: the transient buffer is free again.
                Written { space: &part.space, flags: self.written }.reset(seg);
            }
        }
        if self.stage.shards_parameters() {
            *self.gathered_seg = None; // released: the buffer is reused by the next segment
        }
        Ok(())
    }
}

fn scale(buf: &mut [f32], factor: f32) {
    buf.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x *= factor));
}

/// `torch.nn.utils.clip_grad_norm_`'s factor: `max_norm / (norm + 1e-6)`, capped at 1.
fn clip_coefficient(norm: f64, max_norm: f32) -> f64 {
    (max_norm as f64 / (norm + 1e-6)).min(1.0)
}

/// L2 norm of a flat buffer, accumulated in f64 over fixed chunks summed in
/// order, so the result does not depend on the number of threads.
pub fn grad_norm(grads: &[f32]) -> f64 {
    let partial: Vec<f64> = grads.par_chunks(CHUNK).map(sum_of_squares).collect();
    partial.iter().sum::<f64>().sqrt()
}

/// Σ x² in f64 over 8 interleaved accumulators: a fixed summation order (so
/// the result is the same on every run and thread count) that vectorises.
fn sum_of_squares(xs: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] += c[i] as f64 * c[i] as f64;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&x| x as f64 * x as f64).sum();
    acc.iter().sum::<f64>() + tail
}

/// `torch.nn.utils.clip_grad_norm_`: scale by `max_norm / (norm + 1e-6)` when
/// that factor is below 1. Returns the pre-clip norm and whether it clipped.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> (f64, bool) {
    let norm = grad_norm(grads);
    let coef = clip_coefficient(norm, max_norm);
    if coef < 1.0 {
        scale(grads, coef as f32);
        (norm, true)
    } else {
        (norm, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_matches_torch_semantics() {
        // norm of [3, 4] is 5; clip to 1 → factor 1/(5+1e-6).
        let mut g = vec![3.0f32, 4.0];
        let (norm, clipped) = clip_grad_norm(&mut g, 1.0);
        assert_eq!(norm, 5.0);
        assert!(clipped);
        assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
        let mut g = vec![0.3f32, 0.4];
        assert_eq!(clip_grad_norm(&mut g, 1.0), (0.500_000_011_920_929, false));
        assert_eq!(g, vec![0.3, 0.4]);
    }
}
