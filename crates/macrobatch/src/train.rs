//! `macrobatch train`: validate the whole plan, then run optimizer steps on
//! every rank.

use crate::dist::{self, Backend, Fault};
use crate::metrics::{Reporter, StepRecord};
use crate::TrainArgs;
use anyhow::{anyhow, bail, Context, Result};
use comm::Communicator;
use config::{Config, ResolvedBatch, ScheduleKind};
use data::{BatchShape, Corpus, DataFormat, Sampler, TokenDataset};
use engine::{AdamW, Decay, LossNormalization, LrSchedule, Model, Optimizer, Sgd, Trainer, TrainerOptions};
use gpt::{Batch, Gpt, GptConfig};
use std::path::{Path, PathBuf};
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
    Ok(Plan { cfg, model, backend, batch, train, val, sampler })
}

/// A trainer over freshly initialised parameters.
pub fn trainer_for(plan: &Plan, n_params: usize) -> Result<Trainer> {
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
    };
    let params = gpt::init_params(&plan.model, cfg.train.seed);
    Ok(Trainer::new(params, optimizer, schedule, options))
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

/// Mean validation loss over the first `eval_batches` micro-batches.
fn evaluate(model: &mut Gpt, params: &[f32], val: &TokenDataset, micro: usize, eval_batches: usize) -> Result<f64> {
    let n = (micro * eval_batches).min(val.n_samples());
    let idx: Vec<usize> = (0..n).collect();
    let (mut sum, mut count) = (0.0, 0u64);
    for chunk in idx.chunks(micro) {
        let s = model.loss(params, &make_batch(val, chunk))?;
        sum += s.loss_sum;
        count += s.n_targets;
    }
    Ok(sum / count.max(1) as f64)
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

fn open_outputs(plan: &Plan, dir: &Path) -> Result<Outputs> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))?;
    let mut resolved = plan.cfg.clone();
    resolved.batch = config::BatchConfig {
        global: Some(plan.batch.global),
        micro: Some(plan.batch.micro),
        accumulation_steps: Some(plan.batch.accumulation_steps),
    };
    resolved.data.seq_len = Some(plan.train.seq_len());
    gpt::hf::write_atomic(&dir.join("config.resolved.toml"), resolved.to_toml().as_bytes())?;
    let reporter = Reporter::new(&dir.join("metrics.jsonl"), plan.cfg.train.steps, plan.cfg.train.log_every)?;
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

/// The training loop of one rank. Rank 0 (holding `outputs`) evaluates,
/// records metrics and saves the model.
fn train_rank(
    plan: &Plan,
    comm: &mut dyn Communicator,
    mut outputs: Option<Outputs>,
    fault: Option<Fault>,
) -> Result<()> {
    let rank = comm.rank();
    let cfg = &plan.cfg;
    let mut model = Gpt::new(plan.model)?;
    let mut trainer = trainer_for(plan, model.layout().n_params())?;
    trainer.broadcast_params(comm)?;
    trainer.check_params_agree(comm)?;
    let steps = cfg.train.steps;
    let start = Instant::now();
    let mut order: Option<(u64, Vec<usize>)> = None;
    for step_idx in 0..steps {
        let step = step_idx + 1;
        if let Some(f) = &fault {
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
        if cfg.dist.check_every > 0 && step % cfg.dist.check_every == 0 {
            trainer.check_params_agree(comm)?;
        }
        let Some(out) = outputs.as_mut() else { continue };
        let is_eval = step == steps || (cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0);
        let val_loss = if is_eval {
            Some(evaluate(&mut model, trainer.params(), &plan.val, plan.batch.micro, cfg.train.eval_batches)?)
        } else {
            None
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
        })?;
    }
    if let Some(out) = outputs {
        out.reporter.finish();
        gpt::hf::save(&out.dir, &plan.model, model.layout(), trainer.params())?;
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
    let cfg = load_config(args.config.as_deref(), &args.set)?;
    let backend = dist::detect(cfg.dist.world_size)?;
    let plan = Arc::new(plan(cfg, backend)?);
    let fault = Fault::from_env()?;
    let cfg = &plan.cfg;
    if cfg.train.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.train.threads)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let dir = output_dir(&args)?;
    let timeout = Duration::from_secs_f64(cfg.dist.timeout_s);
    match backend {
        Backend::Single => train_rank(&plan, &mut comm::SingleProcess::new(), Some(open_outputs(&plan, &dir)?), fault),
        Backend::Threads(world) => {
            let outputs = std::sync::Mutex::new(Some(open_outputs(&plan, &dir)?));
            let plan = plan.clone();
            run_thread_ranks(world, timeout, move |c| {
                let out = if c.rank() == 0 { outputs.lock().ok().and_then(|mut o| o.take()) } else { None };
                train_rank(&plan, c, out, fault)
            })
        }
        Backend::Mpi(_) => {
            let mut c = dist::mpi_comm(timeout)?;
            // Every rank checked the output directory above; rank 0 alone writes it.
            let r = match c.rank() {
                0 => open_outputs(&plan, &dir).and_then(|out| train_rank(&plan, c.as_mut(), Some(out), fault)),
                _ => train_rank(&plan, c.as_mut(), None, fault),
            };
            if let Err(e) = &r {
                c.abort(&format!("{e:#}"));
            }
            r
        }
    }
}
