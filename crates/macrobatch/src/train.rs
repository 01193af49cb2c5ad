//! `macrobatch train`: validate the whole plan, then run optimizer steps.

use crate::metrics::{Reporter, StepRecord};
use crate::TrainArgs;
use anyhow::{bail, Context, Result};
use config::{Config, ResolvedBatch, ScheduleKind};
use data::{BatchShape, Corpus, DataFormat, Sampler, TokenDataset};
use engine::{
    AdamW, Decay, LossNormalization, LrSchedule, Model, Optimizer, Sgd, Trainer, TrainerOptions,
};
use gpt::{Batch, Gpt, GptConfig};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The bundled public-domain corpus (see data/README.md).
const BUNDLED_CORPUS: &[u8] = include_bytes!("../../../data/moby-dick.txt");
const BUNDLED_NAME: &str = "bundled corpus (Moby-Dick)";

/// Everything a run needs, checked before the first step.
struct Plan {
    cfg: Config,
    model: GptConfig,
    batch: ResolvedBatch,
    train: TokenDataset,
    val: TokenDataset,
    sampler: Sampler,
}

/// Reads the config and applies overrides.
fn load_config(args: &TrainArgs) -> Result<Config> {
    let (text, origin) = match &args.config {
        Some(p) => (
            std::fs::read_to_string(p)
                .with_context(|| format!("cannot read config file {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (String::new(), "default config".to_string()),
    };
    Ok(Config::from_toml(&text, &origin, &args.set)?)
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

fn plan(cfg: Config) -> Result<Plan> {
    cfg.validate()?;
    let model = model_config(&cfg)?;
    let batch = cfg.batch.resolve(1)?;
    let seq_len = cfg.data.seq_len.unwrap_or(model.block_size);
    if seq_len > model.block_size {
        bail!("data.seq_len = {seq_len} is longer than the model's block_size = {}; lower data.seq_len or raise model.block_size", model.block_size);
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
    let shape = BatchShape {
        micro: batch.micro,
        accumulation_steps: batch.accumulation_steps,
        world_size: batch.world_size,
    };
    let sampler = Sampler::new(
        train.n_samples(),
        shape,
        cfg.data.shuffle,
        cfg.data.drop_last,
        cfg.train.seed,
    )?;
    Ok(Plan {
        cfg,
        model,
        batch,
        train,
        val,
        sampler,
    })
}

fn trainer_for(plan: &Plan, n_params: usize) -> Result<Trainer> {
    let (cfg, o) = (&plan.cfg, &plan.cfg.optim);
    let optimizer = match o.name.as_str() {
        "sgd" => Optimizer::Sgd(Sgd::new(n_params, o.momentum, o.nesterov, o.weight_decay)?),
        _ => Optimizer::AdamW(AdamW::new(
            n_params,
            o.beta1,
            o.beta2,
            o.eps,
            o.weight_decay,
        )?),
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
    };
    let params = gpt::init_params(&plan.model, cfg.train.seed);
    Ok(Trainer::new(params, optimizer, schedule, options))
}

/// Builds a model batch from sample indices.
fn make_batch(ds: &TokenDataset, indices: &[usize]) -> Batch {
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

/// Mean validation loss over the first `eval_batches` micro-batches.
fn evaluate(
    model: &mut Gpt,
    params: &[f32],
    val: &TokenDataset,
    micro: usize,
    eval_batches: usize,
) -> Result<f64> {
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
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            PathBuf::from("runs").join(format!("run-{secs}"))
        }
    };
    for f in ["metrics.jsonl", gpt::hf::WEIGHTS_FILE] {
        if dir.join(f).exists() {
            bail!("{} already holds a run ({f} exists); choose another --out directory so nothing saved is overwritten", dir.display());
        }
    }
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create output directory {}", dir.display()))?;
    Ok(dir)
}

/// `macrobatch train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let plan = plan(load_config(&args)?)?;
    let cfg = &plan.cfg;
    if cfg.train.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.train.threads)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let dir = output_dir(&args)?;
    let mut resolved = cfg.clone();
    resolved.batch = config::BatchConfig {
        global: Some(plan.batch.global),
        micro: Some(plan.batch.micro),
        accumulation_steps: Some(plan.batch.accumulation_steps),
    };
    resolved.data.seq_len = Some(plan.train.seq_len());
    gpt::hf::write_atomic(
        &dir.join("config.resolved.toml"),
        resolved.to_toml().as_bytes(),
    )?;

    let mut model = Gpt::new(plan.model)?;
    let mut trainer = trainer_for(&plan, model.layout().n_params())?;
    let (steps, k) = (cfg.train.steps, plan.batch.accumulation_steps);
    let mut reporter = Reporter::new(&dir.join("metrics.jsonl"), steps, cfg.train.log_every)?;
    reporter.println(&format!(
        "macrobatch: GPT-2 {} ({:.2}M params, {} layers, d={}), batch {} = micro {} × K {} × W {}, seq {} | {} train / {} val sequences, {} steps/epoch | {} threads | out {}",
        cfg.model.preset,
        model.layout().n_params() as f64 / 1e6,
        plan.model.n_layer,
        plan.model.n_embd,
        plan.batch.global,
        plan.batch.micro,
        k,
        plan.batch.world_size,
        plan.train.seq_len(),
        plan.train.n_samples(),
        plan.val.n_samples(),
        plan.sampler.steps_per_epoch(),
        rayon::current_num_threads(),
        dir.display()
    ));

    let start = Instant::now();
    let mut order: Option<(u64, Vec<usize>)> = None;
    for step_idx in 0..steps {
        let (epoch, step_in_epoch) = plan.sampler.position(step_idx);
        if order.as_ref().map(|o| o.0) != Some(epoch) {
            order = Some((epoch, plan.sampler.epoch_order(epoch)));
        }
        let ord = &order.as_ref().expect("set just above").1;
        let batches: Vec<Batch> = (0..k)
            .map(|micro_idx| {
                make_batch(
                    &plan.train,
                    plan.sampler.micro_batch(ord, step_in_epoch, micro_idx, 0),
                )
            })
            .collect();
        let t0 = Instant::now();
        let report = trainer
            .step(&mut model, &batches)
            .with_context(|| format!("optimizer step {}", step_idx + 1))?;
        let step_s = t0.elapsed().as_secs_f64();
        let step = step_idx + 1;
        let is_eval =
            step == steps || (cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0);
        let val_loss = if is_eval {
            Some(evaluate(
                &mut model,
                trainer.params(),
                &plan.val,
                plan.batch.micro,
                cfg.train.eval_batches,
            )?)
        } else {
            None
        };
        let n_inputs: usize = batches.iter().map(|b| b.inputs.len()).sum();
        reporter.record(&StepRecord {
            step,
            epoch,
            loss: report.loss,
            lr: report.lr,
            grad_norm: report.grad_norm,
            clipped: report.clipped,
            tokens: report.n_targets,
            tokens_per_s: n_inputs as f64 / step_s,
            micro_steps: report.n_micro_steps,
            micro_losses: report.micro_losses,
            step_ms: step_s * 1e3,
            elapsed_s: start.elapsed().as_secs_f64(),
            val_loss,
        })?;
    }
    reporter.finish();
    gpt::hf::save(&dir, &plan.model, model.layout(), trainer.params())?;
    eprintln!(
        "done: {steps} steps in {:.1}s; model saved to {} (try: macrobatch generate {} --prompt \"Call me\")",
        start.elapsed().as_secs_f64(),
        dir.display(),
        dir.display()
    );
    Ok(())
}
