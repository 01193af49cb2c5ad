//! What a run reports: the memory lines at its start, one `metrics.jsonl`
//! record per step, the check of `batch.micro = "auto"`'s choice against the
//! first step's measured peak, and `memory.json` (every rank's accounting
//! and measured peaks beside the memory model's prediction).

use super::outputs::Outputs;
use crate::dist::Grid;
use crate::heap;
use crate::memory::{peak_rss_bytes, proc_status_bytes};
use crate::metrics::{DpoRecord, StepRecord};
use crate::planning::{self, Estimate, Knobs};
use crate::setup::Plan;
use anyhow::{bail, Context, Result};
use comm::Communicator;
use config::Precision;
use engine::{MemoryReport, StepReport, Trainer};
use std::path::Path;

/// Rank 0: the per-rank memory of the trainer's accounting, and where
/// optimizer state is offloaded.
pub fn print_memory(out: &Outputs, zero_stage: u8, mem: &MemoryReport, offload_root: &Path) {
    out.reporter.println(&format!(
        "memory per rank (ZeRO stage {}): params {:.1} MB, grads {:.1} MB, optimizer {:.1} MB, comm buffers {:.1} MB",
        zero_stage,
        mem.params as f64 / 1e6,
        mem.grads as f64 / 1e6,
        mem.optimizer as f64 / 1e6,
        mem.comm_buffers as f64 / 1e6
    ));
    if mem.offloaded > 0 {
        out.reporter.println(&format!(
            "optimizer state offloaded to disk: {:.1} MB per rank in {}",
            mem.offloaded as f64 / 1e6,
            offload_root.display()
        ));
    }
}

/// A step as rank 0 saw it, besides the engine's report.
pub struct StepContext {
    /// The step (1-based).
    pub step: u64,
    /// Its epoch.
    pub epoch: u64,
    /// Every rank's input positions of the step.
    pub input_tokens: u64,
    /// Seconds the step took.
    pub step_s: f64,
    /// Seconds since the loop began.
    pub elapsed_s: f64,
    /// The validation loss, when measured at this step.
    pub val_loss: Option<f64>,
    /// The run's objective is DPO (its rewards are reported).
    pub dpo: bool,
}

/// One line of `metrics.jsonl`: the step, its report, and the memory of the
/// trainer's accounting `mem`, the model's activations, the measured peak
/// and the memory model's prediction.
pub fn step_record(
    at: StepContext,
    report: StepReport,
    mem: &MemoryReport,
    activation_bytes: usize,
    predicted: &Estimate,
) -> StepRecord {
    StepRecord {
        step: at.step,
        epoch: at.epoch,
        loss: report.loss,
        loss_total: None,
        routing_pass_s: (report.step_stats_s > 0.0).then_some(report.step_stats_s),
        expert_load: None,
        lr: report.lr,
        grad_norm: report.grad_norm,
        clipped: report.clipped,
        tokens: report.n_targets,
        tokens_per_s: report.n_targets as f64 / at.step_s,
        input_tokens: at.input_tokens,
        input_tokens_per_s: at.input_tokens as f64 / at.step_s,
        micro_steps: report.n_micro_steps,
        micro_losses: report.micro_losses,
        comm_bytes: report.comm_bytes,
        comm_calls: report.comm_calls,
        comm_s: report.comm_s,
        comm_hidden_s: report.overlap.as_ref().map(|o| (o.collective_s - o.waited_s).max(0.0)),
        comm_timeline: report.overlap,
        overlap_ranks: None,
        step_ms: at.step_s * 1e3,
        elapsed_s: at.elapsed_s,
        val_loss: at.val_loss,
        skipped: report.skipped,
        loss_scale: report.loss_scale,
        mem_params: mem.params,
        mem_grads: mem.grads,
        mem_optimizer: mem.optimizer,
        mem_master: mem.master,
        mem_activations: activation_bytes,
        mem_comm_buffers: mem.comm_buffers,
        mem_peak_rss: peak_rss_bytes(),
        mem_predicted: predicted.per_process(),
        pipeline_bubble: report.pipeline.as_ref().map(|p| p.bubble),
        p2p_bytes: report.pipeline.as_ref().map(|p| p.p2p_bytes),
        pipeline_idle_s: report.pipeline.map(|p| p.idle_s),
        tp_allreduce_s: report.tensor.map(|t| t.seconds),
        tp_bytes: report.tensor.map(|t| t.bytes),
        tp_calls: report.tensor.map(|t| t.calls),
        cp_s: report.context.map(|t| t.seconds),
        cp_bytes: report.context.map(|t| t.bytes),
        cp_calls: report.context.map(|t| t.calls),
        dpo: at.dpo.then(|| DpoRecord::from_sums(&report.aux, report.n_targets)).flatten(),
        stop_reason: None,
    }
}

/// A rank's memory over the run: its own heap from the model's build on,
/// the resident set before its trainer existed, and what the first step
/// showed.
pub struct MemoryWatch {
    /// The rank's live heap bytes when it started.
    heap_base: i64,
    /// The memory model's prediction for the plan (the peak stage's).
    pub predicted: Estimate,
    /// Its prediction for every pipeline stage (one without a pipeline):
    /// rank r's is `stages[grid.stage_of(r)]`.
    stages: Vec<Estimate>,
    /// Where each rank sits.
    grid: Grid,
    /// The rank's own heap peak from its model's build to the end of the
    /// first step (trainer, model, activations, messages, micro-batches).
    first_step_heap: Option<u64>,
    /// The rank's heap peak during the first step above its live bytes
    /// when the step began (activations and the step's temporaries).
    first_step_growth: Option<u64>,
    /// Resident bytes before the trainer existed.
    rss_before: Option<u64>,
    /// The rank's heap peak while it built its trainer from a sharded
    /// checkpoint, above its live bytes before.
    pub load_heap: Option<u64>,
    /// The rank's largest heap growth while writing its share of a
    /// sharded checkpoint.
    pub checkpoint_heap: Option<u64>,
    /// Resident-set growth over the trainer and first step, less the
    /// accounted activations and collective buffers.
    model_states_rss: Option<u64>,
}

impl MemoryWatch {
    /// Started once the rank's model is built, before its trainer; the
    /// rank's heap counts from `heap_base` ([`heap::reset_peak`]).
    pub fn new(plan: &Plan, heap_base: i64) -> Result<Self> {
        let stages = planning::per_stage(plan, Knobs::of(plan))?;
        Ok(Self {
            heap_base,
            predicted: planning::peak(&stages),
            stages,
            grid: plan.grid.clone(),
            first_step_heap: None,
            first_step_growth: None,
            rss_before: proc_status_bytes("VmRSS:"),
            model_states_rss: None,
            load_heap: None,
            checkpoint_heap: None,
        })
    }

    /// What world rank `rank` is planned to hold: its stage's per-rank bytes.
    fn planned_rank(&self, rank: usize) -> u64 {
        self.stages.get(self.grid.stage_of(rank)).map_or(0, Estimate::per_rank)
    }

    /// Whether the first step's measurement is still to come.
    pub fn first_step_pending(&self) -> bool {
        self.model_states_rss.is_none()
    }

    /// After the first step (every allocation of a step has happened by
    /// now): the trial that confirms `batch.micro = "auto"`'s choice against
    /// the measured peak, and the model states as the OS sees them
    /// (`activation_bytes` and the communicator's `comm_buffer_bytes` left
    /// out).
    pub fn after_first_step(
        &mut self,
        plan: &Plan,
        trainer: &Trainer,
        activation_bytes: usize,
        comm_buffer_bytes: usize,
        step_base: i64,
    ) -> Result<()> {
        if let (Some(budget), Some(peak)) = (plan.memory_budget, peak_rss_bytes()) {
            if peak > budget {
                bail!(
                    "batch.micro = \"auto\" chose micro {} for a budget of {}, but the first step peaked at {} (planned {}); lower train.memory_budget or set batch.micro by hand",
                    plan.batch.micro,
                    planning::human(budget),
                    planning::human(peak),
                    planning::human(self.predicted.per_process())
                );
            }
        }
        self.first_step_heap = Some((heap::peak() - self.heap_base).max(0) as u64);
        self.first_step_growth = Some((heap::peak_since_mark() - step_base).max(0) as u64);
        let m = trainer.memory();
        let other = (activation_bytes + m.comm_buffers + comm_buffer_bytes) as u64;
        self.model_states_rss =
            self.rss_before.zip(proc_status_bytes("VmRSS:")).map(|(a, b)| b.saturating_sub(a).saturating_sub(other));
        Ok(())
    }

    /// Every rank's peak resident set, model states and own heap peak
    /// (KiB, as the file reports them), its trainer's accounting of
    /// parameters, gradients, optimizer state and master weights, its heap
    /// peak over the first step and what the plan gives its stage (bytes),
    /// gathered (a collective): [`PER_RANK`] values per rank, each rank
    /// summing into its own slot in f64 (exact to 2^53).
    pub fn gather(&self, comm: &mut dyn Communicator, trainer: &Trainer) -> Result<Vec<f64>> {
        let kib = |b: Option<u64>| (b.unwrap_or(0) / 1024) as f64;
        let rank_heap = Some((heap::peak() - self.heap_base).max(0) as u64);
        let m = trainer.memory();
        let mine = [
            kib(peak_rss_bytes()),
            kib(self.model_states_rss),
            kib(rank_heap),
            m.params as f64,
            m.grads as f64,
            m.optimizer as f64,
            m.master as f64,
            self.first_step_heap.unwrap_or(0) as f64,
            self.planned_rank(comm.rank()) as f64,
            self.load_heap.unwrap_or(0) as f64,
            self.checkpoint_heap.unwrap_or(0) as f64,
        ];
        let mut all = vec![0.0f64; PER_RANK * comm.world_size()];
        all[PER_RANK * comm.rank()..][..PER_RANK].copy_from_slice(&mine);
        comm.all_reduce_sum_f64(&mut all)?;
        Ok(all)
    }

    /// Rank 0: `DIR/memory.json` of a run training a model of `n_params`
    /// parameters, from the gathered per-rank figures `all`
    /// ([`MemoryWatch::gather`]).
    pub fn write_file(
        &self,
        out: &Outputs,
        plan: &Plan,
        n_params: usize,
        trainer: &Trainer,
        all: &[f64],
    ) -> Result<()> {
        let (cfg, grid) = (&plan.cfg, &plan.grid);
        let world = all.len() / PER_RANK;
        let per_rank = |i: usize| all.chunks(PER_RANK).map(|c| c[i] as u64).collect::<Vec<u64>>();
        let kib = |i: usize| per_rank(i).into_iter().map(|k| k * 1024).collect::<Vec<u64>>();
        let ranks = grid.is_split().then(|| {
            all.chunks(PER_RANK)
                .enumerate()
                .map(|(r, c)| {
                    let stage = grid.stage_of(r);
                    RankMemory {
                        rank: r,
                        pipeline_stage: stage,
                        data_rank: grid.data_rank_of(r),
                        tensor_rank: grid.tensor_rank_of(r),
                        layers: grid.cuts.get(stage).cloned().unwrap_or_default(),
                        params: c[3] as u64,
                        grads: c[4] as u64,
                        optimizer: c[5] as u64,
                        master: c[6] as u64,
                    }
                })
                .collect()
        });
        let file = MemoryFile {
            zero_stage: cfg.dist.zero_stage,
            world_size: world,
            n_params,
            accounting: trainer.memory(),
            precision: cfg.train.precision,
            formula_model_states: (cfg.train.precision == Precision::F32 && !grid.is_split())
                .then(|| formula_model_states(cfg.dist.zero_stage, !cfg.dist.reduce_every_micro_step, n_params, world)),
            peak_rss: kib(0),
            peak_rank_heap: kib(2),
            first_step_rank_heap: per_rank(7),
            first_step_growth: self.first_step_growth,
            planned_rank: per_rank(8),
            predicted: self.predicted,
            measured_model_states: kib(1),
            ranks,
            load_rank_heap: per_rank(9),
            checkpoint_rank_heap: per_rank(10),
            planned_load_rank: (0..world).map(|r| self.stages[grid.stage_of(r)].load_rank).collect(),
            planned_checkpoint_rank: (0..world).map(|r| self.stages[grid.stage_of(r)].checkpoint_rank).collect(),
        };
        nn::io::write_atomic(&out.dir.join("memory.json"), serde_json::to_string_pretty(&file)?.as_bytes())?;
        Ok(())
    }
}

/// Values per rank in [`MemoryWatch::gather`].
const PER_RANK: usize = 11;

/// One rank of a pipeline or tensor-parallel run: where it sits in the
/// grid and what its trainer holds.
#[derive(serde::Serialize)]
struct RankMemory {
    rank: usize,
    /// Its pipeline stage.
    pipeline_stage: usize,
    /// Its data-parallel rank (the micro-batches it runs).
    data_rank: usize,
    /// Its place in its tensor-parallel group.
    tensor_rank: usize,
    /// The layers its stage runs.
    layers: std::ops::Range<usize>,
    /// Bytes of parameters, gradients, optimizer state and master weights
    /// in its trainer's accounting.
    params: u64,
    grads: u64,
    optimizer: u64,
    master: u64,
}

/// Per-rank memory: the accounting and what the OS measured.
#[derive(serde::Serialize)]
struct MemoryFile {
    zero_stage: u8,
    world_size: usize,
    n_params: usize,
    /// Rank 0's accounting (without a pipeline every rank's is the same up to padding).
    accounting: engine::MemoryReport,
    /// Storage precision of the run.
    precision: Precision,
    /// The per-rank model-state bytes of docs/contract.md (Memory) for this stage (f32 runs; under
    /// mixed precision macrobatch keeps an f32 gradient accumulator and, at
    /// stages 1–2, unsharded f32 master weights, so the formula does not apply).
    formula_model_states: Option<f64>,
    /// Per rank: peak resident set (VmHWM; thread ranks share one process,
    /// so each reports the process's).
    peak_rss: Vec<u64>,
    /// Per rank: the most heap bytes the rank's own thread held at once,
    /// from building its model to the end of training (a per-rank measured
    /// peak also when ranks are threads of one process).
    peak_rank_heap: Vec<u64>,
    /// Per rank: the same over its model's build, its trainer and the first
    /// step only (no checkpoint, evaluation or final save yet): what
    /// `planned_rank` predicts.
    first_step_rank_heap: Vec<u64>,
    /// Rank 0's heap peak during its first step above what it held when
    /// the step began: the activations (`predicted.activations`) and the
    /// step's temporaries.
    first_step_growth: Option<u64>,
    /// Per rank: what the memory model gives the rank's stage per rank
    /// (`Estimate::per_rank` of its stage, of one tensor rank's shape).
    planned_rank: Vec<u64>,
    /// The memory model's per-rank and per-process prediction (`macrobatch plan`).
    predicted: Estimate,
    /// Per rank: resident-set growth from before the trainer existed to after
    /// the first step, less the accounted activations and collective buffers
    /// (the trainer's and the communicator's): the model states as the OS sees them.
    measured_model_states: Vec<u64>,
    /// With a pipeline or a tensor split: every rank's place in the grid
    /// and accounting (`accounting` above is rank 0's).
    #[serde(skip_serializing_if = "Option::is_none")]
    ranks: Option<Vec<RankMemory>>,
    /// Per rank, resumed from a sharded checkpoint: its heap peak while it
    /// built its trainer from the pieces, above its bytes before (0: not).
    load_rank_heap: Vec<u64>,
    /// Per rank, with sharded checkpoints: its largest heap growth while
    /// writing its share (0: none written).
    checkpoint_rank_heap: Vec<u64>,
    /// What the plan gives each of them (`load_rank`, `checkpoint_rank`).
    planned_load_rank: Vec<u64>,
    planned_checkpoint_rank: Vec<u64>,
}

/// The per-rank model-state bytes of docs/contract.md (Memory) in f32 (params 4Ψ, grads 4Ψ, AdamW
/// 8Ψ; no separate master copy): stage 0 16Ψ, 1 8Ψ + 8Ψ/N, 2 4Ψ + 12Ψ/N,
/// 3 16Ψ/N. Stage 2 accumulating locally keeps its full gradient: 8Ψ + 8Ψ/N.
pub fn formula_model_states(zero_stage: u8, local_accumulation: bool, n_params: usize, world: usize) -> f64 {
    let (p, n) = (n_params as f64, world as f64);
    match zero_stage {
        0 => 16.0 * p,
        1 => 8.0 * p + 8.0 * p / n,
        2 if local_accumulation => 8.0 * p + 8.0 * p / n,
        2 => 4.0 * p + 12.0 * p / n,
        _ => 16.0 * p / n,
    }
}

/// Under `dist.overlap_comm` with more than one rank (a collective: every
/// rank calls it after each step): every rank's step time, end of its last
/// micro-step, wait for its gradient collectives and time in them, for
/// rank 0's metrics line.
pub fn overlap_by_rank(
    on: bool,
    world: &mut dyn comm::Communicator,
    report: &engine::StepReport,
    step_s: f64,
) -> Result<Option<Vec<[f64; 4]>>> {
    if !on || world.world_size() < 2 {
        return Ok(None);
    }
    let o = report.overlap.clone().unwrap_or_default();
    let mine = [step_s, o.backward_end_s, o.waited_s, o.collective_s].map(|x| x as f32);
    let mut all = vec![0.0f32; 4 * world.world_size()];
    world.all_gather(&mine, &mut all).context("gathering the ranks' overlap timelines")?;
    Ok(Some(all.chunks(4).map(|c| [c[0], c[1], c[2], c[3]].map(f64::from)).collect()))
}
