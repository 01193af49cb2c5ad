//! What `macrobatch plan` reports: the configured plan's breakdown, the
//! largest micro-batch that fits, alternatives that change one setting, and
//! learning-rate advice for a changed global batch.

use super::{
    estimate_at, fitting_at, human, model_states, stage_estimates, Backend, Estimate, Knobs, MARGIN_FIXED,
    MARGIN_PERCENT,
};
use crate::setup::Plan;
use anyhow::Result;
use config::{Checkpointing, Precision};
use engine::ScheduleKind;
use serde::Serialize;

/// One alternative the plan suggests.
#[derive(Debug, Serialize)]
pub struct Alternative {
    /// What to change (as config settings).
    pub change: String,
    /// Its largest fitting micro-batch and bytes, if it fits at all.
    pub fits: Option<Estimate>,
    /// Its bytes per process at micro-batch 1.
    pub at_micro_1: u64,
}

/// What `macrobatch plan` reports.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Model family and shape.
    pub model: String,
    /// Parameters of the layout (what is trained, stored and checkpointed).
    pub n_params: u128,
    /// Of them, the ones that train (`train.trainable`, or LoRA's adapters).
    pub n_trainable: u128,
    /// Frozen values held packed outside the layout (a LoRA base in
    /// `train.frozen_dtype`'s blocks), not in `n_params`.
    pub n_packed: u128,
    /// Sequence length.
    pub seq_len: usize,
    /// The global batch (kept fixed).
    pub global_batch: usize,
    /// Bytes available per process (given or detected).
    pub memory: u64,
    /// The budget: a plan fits when its peak with the margin
    /// ([`Estimate::needed`]) is at most this.
    pub budget: u64,
    /// The configuration as given.
    pub configured: Estimate,
    /// Its peak over all phases, per process ([`Estimate::per_process`]).
    pub configured_peak: u64,
    /// That peak with the margin ([`Estimate::needed`]): what must fit the budget.
    pub configured_needed: u64,
    /// Whether it fits the budget.
    pub configured_fits: bool,
    /// The largest micro-batch that fits with the configuration's other settings.
    pub best: Option<Estimate>,
    /// Other settings, each with its own largest micro-batch.
    pub alternatives: Vec<Alternative>,
    /// Learning-rate advice for a different global batch than the base.
    pub lr_advice: Option<LrAdvice>,
    /// Whether `batch.micro = "auto"` chose the configured micro-batch (the
    /// largest that fits; micro 1 when none does).
    pub auto_micro: bool,
    /// With pipeline parallelism: every stage of the configured plan.
    pub pipeline: Option<PipelineReport>,
    /// With tensor parallelism: the rank grid and what one tensor rank holds.
    pub tensor: Option<TensorReport>,
    /// `train.frozen_dtype` as resolved: the packed base's formats
    /// (`q4_1`, `nf4-dq`), or `f32` when it stays in the parameters.
    pub frozen_dtype: String,
    /// `train.checkpoint_async`: the checkpoint phase's state is held
    /// while the next steps run (the same bytes, on top of a step).
    pub checkpoint_async: bool,
    /// `train.checkpoint_sharded`: every rank writes and reads its share.
    pub checkpoint_sharded: bool,
}

/// The configured plan's rank grid with tensor parallelism.
#[derive(Debug, Serialize)]
pub struct TensorReport {
    /// Tensor-parallel ranks T (the innermost index).
    pub tensor_parallel: usize,
    /// Pipeline stages P.
    pub stages: usize,
    /// Data ranks D = W / (P × T).
    pub data_parallel: usize,
    /// The world W = P × D × T.
    pub world_size: usize,
    /// The shape one tensor rank holds (its family's description).
    pub rank_model: String,
    /// Parameters one tensor rank's model holds (all its stages).
    pub rank_params: u128,
}

/// The configured plan's pipeline: its stages side by side.
#[derive(Debug, Serialize)]
pub struct PipelineReport {
    /// Stages P.
    pub stages: usize,
    /// Data ranks per stage and tensor rank, D = W / (P × T).
    pub data_parallel: usize,
    /// Tensor ranks T; rank = stage · D·T + d · T + t.
    pub tensor_parallel: usize,
    /// GPipe or 1F1B.
    pub schedule: ScheduleKind,
    /// Micro-batches per step K.
    pub micro_batches: usize,
    /// Idle share of the ideal timeline, (P − 1) / (K + P − 1).
    pub bubble: f64,
    /// Each stage's bytes (per rank and per process), stage 0 first.
    pub per_stage: Vec<Estimate>,
    /// The stage whose ranks peak highest (the configured estimate's).
    pub peak_stage: usize,
    /// The first rank of that stage, peak_stage · D·T.
    pub peak_rank: usize,
}

/// The tutorials' advice for a changed global batch: linear scaling for
/// SGD, square-root scaling for Adam-family optimizers, and a warmup of 3–10%
/// of the steps. Advice only: nothing is applied.
#[derive(Debug, Serialize)]
pub struct LrAdvice {
    /// The batch the configured learning rate was tuned for.
    pub base_batch: usize,
    /// The configured learning rate.
    pub base_lr: f32,
    /// lr × global / base.
    pub linear: f32,
    /// lr × √(global / base).
    pub sqrt: f32,
    /// 3% and 10% of train.steps.
    pub warmup_steps: (u64, u64),
}

/// The whole report for `plan` with `memory` bytes per process, of which
/// `budget` may be used.
pub fn report(plan: &Plan, knobs: Knobs, memory: u64, budget: u64, base_batch: Option<usize>) -> Result<Report> {
    let states = model_states(plan, knobs)?;
    let configured = estimate_at(plan, knobs, &states)?;
    let best = fitting_at(plan, knobs, budget, &states)?;
    let pipeline = match stage_estimates(plan, knobs, &states)? {
        (per_stage, Some(schedule)) => Some(PipelineReport {
            stages: schedule.n_stages,
            data_parallel: knobs.data_parallel(),
            tensor_parallel: knobs.tensor_parallel.max(1),
            schedule: schedule.kind,
            micro_batches: schedule.n_micro,
            bubble: schedule.bubble_fraction(),
            per_stage,
            peak_stage: configured.stage,
            peak_rank: configured.stage * knobs.stage_ranks(),
        }),
        (_, None) => None,
    };
    let tensor = (knobs.tensor_parallel > 1).then(|| TensorReport {
        tensor_parallel: knobs.tensor_parallel,
        stages: knobs.pipeline_parallel.max(1),
        data_parallel: knobs.data_parallel(),
        world_size: knobs.world_size,
        rank_model: states.family.describe(),
        rank_params: states.family.n_params(),
    });
    let mut variants: Vec<(String, Knobs)> = Vec::new();
    if knobs.checkpointing == Checkpointing::None && plan.family.supports_checkpointing() {
        variants.push((
            "train.activation_checkpointing = \"selective\"".into(),
            Knobs { checkpointing: Checkpointing::Selective, ..knobs },
        ));
    }
    if knobs.checkpointing != Checkpointing::Blocks && plan.family.supports_checkpointing() {
        variants.push((
            "train.activation_checkpointing = \"blocks\"".into(),
            Knobs { checkpointing: Checkpointing::Blocks, ..knobs },
        ));
    }
    if knobs.precision == Precision::F32 {
        variants.push(("train.precision = \"bf16\"".into(), Knobs { precision: Precision::Bf16, ..knobs }));
    }
    // A pipeline or a tensor split composes with ZeRO stages 0 and 1 only.
    let max_zero = if knobs.pipeline_parallel > 1 || knobs.tensor_parallel > 1 { 1 } else { 3 };
    if knobs.data_parallel() > 1 {
        for stage in knobs.zero_stage + 1..=max_zero {
            variants.push((
                format!("dist.zero_stage = {stage}"),
                Knobs { zero_stage: stage, reduce_every_micro_step: false, ..knobs },
            ));
        }
    }
    if !knobs.offload_optimizer {
        variants.push(("dist.offload_optimizer = \"disk\"".into(), Knobs { offload_optimizer: true, ..knobs }));
    }
    // The embedding and head split by vocabulary where T divides it.
    let t = knobs.tensor_parallel;
    if t > 1 && !knobs.vocab_parallel && plan.family.vocab_size().is_multiple_of(t) {
        variants.push(("dist.vocab_parallel = true".into(), Knobs { vocab_parallel: true, ..knobs }));
    }
    if t > 1 && !knobs.sequence_parallel {
        variants.push(("dist.sequence_parallel = true".into(), Knobs { sequence_parallel: true, ..knobs }));
    }
    let w2 = knobs.world_size * 2;
    if plan.batch.global.is_multiple_of(w2 / knobs.pipeline_parallel.max(1) / knobs.tensor_parallel.max(1)) {
        let stage = knobs.zero_stage.max(max_zero);
        variants.push((
            format!("{w2} ranks (one per process) with dist.zero_stage = {stage}"),
            Knobs {
                world_size: w2,
                ranks_per_process: 1,
                backend: Backend::Mpi,
                zero_stage: stage,
                reduce_every_micro_step: false,
                ..knobs
            },
        ));
    }
    if plan.family.supports_checkpointing() {
        variants.push((
            "all of: checkpointing blocks, bf16".into(),
            Knobs { checkpointing: Checkpointing::Blocks, precision: Precision::Bf16, ..knobs },
        ));
    }
    let mut alternatives = Vec::new();
    for (change, k) in variants {
        let states = model_states(plan, k)?;
        let fits = fitting_at(plan, k, budget, &states)?;
        let at_micro_1 = estimate_at(plan, Knobs { micro: 1, ..k }, &states)?.per_process();
        alternatives.push(Alternative { change, fits, at_micro_1 });
    }
    let cfg = &plan.cfg;
    let lr_advice = base_batch.filter(|&b| b != plan.batch.global && b > 0).map(|b| {
        let ratio = plan.batch.global as f32 / b as f32;
        LrAdvice {
            base_batch: b,
            base_lr: cfg.optim.lr,
            linear: cfg.optim.lr * ratio,
            sqrt: cfg.optim.lr * ratio.sqrt(),
            warmup_steps: (
                (cfg.train.steps as f64 * 0.03).ceil() as u64,
                (cfg.train.steps as f64 * 0.10).ceil() as u64,
            ),
        }
    });
    Ok(Report {
        model: format!("{} {} ({})", plan.family.name(), cfg.model.label(), plan.family.describe()),
        n_params: plan.family.n_params(),
        n_trainable: states.n_trainable as u128,
        n_packed: plan.family.frozen_bytes().map_or(0, |f| f.values),
        seq_len: plan.train.seq_len(),
        global_batch: plan.batch.global,
        memory,
        budget,
        configured_peak: configured.per_process(),
        configured_needed: configured.needed(),
        configured_fits: configured.needed() <= budget,
        configured,
        best,
        alternatives,
        lr_advice,
        auto_micro: false,
        pipeline,
        tensor,
        frozen_dtype: plan.family.frozen_bytes().map_or("f32".into(), |f| f.formats),
        checkpoint_async: plan.cfg.train.checkpoint_async,
        checkpoint_sharded: plan.cfg.train.checkpoint_sharded,
    })
}

fn describe(e: &Estimate) -> String {
    let k = &e.knobs;
    let pipeline = match (k.pipeline_parallel, k.tensor_parallel) {
        _ if k.context_parallel > 1 => format!(
            " (P {} × D {} × C {} × T {}, {})",
            k.pipeline_parallel,
            k.data_parallel(),
            k.context_parallel,
            k.tensor_parallel,
            k.pipeline_schedule
        ),
        (0 | 1, 0 | 1) => String::new(),
        (0 | 1, t) => format!(" (T {t} × D {})", k.data_parallel()),
        (p, 0 | 1) => format!(" (P {p} × D {}, {})", k.data_parallel(), k.pipeline_schedule),
        (p, t) => format!(" (P {p} × D {} × T {t}, {})", k.data_parallel(), k.pipeline_schedule),
    };
    format!(
        "micro {} × K {} × W {}{pipeline} | ZeRO {} | {} | checkpointing {}{}",
        k.micro,
        e.accumulation_steps,
        k.world_size,
        k.zero_stage,
        k.precision,
        k.checkpointing,
        if k.offload_optimizer { " | optimizer on disk" } else { "" }
    )
}

/// "N parameters" where all of them train; otherwise the total, then the
/// trainable and frozen ones (and the frozen ones held packed).
fn param_counts(r: &Report) -> String {
    let total = r.n_params + r.n_packed;
    if r.n_trainable == total {
        return format!("{total} parameters");
    }
    let packed = match r.n_packed {
        0 => String::new(),
        n => format!(", {n} of them packed outside the layout"),
    };
    format!("{total} parameters ({} trainable, {} frozen{packed})", r.n_trainable, total - r.n_trainable)
}

/// The report as text.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    let e = &r.configured;
    out += &format!(
        "{}: {}, seq {}, global batch {}\nmemory per process {} (budget {}; a plan fits when its peak + {MARGIN_PERCENT}% + {} is within it)\n\nconfigured: {}\n",
        r.model,
        param_counts(r),
        r.seq_len,
        r.global_batch,
        human(r.memory),
        human(r.budget),
        human(MARGIN_FIXED),
        describe(e)
    );
    if r.auto_micro {
        out += "  (the micro-batch chosen by batch.micro = \"auto\" for this memory and world size)\n";
    }
    for (what, b) in [
        ("parameters (model copy)", e.params),
        ("master weights (f32)", e.master),
        ("gradients", e.grads),
        ("optimizer state", e.optimizer),
        ("collective buffers", e.comm_buffers),
        ("communicator staging", e.comm_staging),
        ("tensor-parallel staging", e.tp_staging),
        ("activations (one micro-batch)", e.activations),
        ("micro-batches of the step", e.batches),
    ]
    .into_iter()
    .chain(r.pipeline.as_ref().map(|_| ("pipeline send / receive buffers", e.p2p)))
    {
        let what = match (what, &r.pipeline) {
            ("activations (one micro-batch)", Some(_)) => "activations (micro-batches in flight)",
            (w, _) => w,
        };
        out += &format!("  per rank    {what:<32} {:>12}\n", human(b));
    }
    out += &format!("  per rank    {:<32} {:>12}\n", "total", human(e.per_rank()));
    out += &format!("  per process {:<32} {:>12}\n", "shared collective result", human(e.comm_shared));
    if e.frozen > 0 {
        let what = format!("frozen base ({})", r.frozen_dtype);
        out += &format!("  per process {what:<32} {:>12}\n", human(e.frozen));
    }
    if e.ema > 0 {
        out += &format!("  per process {:<32} {:>12}\n", "moving average (train.ema_decay)", human(e.ema));
    }
    out += &format!("  per process {:<32} {:>12}\n", "data set", human(e.data));
    out += &format!("  per process {:<32} {:>12}\n", "program", human(e.runtime));
    out += &format!("  per process {:<32} {:>12}\n", "kernel workspace", human(e.workspace));
    out += &format!(
        "  per process {:<32} {:>12}  ({} rank(s))\n",
        "total during a step",
        human(e.step_peak()),
        e.knobs.ranks_per_process
    );
    if e.other_ranks > 0 && r.pipeline.is_some() {
        out += &format!("  (of which the process's other ranks, every stage's: {})\n", human(e.other_ranks));
    }
    let who = if r.checkpoint_sharded { "+ checkpoint (sharded, every rank)" } else { "+ checkpoint / save (rank 0)" };
    out += &format!("  per process {:<32} {:>12}\n", who, human(e.checkpoint));
    if r.checkpoint_async {
        out += "  (train.checkpoint_async: a checkpoint's state is held, one at a time, while the next steps run)\n";
    }
    out += &format!("  per process {:<32} {:>12}\n", "loading a checkpoint (phase)", human(e.load));
    out += &format!(
        "  per process {:<32} {:>12}  peak + margin {} — {}\n\n",
        "peak over all phases",
        human(e.per_process()),
        human(e.needed()),
        if r.configured_fits { "fits" } else { "DOES NOT FIT" }
    );
    if let Some(t) = &r.tensor {
        out += &render_tensor(t);
    }
    if let Some(p) = &r.pipeline {
        out += &render_pipeline(p);
    }
    match &r.best {
        Some(b) => {
            out += &format!("largest micro-batch that fits: {} → {} per process\n", describe(b), human(b.per_process()))
        }
        None => out += "no micro-batch fits with these settings (not even 1)\n",
    }
    out += "\nalternatives (global batch unchanged):\n";
    for a in &r.alternatives {
        match &a.fits {
            Some(f) => out += &format!("  {:<58} fits: {} ({})\n", a.change, describe(f), human(f.per_process())),
            None => out += &format!("  {:<58} does not fit ({} at micro 1)\n", a.change, human(a.at_micro_1)),
        }
    }
    if let Some(l) = &r.lr_advice {
        out += &format!(
            "\nlearning rate for global batch {} instead of {} (advice, not applied): linear (SGD) {:.3e}, square-root (Adam family) {:.3e}; warm up over {}–{} steps (3–10%)\n",
            r.global_batch, l.base_batch, l.linear, l.sqrt, l.warmup_steps.0, l.warmup_steps.1
        );
    }
    out
}

/// The rank grid of a tensor split and what one tensor rank holds.
fn render_tensor(t: &TensorReport) -> String {
    let (p, d, tp) = (t.stages, t.data_parallel, t.tensor_parallel);
    format!(
        "grid: {p} pipeline stage(s) × {d} data rank(s) × {tp} tensor ranks = {} ranks (rank = stage · {} + d · {tp} + t; a tensor group is {tp} consecutive ranks)\n  each tensor rank holds {} ({} parameters)\n\n",
        t.world_size,
        d * tp,
        t.rank_model,
        t.rank_params
    )
}

/// The pipeline's stages side by side: what each rank of each stage holds.
fn render_pipeline(p: &PipelineReport) -> String {
    let (d, t) = (p.data_parallel, p.tensor_parallel);
    let layout = match t {
        1 => format!("{d} data ranks (rank = stage · {d} + d)"),
        _ => format!("{d} data ranks × {t} tensor ranks (rank = stage · {} + d · {t} + t)", d * t),
    };
    let mut out = format!(
        "pipeline: {} stages × {layout}, {} schedule, K = {} micro-batches, bubble (P−1)/(K+P−1) = {:.3}\n",
        p.stages, p.schedule, p.micro_batches, p.bubble
    );
    out += &format!(
        "  {:<5} {:<9} {:<9} {:>14} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
        "stage",
        "layers",
        "ranks",
        "parameters",
        "in flight",
        "params",
        "grads",
        "optimizer",
        "activations",
        "per rank",
        "peak"
    );
    let group = d * t;
    for e in &p.per_stage {
        let ranks = match group {
            1 => format!("{}", e.stage),
            _ => format!("{}–{}", e.stage * group, e.stage * group + group - 1),
        };
        out += &format!(
            "  {:<5} {:<9} {:<9} {:>14} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
            e.stage,
            format!("{}–{}", e.blocks.0, e.blocks.1.saturating_sub(1)),
            ranks,
            e.stage_params,
            e.in_flight,
            human(e.params + e.master),
            human(e.grads),
            human(e.optimizer),
            human(e.activations),
            human(e.per_rank()),
            human(e.per_process()),
        );
    }
    out += &format!("  peak: stage {} (ranks from {})\n\n", p.peak_stage, p.peak_rank);
    out
}
