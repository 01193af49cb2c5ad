//! One optimizer step: K micro-steps accumulated into the flat gradient
//! buffer, then — once, at the boundary — the gradient collective,
//! normalisation, clipping, the optimizer update and the schedule step, for
//! every ZeRO stage.

use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::model::Model;
use crate::optim::{chunk_runs, split, Optimizer, Piece, CHUNK};
use crate::precision::Precision;
use crate::scaler::{LossScaler, LossScalerConfig};
use crate::schedule::LrSchedule;
use crate::store::{ParamStore, SegmentView};
use crate::zero::{Partition, ZeroConfig};
use comm::Communicator;
use rayon::prelude::*;
use std::ops::Range;

/// How the accumulated gradient is normalised at the boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossNormalization {
    /// Mean over all target tokens of the global batch (SPEC §2; default).
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

/// Bytes this rank holds, by kind (SPEC §3's per-rank model states).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct MemoryReport {
    /// Parameters resident between steps (all at stages 0–2, the shard at 3).
    pub params: usize,
    /// Gradient buffers: the full local accumulator (stages 0–1, and 2 with
    /// local accumulation), or the shard accumulator.
    pub grads: usize,
    /// Optimizer state (AdamW's m and v; full at stage 0, the shard above).
    pub optimizer: usize,
    /// f32 master weights separate from the parameters (none while training in f32).
    pub master: usize,
    /// Buffers for collectives: one segment's gradient waiting for its
    /// reduce-scatter, stage 3's gathered segment, padding scratch.
    pub comm_buffers: usize,
    /// Largest parameter residency during a step: resident parameters plus
    /// the one gathered segment (stage 3).
    pub peak_param_residency: usize,
}

impl MemoryReport {
    /// Parameters + gradients + optimizer state + master weights.
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer + self.master
    }
}

/// Owns the flat parameter and gradient buffers (or this rank's shards of
/// them), the optimizer and the schedule.
#[derive(Debug, Clone)]
pub struct Trainer {
    layout: ParamLayout,
    part: Partition,
    zero: ZeroConfig,
    /// Stages 0–2: every parameter; stage 3: this rank's shard.
    params: Vec<f32>,
    /// The full local accumulator, or (per-segment reduction) the shard accumulator.
    grads: Vec<f32>,
    /// Per-segment reduction: one segment's gradient, padded to W·s_j.
    seg_grads: Vec<f32>,
    /// Which segments' gradient buffers hold this step's values; the others
    /// are written, not added to, on first use (no zeroing pass).
    written: Vec<bool>,
    /// Stage 3: the gathered segment (padded), and which one it is.
    gathered: Vec<f32>,
    gathered_seg: Option<usize>,
    /// Padding scratch for reduce-scatter inputs and outputs.
    scratch: Vec<f32>,
    /// Mixed precision (stages 0–2): the 16-bit parameter copy the model reads.
    model_copy: Vec<u16>,
    /// Mixed precision: one segment of it decoded for the kernels, and which.
    seg_params: Vec<f32>,
    decoded_seg: Option<usize>,
    scaler: Option<LossScaler>,
    optimizer: Optimizer,
    schedule: LrSchedule,
    options: TrainerOptions,
    n_steps: u64,
    /// Factor the last step applied to the accumulated buffer.
    grad_scale: f32,
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
    /// as `zero` says. `optimizer` is resized to this rank's shard.
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
        if zero.stage > 3 {
            return Err(EngineError::Zero(format!("dist.zero_stage = {} (use 0, 1, 2 or 3)", zero.stage)));
        }
        if zero.reduce_every_micro_step && zero.stage != 2 {
            return Err(EngineError::Zero("dist.reduce_every_micro_step applies to stage 2 only".into()));
        }
        let segments = model.segments();
        let covered = segments.iter().try_fold(0usize, |at, r| (r.start == at).then_some(r.end));
        if covered != Some(layout.n_params()) {
            return Err(EngineError::Zero("the model's segments must cover its parameters back to back".into()));
        }
        let world = if zero.stage == 0 { 1 } else { comm.world_size() };
        let rank = if zero.stage == 0 { 0 } else { comm.rank() };
        let part = Partition::new(segments, rank, world);
        let per_segment = zero.stage == 3 || zero.reduce_every_micro_step;
        let max_padded = (0..part.segments.len()).map(|j| part.piece[j] * world).max().unwrap_or(0);
        let shard_len = part.shard_len();
        // Segment by segment: rank 0's values to everyone; keep all of it, or
        // (stage 3) this rank's piece.
        let precision = options.precision;
        // The f32 master weights are sharded from stage 1 under mixed precision
        // (the model reads the 16-bit copy), and at stage 3 in any case.
        let master_sharded = zero.stage == 3 || (precision.is_low() && zero.stage >= 1);
        let has_copy = precision.is_low() && zero.stage < 3;
        let mut model_copy = vec![0u16; if has_copy { layout.n_params() } else { 0 }];
        let mut params = Vec::with_capacity(if master_sharded { shard_len } else { layout.n_params() });
        for (j, r) in part.segments.iter().enumerate() {
            let mut seg = init(j);
            if seg.len() != r.len() {
                return Err(EngineError::ParamCount { expected: r.len(), got: seg.len() });
            }
            comm.broadcast(&mut seg, 0).map_err(|source| EngineError::Comm { step: 0, source })?;
            if has_copy {
                precision.encode(&seg, &mut model_copy[r.clone()]);
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
        let optimizer = if zero.stage == 0 { optimizer } else { optimizer.with_len(shard_len) };
        let grads = vec![0.0; if per_segment { shard_len } else { layout.n_params() }];
        let seg_grads = if per_segment { vec![0.0; max_padded] } else { Vec::new() };
        let gathered = if zero.stage == 3 { vec![0.0; max_padded] } else { Vec::new() };
        // Stage 2 with local accumulation pads whole segments for reduce-scatter;
        // per-segment reduction only needs one piece for the result.
        let max_piece = part.piece.iter().copied().max().unwrap_or(0);
        let scratch_len = match (zero.stage, per_segment) {
            (2, false) => max_padded,
            (_, true) => max_piece,
            _ => 0,
        };
        let seg_params = vec![0.0; if has_copy { part.segments.iter().map(|r| r.len()).max().unwrap_or(0) } else { 0 }];
        let scaler = (precision == Precision::F16).then(|| LossScaler::new(options.loss_scaler));
        let n_segments = part.segments.len();
        Ok(Self {
            layout,
            part,
            zero,
            params,
            grads,
            seg_grads,
            written: vec![false; n_segments],
            gathered,
            gathered_seg: None,
            scratch: vec![0.0; scratch_len],
            model_copy,
            seg_params,
            decoded_seg: None,
            scaler,
            optimizer,
            schedule,
            options,
            n_steps: 0,
            grad_scale: 1.0,
        })
    }

    /// The partitioning in force.
    pub fn zero(&self) -> ZeroConfig {
        self.zero
    }

    /// Parameters resident on this rank: all of them at stages 0–2, the
    /// shard at stage 3 (use [`Trainer::full_params`] there).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Every parameter, assembled from the shards at stage 3 (a collective
    /// there: every rank must call it).
    pub fn full_params(&mut self, comm: &mut dyn Communicator) -> Result<Vec<f32>, EngineError> {
        if !self.master_sharded() {
            return Ok(self.params.clone());
        }
        self.gather_full(comm, &self.params, true)
    }

    /// [`Trainer::full_params`] for rank 0 only: the other ranks take part in
    /// the collectives but never hold more than one segment (`None`).
    pub fn full_params_to_rank0(&mut self, comm: &mut dyn Communicator) -> Result<Option<Vec<f32>>, EngineError> {
        let keep = comm.rank() == 0;
        if !self.master_sharded() {
            return Ok(keep.then(|| self.params.clone()));
        }
        let full = self.gather_full(comm, &self.params, keep)?;
        Ok(keep.then_some(full))
    }

    /// Assembles a full flat buffer from a shard-ordered buffer of every rank.
    fn gather_full(&self, comm: &mut dyn Communicator, shard: &[f32], keep: bool) -> Result<Vec<f32>, EngineError> {
        let mut full = vec![0.0; if keep { self.layout.n_params() } else { 0 }];
        let w = self.part.world_size;
        for j in 0..self.part.segments.len() {
            let seg = self.part.segments[j].clone();
            let mut buf = vec![0.0; self.part.piece[j] * w];
            comm.all_gather(&shard[self.part.shard_range(j)], &mut buf)
                .map_err(|source| EngineError::Comm { step: self.n_steps, source })?;
            if keep {
                full[seg.clone()].copy_from_slice(&buf[..seg.len()]);
            }
        }
        Ok(full)
    }

    /// The gradient the last optimizer step applied (normalised and
    /// clipped), computed on demand: the full gradient at stages 0–1 (and 2
    /// with local accumulation), this rank's shard otherwise.
    pub fn gradient(&self) -> Vec<f32> {
        let s = self.grad_scale;
        self.grads.iter().map(|g| g * s).collect()
    }

    /// The full gradient the last step applied, assembled from the shards
    /// at stages ≥ 2 (a collective there: every rank must call it).
    pub fn full_gradient(&mut self, comm: &mut dyn Communicator) -> Result<Vec<f32>, EngineError> {
        let raw = match (self.zero.stage, self.per_segment()) {
            (0 | 1, _) => return Ok(self.gradient()),
            (2, false) => {
                let mut shard = vec![0.0; self.part.shard_len()];
                self.part.gather_own(&self.grads, &mut shard);
                self.gather_full(comm, &shard, true)?
            }
            _ => self.gather_full(comm, &self.grads, true)?,
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
    pub fn memory(&self) -> MemoryReport {
        let gathered = 4 * self.gathered.len();
        // f32: the parameters are their own master copy. Mixed precision: the
        // model reads the 16-bit copy (stages 0–2) or rounded gathered
        // segments (stage 3); the f32 values are the master weights.
        let (params, master) = if self.options.precision.is_low() {
            (2 * self.model_copy.len(), 4 * self.params.len())
        } else {
            (4 * self.params.len(), 0)
        };
        MemoryReport {
            params,
            grads: 4 * self.grads.len(),
            optimizer: self.optimizer.state_bytes(),
            master,
            comm_buffers: gathered + 4 * (self.seg_grads.len() + self.scratch.len() + self.seg_params.len()),
            peak_param_residency: params + gathered + 4 * self.seg_params.len(),
        }
    }

    /// The full optimizer state by name, assembled from every rank's shard
    /// (a collective at stages ≥ 1), for checkpoints; ranks other than 0 get
    /// empty buffers unless `all_ranks`.
    pub fn full_optimizer_state(
        &mut self,
        comm: &mut dyn Communicator,
        all_ranks: bool,
    ) -> Result<Vec<(String, Vec<f32>)>, EngineError> {
        let keep = all_ranks || comm.rank() == 0;
        let names: Vec<&'static str> = self.optimizer.state_buffers().iter().map(|(n, _)| *n).collect();
        let mut out = Vec::new();
        for name in names {
            let buf: Vec<f32> = self
                .optimizer
                .state_buffers()
                .into_iter()
                .find(|(n, _)| *n == name)
                .map(|(_, b)| b.to_vec())
                .unwrap_or_default();
            if self.zero.stage == 0 {
                out.push((name.to_string(), buf));
            } else {
                out.push((name.to_string(), self.gather_full(comm, &buf, keep)?));
            }
        }
        Ok(out)
    }

    /// Restores a checkpointed state from full buffers (each rank keeps its
    /// pieces): parameters, optimizer state and the number of steps taken.
    pub fn restore(
        &mut self,
        params: Vec<f32>,
        n_steps: u64,
        n_updates: u64,
        mut optimizer_state: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        if params.len() != self.layout.n_params() {
            return Err(EngineError::ParamCount { expected: self.layout.n_params(), got: params.len() });
        }
        let part = self.part.clone();
        let stage = self.zero.stage;
        let to_shard = |full: Vec<f32>| -> Vec<f32> {
            if stage == 0 {
                return full;
            }
            let mut shard = vec![0.0; part.shard_len()];
            part.gather_own(&full, &mut shard);
            shard
        };
        let mut err = None;
        self.optimizer.restore(n_updates, |name| {
            let full = optimizer_state(name)?;
            if full.len() != params.len() {
                err = Some(EngineError::ParamCount { expected: params.len(), got: full.len() });
                return None;
            }
            Some(to_shard(full))
        })?;
        if let Some(e) = err {
            return Err(e);
        }
        self.set_params(params)?;
        self.n_steps = n_steps;
        Ok(())
    }

    /// Mixed precision with full master weights (stage 0): re-encodes the
    /// 16-bit copy the model reads.
    fn refresh_model_copy(&mut self) {
        if !self.model_copy.is_empty() && !self.master_sharded() {
            self.options.precision.encode(&self.params, &mut self.model_copy);
            self.decoded_seg = None;
        }
    }

    /// Replaces the parameters (e.g. `--init-from` a pretrained model, or a
    /// checkpoint) from a full buffer; each rank keeps what it holds.
    pub fn set_params(&mut self, params: Vec<f32>) -> Result<(), EngineError> {
        if params.len() != self.layout.n_params() {
            return Err(EngineError::ParamCount { expected: self.layout.n_params(), got: params.len() });
        }
        if !self.model_copy.is_empty() {
            self.options.precision.encode(&params, &mut self.model_copy);
            self.decoded_seg = None;
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
        self.params.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
            x.to_bits().to_le_bytes().iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
        })
    }

    /// Errors unless every rank holds bit-identical parameters (stages 0–2;
    /// at stage 3 each rank holds a different shard by design).
    pub fn check_params_agree(&mut self, comm: &mut dyn Communicator) -> Result<(), EngineError> {
        if self.zero.stage == 3 {
            return Ok(());
        }
        let h = if self.master_sharded() {
            // Mixed precision, stages 1–2: the replicated 16-bit copy must agree.
            self.model_copy.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
                x.to_le_bytes().iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
            })
        } else {
            self.params_checksum()
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
        self.zero.stage == 3 || (self.options.precision.is_low() && self.zero.stage >= 1)
    }

    fn per_segment(&self) -> bool {
        self.zero.stage == 3 || self.zero.reduce_every_micro_step
    }

    /// A store over this trainer's buffers for one pass of the model.
    fn store<'a>(&'a mut self, comm: &'a mut dyn Communicator, with_grads: bool) -> StepStore<'a> {
        let per_segment = self.per_segment();
        StepStore {
            part: &self.part,
            stage: self.zero.stage,
            per_segment,
            with_grads,
            precision: self.options.precision,
            model_copy: &self.model_copy,
            seg_params: &mut self.seg_params,
            decoded_seg: &mut self.decoded_seg,
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
    /// every rank must pass the same K). At stages 0–2 (local accumulation)
    /// communication happens only at the boundary; per-segment reduction
    /// (stage 3, or stage 2 with `reduce_every_micro_step`) reduce-scatters
    /// each segment's gradient as its backward completes.
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
        let n_micro = micro_batches.len();
        let world = comm.world_size();
        let before = comm.counters();

        // The loss scale of this step: fixed until the boundary.
        let loss_scale = self.scaler.map_or(1.0, |s| s.scale);
        // Micro-step 0 writes each segment's gradient, later ones add (the
        // store tells the model which: `fresh`), so the full buffer is never
        // zeroed. A shard accumulator (per-segment reduction) is summed into, so it is.
        self.written.fill(false);
        if self.per_segment() {
            self.grads.par_chunks_mut(CHUNK).for_each(|c| c.fill(0.0));
        }
        let mut loss_sum = 0.0f64;
        let mut n_targets = 0u64;
        let mut micro_losses = Vec::with_capacity(n_micro);
        let mut model_s = 0.0;
        for (micro_step_idx, batch) in micro_batches.iter().enumerate() {
            let grad_scale = loss_scale
                * match self.options.normalization {
                    LossNormalization::Token => 1.0,
                    LossNormalization::MicroBatchMean => match model.n_targets(batch) {
                        0 => 0.0,
                        n => 1.0 / (n as f64 * (n_micro * world) as f64) as f32,
                    },
                };
            let t0 = std::time::Instant::now();
            let stats = model
                .micro_step(&mut self.store(comm, true), batch, grad_scale)
                .map_err(|e| EngineError::Model { step: step_idx + 1, micro_step_idx, source: Box::new(e) })?;
            model_s += t0.elapsed().as_secs_f64();
            loss_sum += stats.loss_sum;
            n_targets += stats.n_targets;
            micro_losses.push(stats.loss_sum / stats.n_targets as f64);
        }

        if !self.per_segment() {
            // A model that left a segment untouched contributed zero to it.
            for (seg, r) in self.part.segments.iter().enumerate() {
                if !self.written[seg] {
                    self.grads[r.clone()].par_chunks_mut(CHUNK).for_each(|c| c.fill(0.0));
                }
            }
        }
        // The boundary: everything below runs exactly once per optimizer step.
        let comm_err = |source| EngineError::Comm { step: step_idx + 1, source };
        let micro_mean_sum: f64 = micro_losses.iter().filter(|l| l.is_finite()).sum();
        let n_valid_micro = micro_losses.iter().filter(|l| l.is_finite()).count();
        let mut stats = [loss_sum, n_targets as f64, micro_mean_sum, n_valid_micro as f64];
        comm.all_reduce_sum_f64(&mut stats).map_err(comm_err)?;
        let [loss_sum, n_targets, micro_mean_sum, n_valid_micro] = stats;
        let n_targets = n_targets as u64;
        let (loss, normalize) = match self.options.normalization {
            LossNormalization::Token => {
                if n_targets == 0 {
                    return Err(EngineError::NoTargets { step: step_idx + 1 });
                }
                (loss_sum / n_targets as f64, 1.0 / n_targets as f64)
            }
            LossNormalization::MicroBatchMean => {
                if n_valid_micro == 0.0 {
                    return Err(EngineError::NoTargets { step: step_idx + 1 });
                }
                (micro_mean_sum / (n_micro * world) as f64, 1.0)
            }
        };

        // Reduce the gradient: after this, `self.grads` holds this rank's
        // part of the global sum (all of it at stages 0–1).
        match (self.zero.stage, self.per_segment()) {
            (0 | 1, _) => {
                for bucket in self.grads.chunks_mut(self.options.bucket_elems.max(1)) {
                    comm.all_reduce_sum(bucket).map_err(comm_err)?;
                }
            }
            (2, false) => {
                // Reduce-scatter each segment; this rank's reduced piece goes
                // back into its own range of the local buffer.
                let w = self.part.world_size;
                for j in 0..self.part.segments.len() {
                    let seg = self.part.segments[j].clone();
                    let s = self.part.piece[j];
                    self.scratch[..seg.len()].copy_from_slice(&self.grads[seg.clone()]);
                    self.scratch[seg.len()..s * w].fill(0.0);
                    let mut out = vec![0.0; s];
                    comm.reduce_scatter_sum(&self.scratch[..s * w], &mut out).map_err(comm_err)?;
                    let own = self.part.owned(j, self.part.rank);
                    self.grads[own.clone()].copy_from_slice(&out[..own.len()]);
                }
            }
            _ => {} // per-segment: already reduced into the shard accumulator
        }

        // Norm of the global gradient: local at stages 0–1 (every rank holds
        // all of it), otherwise a sum of the shards' squares.
        let raw_norm = if self.zero.stage <= 1 {
            grad_norm(&self.grads)
        } else {
            let mut sq = [self.owned_sum_of_squares()];
            comm.all_reduce_sum_f64(&mut sq).map_err(comm_err)?;
            sq[0].sqrt()
        };
        // Unscale before the norm (and so before clipping).
        let normalize = normalize / loss_scale as f64;
        let grad_norm = raw_norm * normalize;
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
        let clip_coef = match self.options.grad_clip {
            Some(max_norm) => clip_coefficient(grad_norm, max_norm),
            None => 1.0,
        };
        let clipped = clip_coef < 1.0;
        self.grad_scale = (normalize * clip_coef) as f32;
        let lr = self.schedule.lr(step_idx);
        self.apply_update(lr)?;
        if (1..=2).contains(&self.zero.stage) {
            self.all_gather_params(comm).map_err(comm_err)?;
        }
        self.refresh_model_copy();
        if let Some(s) = self.scaler.as_mut() {
            s.update(false);
        }
        self.n_steps += 1;
        Ok(report(grad_norm, clipped, false, lr, comm))
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

    /// Σ g² over this rank's reduced gradient (its part of the global norm),
    /// read in place: the shard accumulator, or this rank's pieces of the
    /// full local buffer.
    fn owned_sum_of_squares(&self) -> f64 {
        if self.per_segment() {
            return sum_of_squares(&self.grads);
        }
        (0..self.part.segments.len()).map(|j| sum_of_squares(&self.grads[self.part.owned(j, self.part.rank)])).sum()
    }

    /// The optimizer update of this rank's part.
    fn apply_update(&mut self, lr: f32) -> Result<(), EngineError> {
        if self.zero.stage == 0 {
            self.optimizer.update(&self.layout, &mut self.params, &self.grads, lr, self.grad_scale);
            return Ok(());
        }
        // Runs of (param index, grad index, state index, len, decay) over the shard.
        let mut runs = Vec::new();
        let params_sharded = self.master_sharded();
        let grads_sharded = self.per_segment();
        for j in 0..self.part.segments.len() {
            let own = self.part.owned(j, self.part.rank);
            let base = self.part.shard_range(j).start;
            for t in self.layout.tensors() {
                let tr = t.range();
                let (a, b) = (tr.start.max(own.start), tr.end.min(own.end));
                if a < b {
                    let shard_idx = base + (a - own.start);
                    let p = if params_sharded { shard_idx } else { a };
                    let g = if grads_sharded { shard_idx } else { a };
                    runs.push((p, g, shard_idx, b - a, t.decay));
                }
            }
        }
        let chunks: Vec<(usize, usize, bool)> = chunk_runs(runs.iter().map(|&(p, _, _, n, d)| (p, n, d)));
        // Map each chunk back to its run to find the grad and state offsets.
        let mut pieces_meta = Vec::with_capacity(chunks.len());
        let mut run_idx = 0;
        for &(p, n, decay) in &chunks {
            while !(runs[run_idx].0 <= p && p < runs[run_idx].0 + runs[run_idx].3) {
                run_idx += 1;
            }
            let (rp, rg, rs, _, _) = runs[run_idx];
            let off = p - rp;
            pieces_meta.push((p..p + n, rg + off, rs + off, decay));
        }
        let ranges: Vec<Range<usize>> = pieces_meta.iter().map(|m| m.0.clone()).collect();
        let grads = &self.grads;
        let pieces: Vec<Piece<'_>> = split(&mut self.params, &ranges)
            .into_iter()
            .zip(&pieces_meta)
            .map(|(params, (r, g, s, decay))| Piece {
                params,
                grads: &grads[*g..*g + r.len()],
                state: *s..*s + r.len(),
                decay: *decay,
            })
            .collect();
        self.optimizer.update_pieces(pieces, lr, self.grad_scale);
        Ok(())
    }

    /// Stages 1–2: every rank's updated piece of each segment to every rank
    /// — into the full f32 parameters, or (mixed precision, master sharded)
    /// into the 16-bit copy the model reads, one segment at a time.
    fn all_gather_params(&mut self, comm: &mut dyn Communicator) -> Result<(), comm::CommError> {
        let w = self.part.world_size;
        let sharded = self.master_sharded();
        for j in 0..self.part.segments.len() {
            let seg = self.part.segments[j].clone();
            let s = self.part.piece[j];
            let mut mine = vec![0.0; s];
            if sharded {
                mine.copy_from_slice(&self.params[self.part.shard_range(j)]);
            } else {
                let own = self.part.owned(j, self.part.rank);
                mine[..own.len()].copy_from_slice(&self.params[own]);
            }
            let mut all = vec![0.0; s * w];
            comm.all_gather(&mine, &mut all)?;
            if sharded {
                self.options.precision.encode(&all[..seg.len()], &mut self.model_copy[seg]);
            } else {
                self.params[seg.clone()].copy_from_slice(&all[..seg.len()]);
            }
        }
        self.decoded_seg = None;
        Ok(())
    }
}

/// The store a model sees during a step.
struct StepStore<'a> {
    part: &'a Partition,
    stage: u8,
    per_segment: bool,
    with_grads: bool,
    precision: Precision,
    model_copy: &'a [u16],
    seg_params: &'a mut [f32],
    decoded_seg: &'a mut Option<usize>,
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

impl ParamStore for StepStore<'_> {
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError> {
        let r = self.part.segments.get(seg).ok_or(EngineError::NoSuchSegment { seg })?.clone();
        let n = r.len();
        if self.stage == 3 && *self.gathered_seg != Some(seg) {
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
        if !self.model_copy.is_empty() && *self.decoded_seg != Some(seg) {
            self.precision.decode(&self.model_copy[r.clone()], &mut self.seg_params[..n]);
            *self.decoded_seg = Some(seg);
        }
        let params: &[f32] = if self.stage == 3 {
            &self.gathered[..n]
        } else if !self.model_copy.is_empty() {
            &self.seg_params[..n]
        } else {
            &self.params[r.clone()]
        };
        let grads: &mut [f32] = if !self.with_grads {
            &mut []
        } else if self.per_segment {
            &mut self.seg_grads[..n]
        } else {
            &mut self.grads[r]
        };
        let fresh = self.with_grads && !self.written[seg];
        Ok(SegmentView { params, grads, fresh })
    }

    fn done(&mut self, seg: usize, grads_written: bool) -> Result<(), EngineError> {
        if self.per_segment && grads_written && self.with_grads {
            // Reduce-scatter this segment's gradient now; accumulate this
            // rank's piece into the shard accumulator.
            let n = self.part.segments[seg].len();
            let s = self.part.piece[seg];
            let w = self.part.world_size;
            self.seg_grads[n..s * w].fill(0.0);
            let out = &mut self.scratch[..s];
            self.comm
                .reduce_scatter_sum(&self.seg_grads[..s * w], out)
                .map_err(|source| EngineError::Comm { step: self.step, source })?;
            let acc = &mut self.grads[self.part.shard_range(seg)];
            acc.iter_mut().zip(out.iter()).for_each(|(a, o)| *a += o);
            // Reduced and accumulated: the transient buffer is free again.
            self.written[seg] = false;
        } else if grads_written && self.with_grads {
            self.written[seg] = true;
        }
        if self.stage == 3 {
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
