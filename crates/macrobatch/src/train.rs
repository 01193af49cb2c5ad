//! `macrobatch train`: validate the whole plan, then run optimizer steps on
//! every rank.

use crate::checkpoint::{self, Loaded, TrainerState};
use crate::dist::{self, Backend, Fault};
use crate::metrics::{Reporter, StepRecord};
use crate::TrainArgs;
use anyhow::{anyhow, bail, Context, Result};
use comm::Communicator;
use config::{Config, ResolvedBatch, ScheduleKind};
use data::{BatchShape, Corpus, DataFormat, Sampler, TokenDataset};
use engine::{
    AdamW, Decay, LossNormalization, LossScalerConfig, LrSchedule, Model, Optimizer, Precision, Sgd, Trainer,
    TrainerOptions, ZeroConfig,
};
use gpt::{Batch, Gpt, GptConfig};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The bundled public-domain corpus (see data/README.md).
const BUNDLED_CORPUS: &[u8] = include_bytes!("../../../data/moby-dick.txt");
const BUNDLED_NAME: &str = "bundled corpus (Moby-Dick)";

/// Everything a run needs, checked before the first step.
pub struct Plan {
    pub cfg: Config,
    pub model: GptConfig,
    pub backend: Backend,
    pub batch: ResolvedBatch,
    pub train: TokenDataset,
    pub val: TokenDataset,
    pub sampler: Sampler,
}

/// Reads the config file (if any) and applies `--set` overrides.
pub fn load_config(path: Option<&Path>, sets: &[String]) -> Result<Config> {
    let (text, origin) = match path {
        Some(p) => (
            std::fs::read_to_string(p).with_context(|| format!("cannot read config file {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (String::new(), "default config".to_string()),
    };
    Ok(Config::from_toml(&text, &origin, sets)?)
}

/// The model shape: the preset with single dimensions overridden.
fn model_config(cfg: &Config) -> Result<GptConfig> {
    let m = &cfg.model;
    let base = GptConfig::preset(&m.preset).context("model.preset")?;
    let g = GptConfig {
        n_layer: m.n_layer.unwrap_or(base.n_layer),
        n_head: m.n_head.unwrap_or(base.n_head),
        n_embd: m.n_embd.unwrap_or(base.n_embd),
        block_size: m.block_size.unwrap_or(base.block_size),
        vocab_size: m.vocab_size.unwrap_or(base.vocab_size),
    };
    g.validate()?;
    Ok(g)
}

/// Validates the whole configuration against the model, the data and the
/// launcher, before anything runs.
pub fn plan(cfg: Config, backend: Backend) -> Result<Plan> {
    cfg.validate()?;
    let model = model_config(&cfg)?;
    let batch = cfg.batch.resolve(backend.world_size())?;
    let seq_len = cfg.data.seq_len.unwrap_or(model.block_size);
    if seq_len > model.block_size {
        bail!(
            "data.seq_len = {seq_len} is longer than the model's block_size = {}; lower data.seq_len or raise model.block_size",
            model.block_size
        );
    }
    let format = match cfg.data.format.as_str() {
        "tokens_u16" => DataFormat::TokensU16,
        _ => DataFormat::Text,
    };
    let corpus = match &cfg.data.path {
        Some(p) => Corpus::load(Path::new(p), format)?,
        None => Corpus::from_bytes(BUNDLED_NAME, BUNDLED_CORPUS, DataFormat::Text)?,
    };
    corpus.check_vocab(model.vocab_size)?;
    let (train, val) = corpus.split(cfg.data.val_fraction, seq_len)?;
    let shape =
        BatchShape { micro: batch.micro, accumulation_steps: batch.accumulation_steps, world_size: batch.world_size };
    let sampler = Sampler::new(train.n_samples(), shape, cfg.data.shuffle, cfg.data.drop_last, cfg.train.seed)?;
    // The layout alone (no activations are allocated before the first batch).
    apply_trainable(&mut Gpt::new(model)?, &cfg.train.trainable)?;
    Ok(Plan { cfg, model, backend, batch, train, val, sampler })
}

/// The configured compute precision.
pub fn precision_of(cfg: &Config) -> Precision {
    match cfg.train.precision.as_str() {
        "bf16" => Precision::Bf16,
        "f16" => Precision::F16,
        _ => Precision::F32,
    }
}

/// The model for this plan, storing activations in the configured
/// precision, with `train.trainable` applied.
pub fn model_for(plan: &Plan) -> Result<Gpt> {
    let mut model = Gpt::with_precision(plan.model, precision_of(&plan.cfg))?;
    apply_trainable(&mut model, &plan.cfg.train.trainable)?;
    Ok(model)
}

/// Freezes every tensor that no `train.trainable` pattern names; a pattern
/// that names no tensor is an error (a typo would silently freeze).
pub fn apply_trainable(model: &mut impl Model, patterns: &[String]) -> Result<usize> {
    let names: Vec<String> = model.layout().tensors().iter().map(|t| t.name.clone()).collect();
    if let Some(p) = patterns.iter().find(|p| !names.iter().any(|n| config::name_matches(p, n))) {
        bail!(
            "train.trainable: pattern `{p}` names no tensor of this model (tensor names look like {}, {}; `*` matches any run of characters)",
            names.first().map_or("", String::as_str),
            names.get(2).map_or("", String::as_str)
        );
    }
    Ok(model.set_trainable(&|t| patterns.iter().any(|p| config::name_matches(p, &t.name))))
}

/// A trainer over freshly initialised parameters for this rank of `comm`
/// (rank 0's parameters are broadcast; ZeRO partitions as configured).
pub fn trainer_for(plan: &Plan, model: &Gpt, comm: &mut dyn Communicator) -> Result<Trainer> {
    let n_params = model.layout().n_params();
    let (cfg, o) = (&plan.cfg, &plan.cfg.optim);
    let optimizer = match o.name.as_str() {
        "sgd" => Optimizer::Sgd(Sgd::new(n_params, o.momentum, o.nesterov, o.weight_decay)?),
        _ => Optimizer::AdamW(AdamW::new(n_params, o.beta1, o.beta2, o.eps, o.weight_decay)?),
    };
    let decay = match cfg.schedule_kind()? {
        ScheduleKind::Constant => Decay::Constant,
        ScheduleKind::Linear => Decay::Linear,
        ScheduleKind::Cosine => Decay::Cosine,
    };
    let schedule = LrSchedule {
        max_lr: o.lr,
        min_lr: cfg.schedule.min_lr,
        warmup_steps: cfg.schedule.warmup_steps,
        total_steps: cfg.train.steps,
        decay,
    };
    let options = TrainerOptions {
        grad_clip: (cfg.train.grad_clip > 0.0).then_some(cfg.train.grad_clip),
        normalization: match cfg.train.loss_normalization.as_str() {
            "micro_batch_mean" => LossNormalization::MicroBatchMean,
            _ => LossNormalization::Token,
        },
        bucket_elems: ((cfg.dist.bucket_mb * (1 << 20) as f64 / 4.0) as usize).max(1),
        precision: precision_of(cfg),
        loss_scaler: LossScalerConfig {
            initial_scale: cfg.train.initial_loss_scale,
            window: cfg.train.loss_scale_window,
            hysteresis: cfg.train.loss_scale_hysteresis,
            min_scale: cfg.train.min_loss_scale,
        },
    };
    let zero = ZeroConfig { stage: cfg.dist.zero_stage, reduce_every_micro_step: cfg.dist.reduce_every_micro_step };
    let init = |seg: usize| gpt::init_segment(&plan.model, cfg.train.seed, seg);
    Ok(Trainer::distributed_with(model, &init, optimizer, schedule, options, zero, comm)?)
}

/// Builds a model batch from sample indices.
pub fn make_batch(ds: &TokenDataset, indices: &[usize]) -> Batch {
    let t = ds.seq_len();
    let mut b = Batch {
        n_seqs: indices.len(),
        seq_len: t,
        inputs: Vec::with_capacity(indices.len() * t),
        targets: Vec::with_capacity(indices.len() * t),
    };
    for &i in indices {
        ds.push_sample(i, &mut b.inputs, &mut b.targets);
    }
    b
}

/// This rank's K micro-batches of global step `step_idx`.
pub fn rank_batches(plan: &Plan, sampler: &Sampler, order: &[usize], step_in_epoch: usize, rank: usize) -> Vec<Batch> {
    (0..sampler.shape().accumulation_steps)
        .map(|k| make_batch(&plan.train, sampler.micro_batch(order, step_in_epoch, k, rank)))
        .collect()
}

/// Mean validation loss over the first `eval_batches` micro-batches (at
/// ZeRO-3 a collective: every rank evaluates the same batches).
fn evaluate(trainer: &mut Trainer, model: &mut Gpt, comm: &mut dyn Communicator, plan: &Plan) -> Result<f64> {
    let (val, micro) = (&plan.val, plan.batch.micro);
    let n = (micro * plan.cfg.train.eval_batches).min(val.n_samples());
    let idx: Vec<usize> = (0..n).collect();
    let (mut sum, mut count) = (0.0, 0u64);
    for chunk in idx.chunks(micro) {
        let s = trainer.loss(model, comm, &make_batch(val, chunk))?;
        sum += s.loss_sum;
        count += s.n_targets;
    }
    Ok(sum / count.max(1) as f64)
}

/// A `/proc/self/status` memory figure in bytes (`VmHWM`: peak, `VmRSS`: now).
fn proc_status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Bytes of physical memory this process has used at most (VmHWM), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM:")
}

/// Per-rank memory: the accounting and what the OS measured.
#[derive(serde::Serialize)]
struct MemoryFile {
    zero_stage: u8,
    world_size: usize,
    n_params: usize,
    /// Rank 0's accounting (every rank's is the same up to padding).
    accounting: engine::MemoryReport,
    /// Storage precision of the run.
    precision: String,
    /// the contract's (docs/contract.md, Memory) per-rank model-state bytes for this stage (f32 runs; under
    /// mixed precision macrobatch keeps an f32 gradient accumulator and, at
    /// stages 1–2, unsharded f32 master weights, so the formula does not apply).
    formula_model_states: Option<f64>,
    /// Per rank: peak resident set (VmHWM).
    peak_rss: Vec<u64>,
    /// Per rank: resident-set growth from before the trainer existed to after
    /// the first step, less the accounted activations and collective buffers
    /// (the trainer's and the communicator's): the model states as the OS sees them.
    measured_model_states: Vec<u64>,
}

/// the contract's (docs/contract.md, Memory) per-rank model-state bytes in f32 (params 4Ψ, grads 4Ψ, AdamW
/// 8Ψ; no separate master copy): stage 0 16Ψ, 1 8Ψ + 8Ψ/N, 2 4Ψ + 12Ψ/N,
/// 3 16Ψ/N. Stage 2 accumulating locally keeps its full gradient: 8Ψ + 8Ψ/N.
pub fn formula_model_states(stage: u8, local_accumulation: bool, n_params: usize, world: usize) -> f64 {
    let (p, n) = (n_params as f64, world as f64);
    match stage {
        0 => 16.0 * p,
        1 => 8.0 * p + 8.0 * p / n,
        2 if local_accumulation => 8.0 * p + 8.0 * p / n,
        2 => 4.0 * p + 12.0 * p / n,
        _ => 16.0 * p / n,
    }
}

fn output_dir(args: &TrainArgs) -> Result<PathBuf> {
    let dir = match &args.out {
        Some(d) => d.clone(),
        None => {
            let secs =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
            PathBuf::from("runs").join(format!("run-{secs}"))
        }
    };
    for f in ["metrics.jsonl", gpt::hf::WEIGHTS_FILE] {
        if dir.join(f).exists() {
            bail!(
                "{} already holds a run ({f} exists); choose another --out directory so nothing saved is overwritten",
                dir.display()
            );
        }
    }
    Ok(dir)
}

/// Rank 0's outputs.
struct Outputs {
    dir: PathBuf,
    reporter: Reporter,
}

/// The config with every derived value written out.
fn resolved_toml(plan: &Plan) -> String {
    let mut resolved = plan.cfg.clone();
    resolved.batch = config::BatchConfig {
        global: Some(plan.batch.global),
        micro: Some(plan.batch.micro),
        accumulation_steps: Some(plan.batch.accumulation_steps),
    };
    resolved.data.seq_len = Some(plan.train.seq_len());
    resolved.to_toml()
}

fn open_outputs(plan: &Plan, dir: &Path, resume_step: Option<u64>) -> Result<Outputs> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))?;
    gpt::hf::write_atomic(&dir.join(checkpoint::CONFIG), resolved_toml(plan).as_bytes())?;
    let metrics = dir.join("metrics.jsonl");
    if let Some(step) = resume_step {
        checkpoint::truncate_metrics(&metrics, step)?;
    }
    let reporter = Reporter::new(&metrics, plan.cfg.train.steps, plan.cfg.train.log_every, resume_step.is_some())?;
    reporter.println(&format!(
        "macrobatch: GPT-2 {} ({:.2}M params, {} layers, d={}), batch {} = micro {} × K {} × W {} ({:?}), seq {} | {} train / {} val sequences, {} steps/epoch | {} threads | out {}",
        plan.cfg.model.preset,
        plan.model.n_params() as f64 / 1e6,
        plan.model.n_layer,
        plan.model.n_embd,
        plan.batch.global,
        plan.batch.micro,
        plan.batch.accumulation_steps,
        plan.batch.world_size,
        plan.backend,
        plan.train.seq_len(),
        plan.train.n_samples(),
        plan.val.n_samples(),
        plan.sampler.steps_per_epoch(),
        rayon::current_num_threads(),
        dir.display()
    ));
    Ok(Outputs { dir: dir.to_path_buf(), reporter })
}

/// Where a run starts from, and when it stops early.
#[derive(Clone)]
pub struct Start {
    /// A checkpoint to continue from.
    pub resume: Option<Arc<Loaded>>,
    /// Pretrained parameters (`--init-from`).
    pub init_params: Option<Arc<Vec<f32>>>,
    /// Stop after this many steps of this invocation.
    pub stop_after: Option<u64>,
    /// Set by SIGINT / SIGTERM.
    pub stop_signal: Arc<AtomicBool>,
    /// Test fault injection.
    pub fault: Option<Fault>,
}

/// The training loop of one rank. Rank 0 (holding `outputs`) evaluates,
/// records metrics, writes checkpoints and saves the model.
fn train_rank(
    plan: &Plan,
    comm: &mut dyn Communicator,
    mut outputs: Option<Outputs>,
    start_from: &Start,
) -> Result<()> {
    let rank = comm.rank();
    let cfg = &plan.cfg;
    let mut model = model_for(plan)?;
    let rss_before = proc_status_bytes("VmRSS:");
    let mut trainer = trainer_for(plan, &model, comm)?;
    let mut model_states_rss = None;
    let mut first_step = 0;
    if let Some(l) = &start_from.resume {
        let st = &l.state;
        trainer.restore(l.params.clone(), st.schedule_step.unwrap_or(st.step), st.n_updates, |name| {
            l.optimizer.get(name).cloned()
        })?;
        if let Some(sc) = &st.loss_scaler {
            trainer.set_loss_scaler(sc.scale, sc.good_steps, sc.hysteresis_left, sc.n_skipped);
        }
        first_step = st.step;
    } else if let Some(p) = &start_from.init_params {
        trainer.set_params(p.as_ref().clone())?;
    }
    trainer.check_params_agree(comm)?;
    let mem = trainer.memory();
    if let Some(out) = &outputs {
        out.reporter.println(&format!(
            "memory per rank (ZeRO stage {}): params {:.1} MB, grads {:.1} MB, optimizer {:.1} MB, comm buffers {:.1} MB",
            cfg.dist.zero_stage,
            mem.params as f64 / 1e6,
            mem.grads as f64 / 1e6,
            mem.optimizer as f64 / 1e6,
            mem.comm_buffers as f64 / 1e6
        ));
    }
    // At stage 3 evaluation gathers segments, and wherever the master weights
    // are sharded saving gathers them: every rank joins those collectives.
    let all_ranks_eval = cfg.dist.zero_stage == 3;
    let all_ranks_gather = trainer.master_sharded();
    let steps = cfg.train.steps;
    let config_toml = resolved_toml(plan);
    let start = Instant::now();
    let mut order: Option<(u64, Vec<usize>)> = None;
    for step_idx in first_step..steps {
        let step = step_idx + 1;
        if let Some(f) = &start_from.fault {
            f.maybe_fire(rank, step)?;
        }
        let (epoch, step_in_epoch) = plan.sampler.position(step_idx);
        if order.as_ref().map(|o| o.0) != Some(epoch) {
            order = Some((epoch, plan.sampler.epoch_order(epoch)));
        }
        let ord = order.as_ref().map(|o| o.1.as_slice()).unwrap_or_default();
        let batches = rank_batches(plan, &plan.sampler, ord, step_in_epoch, rank);
        let t0 = Instant::now();
        let report = trainer.step(&mut model, comm, &batches)?;
        let step_s = t0.elapsed().as_secs_f64();
        if model_states_rss.is_none() {
            drop(batches);
            let m = trainer.memory();
            let other = (model.activation_bytes() + m.comm_buffers + comm.buffer_bytes()) as u64;
            model_states_rss =
                rss_before.zip(proc_status_bytes("VmRSS:")).map(|(a, b)| b.saturating_sub(a).saturating_sub(other));
        }
        if cfg.dist.check_every > 0 && step % cfg.dist.check_every == 0 {
            trainer.check_params_agree(comm)?;
        }
        // Stop requests are agreed on by all ranks, so every rank stops at the same step.
        let mut stop = start_from.stop_signal.load(Ordering::SeqCst) as u8 as f64;
        if start_from.stop_after.is_some_and(|n| step - first_step >= n) {
            stop = 1.0;
        }
        if comm.world_size() > 1 {
            let mut v = [stop];
            comm.all_reduce_sum_f64(&mut v)?;
            stop = v[0];
        }
        let stop = stop > 0.0;
        let is_eval = step == steps || (cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0);
        let val_loss = if is_eval && (outputs.is_some() || all_ranks_eval) {
            Some(evaluate(&mut trainer, &mut model, comm, plan)?)
        } else {
            None
        };
        let every = cfg.train.checkpoint_every;
        let is_checkpoint = stop || (every > 0 && (step % every == 0 || step == steps));
        // Full state for the checkpoint (collectives at ZeRO ≥ 1).
        let full_state = if is_checkpoint && (outputs.is_some() || cfg.dist.zero_stage >= 1 || all_ranks_gather) {
            let params = trainer.full_params_to_rank0(comm)?;
            let opt = trainer.full_optimizer_state(comm, false)?;
            params.map(|p| (p, opt))
        } else {
            None
        };
        let Some(out) = outputs.as_mut() else {
            if stop {
                return Ok(());
            }
            continue;
        };
        out.reporter.record(&StepRecord {
            step,
            epoch,
            loss: report.loss,
            lr: report.lr,
            grad_norm: report.grad_norm,
            clipped: report.clipped,
            tokens: report.n_targets,
            tokens_per_s: report.n_targets as f64 / step_s,
            micro_steps: report.n_micro_steps,
            micro_losses: report.micro_losses,
            comm_bytes: report.comm_bytes,
            comm_calls: report.comm_calls,
            step_ms: step_s * 1e3,
            elapsed_s: start.elapsed().as_secs_f64(),
            val_loss,
            skipped: report.skipped,
            loss_scale: report.loss_scale,
            mem_params: mem.params,
            mem_grads: mem.grads,
            mem_optimizer: mem.optimizer,
            mem_master: mem.master,
            mem_activations: model.activation_bytes(),
            mem_comm_buffers: mem.comm_buffers,
            mem_peak_rss: peak_rss_bytes(),
        })?;
        if let Some((params, opt_state)) = full_state {
            let (epoch, step_in_epoch) = plan.sampler.position(step);
            let state = TrainerState {
                step,
                n_updates: trainer.optimizer().n_updates(),
                epoch,
                step_in_epoch,
                seed: cfg.train.seed,
                global_batch: plan.batch.global,
                world_size: plan.batch.world_size,
                optimizer: cfg.optim.name.clone(),
                schedule_step: Some(trainer.n_steps()),
                loss_scaler: trainer.loss_scaler().map(|s| checkpoint::ScalerState {
                    scale: s.scale,
                    good_steps: s.good_steps,
                    hysteresis_left: s.hysteresis_left,
                    n_skipped: s.n_skipped,
                }),
            };
            let path = checkpoint::save(&out.dir, &plan.model, &model, &params, &opt_state, &state, &config_toml)?;
            checkpoint::prune(&out.dir, cfg.train.keep_checkpoints)?;
            if stop {
                out.reporter.finish();
                eprintln!(
                    "stopped after step {step}; checkpoint {} written. Continue with: macrobatch train --resume {}",
                    path.display(),
                    out.dir.display()
                );
                return Ok(());
            }
        }
        if stop {
            return Ok(());
        }
    }
    // Per-rank memory to rank 0 (KiB in f32: exact up to 16 GiB).
    let kib = |b: Option<u64>| (b.unwrap_or(0) / 1024) as f32;
    let mine = [kib(peak_rss_bytes()), kib(model_states_rss)];
    let mut all = vec![0.0f32; 2 * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    let params = if outputs.is_some() || all_ranks_gather { trainer.full_params_to_rank0(comm)? } else { None };
    if let Some(out) = &outputs {
        let m = trainer.memory();
        let file = MemoryFile {
            zero_stage: cfg.dist.zero_stage,
            world_size: comm.world_size(),
            n_params: plan.model.n_params(),
            accounting: m,
            precision: cfg.train.precision.clone(),
            formula_model_states: (cfg.train.precision == "f32").then(|| {
                formula_model_states(
                    cfg.dist.zero_stage,
                    !cfg.dist.reduce_every_micro_step,
                    plan.model.n_params(),
                    comm.world_size(),
                )
            }),
            peak_rss: all.chunks(2).map(|c| c[0] as u64 * 1024).collect(),
            measured_model_states: all.chunks(2).map(|c| c[1] as u64 * 1024).collect(),
        };
        gpt::hf::write_atomic(&out.dir.join("memory.json"), serde_json::to_string_pretty(&file)?.as_bytes())?;
    }
    if let (Some(out), Some(params)) = (outputs, params) {
        out.reporter.finish();
        gpt::hf::save(&out.dir, &plan.model, model.layout(), &params)?;
        eprintln!(
            "done: {steps} steps in {:.1}s; model saved to {} (try: macrobatch generate {} --prompt \"Call me\")",
            start.elapsed().as_secs_f64(),
            out.dir.display(),
            out.dir.display()
        );
    }
    Ok(())
}

/// Runs `f(rank, comm)` on `world` thread ranks and gathers their outcomes.
/// A rank that panics or stalls does not hang the caller: the others fail
/// through their communicator, and stragglers get a short grace period.
pub fn run_thread_ranks<F>(world: usize, timeout: Duration, f: F) -> Result<()>
where
    F: Fn(&mut comm::threads::ThreadComm) -> Result<()> + Send + Sync + 'static,
{
    /// Sends the rank's outcome when the thread ends, also by panic.
    struct Outcome {
        rank: usize,
        tx: mpsc::Sender<(usize, Result<()>)>,
        result: Option<Result<()>>,
    }
    impl Drop for Outcome {
        fn drop(&mut self) {
            let r = self.result.take().unwrap_or_else(|| Err(anyhow!("rank {} panicked", self.rank)));
            let _ = self.tx.send((self.rank, r));
        }
    }
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for mut c in comm::threads::group(world, timeout) {
        let (f, tx) = (f.clone(), tx.clone());
        let rank = c.rank();
        std::thread::Builder::new().name(format!("rank-{rank}")).spawn(move || {
            let mut outcome = Outcome { rank, tx, result: None };
            let r = f(&mut c);
            if let Err(e) = &r {
                c.abort(&format!("{e:#}"));
            }
            drop(c);
            outcome.result = Some(r);
        })?;
    }
    drop(tx);
    let mut failures: Vec<(usize, anyhow::Error)> = Vec::new();
    let mut n_done = 0;
    while n_done < world {
        // Before any failure wait as long as training takes; after one, the
        // others stop within their timeout, so give them that plus a margin.
        let msg =
            if failures.is_empty() { rx.recv().ok() } else { rx.recv_timeout(timeout + Duration::from_secs(2)).ok() };
        let Some((rank, r)) = msg else { break };
        n_done += 1;
        if let Err(e) = r {
            failures.push((rank, e));
        }
    }
    if failures.is_empty() && n_done == world {
        return Ok(());
    }
    failures.sort_by_key(|(r, _)| *r);
    let mut msg: Vec<String> = failures.iter().map(|(r, e)| format!("rank {r}: {e:#}")).collect();
    if n_done < world {
        msg.push(format!("{} rank(s) never finished (stalled)", world - n_done));
    }
    bail!("training failed on {} of {world} ranks:\n  {}", failures.len() + (world - n_done), msg.join("\n  "))
}

/// `macrobatch train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let resume_dir = match &args.resume {
        None => None,
        Some(Some(d)) => Some(d.clone()),
        Some(None) => Some(args.out.clone().context("--resume needs the run directory: --resume DIR (or --out DIR)")?),
    };
    let (cfg, resume) = match &resume_dir {
        Some(dir) => {
            if args.config.is_some() {
                bail!("--resume continues with the config saved in the checkpoint; drop the CONFIG argument (use --set to override single keys)");
            }
            let loaded = checkpoint::latest_valid(dir, |w| eprintln!("{w}"))?;
            eprintln!("resuming from {} (step {})", loaded.dir.display(), loaded.state.step);
            let origin = loaded.dir.join(checkpoint::CONFIG).display().to_string();
            (Config::from_toml(&loaded.config_toml, &origin, &args.set)?, Some(Arc::new(loaded)))
        }
        None => (load_config(args.config.as_deref(), &args.set)?, None),
    };
    let mut cfg = cfg;
    let init_params = match &args.init_from {
        Some(path) if resume.is_none() => {
            let (mcfg, params) = gpt::hf::load(path)
                .with_context(|| format!("--init-from {}: cannot load a GPT-2 model", path.display()))?;
            // The pretrained shape wins over the preset.
            cfg.model.n_layer = Some(mcfg.n_layer);
            cfg.model.n_head = Some(mcfg.n_head);
            cfg.model.n_embd = Some(mcfg.n_embd);
            cfg.model.block_size = Some(mcfg.block_size);
            cfg.model.vocab_size = Some(mcfg.vocab_size);
            Some(Arc::new(params))
        }
        Some(_) => bail!("--init-from and --resume exclude each other: a resumed run continues from its checkpoint"),
        None => None,
    };
    let backend = dist::detect(cfg.dist.world_size)?;
    let plan = Arc::new(plan(cfg, backend)?);
    if let Some(l) = &resume {
        if l.model != plan.model {
            bail!(
                "the checkpoint in {} holds a model of shape {:?}, the config asks for {:?}",
                l.dir.display(),
                l.model,
                plan.model
            );
        }
        if l.state.global_batch != plan.batch.global {
            bail!(
                "the checkpoint was written with global batch {}, the config now gives {}; the data position counts in global batches, so keep batch.global",
                l.state.global_batch,
                plan.batch.global
            );
        }
        if l.state.optimizer != plan.cfg.optim.name {
            bail!(
                "the checkpoint holds `{}` optimizer state but optim.name is `{}`",
                l.state.optimizer,
                plan.cfg.optim.name
            );
        }
    }
    let cfg = &plan.cfg;
    if cfg.train.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.train.threads)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let dir = match &resume_dir {
        Some(d) => d.clone(),
        None => output_dir(&args)?,
    };
    let stop_signal = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // A second signal while the first is being honoured ends the process at once.
        signal_hook::flag::register_conditional_shutdown(sig, 130, stop_signal.clone())
            .context("cannot install signal handler")?;
        signal_hook::flag::register(sig, stop_signal.clone()).context("cannot install signal handler")?;
    }
    let resume_step = resume.as_ref().map(|l| l.state.step);
    let start = Start { resume, init_params, stop_after: args.stop_after, stop_signal, fault: Fault::from_env()? };
    let timeout = Duration::from_secs_f64(cfg.dist.timeout_s);
    match backend {
        Backend::Single => {
            train_rank(&plan, &mut comm::SingleProcess::new(), Some(open_outputs(&plan, &dir, resume_step)?), &start)
        }
        Backend::Threads(world) => {
            let outputs = std::sync::Mutex::new(Some(open_outputs(&plan, &dir, resume_step)?));
            let plan = plan.clone();
            run_thread_ranks(world, timeout, move |c| {
                let out = if c.rank() == 0 { outputs.lock().ok().and_then(|mut o| o.take()) } else { None };
                train_rank(&plan, c, out, &start)
            })
        }
        Backend::Mpi(_) => {
            let mut c = dist::mpi_comm(timeout)?;
            // Every rank checked the output directory above; rank 0 alone writes it.
            let r = match c.rank() {
                0 => open_outputs(&plan, &dir, resume_step)
                    .and_then(|out| train_rank(&plan, c.as_mut(), Some(out), &start)),
                _ => train_rank(&plan, c.as_mut(), None, &start),
            };
            if let Err(e) = &r {
                c.abort(&format!("{e:#}"));
            }
            r
        }
    }
}
