//! `macrobatch train`: validate the whole plan, then run optimizer steps on
//! every rank.

use crate::checkpoint::{self, Loaded, TrainerState};
use crate::dist::{self, Backend, Fault};
use crate::family::{self, Build, Family, LanguageModel};
use crate::folder::{self, RUN_ID_FILE};
use crate::memory;
use crate::metrics::{Reporter, StepRecord};
use crate::{DeepSpeedArgs, TrainArgs};
use anyhow::{anyhow, bail, Context, Result};
use comm::Communicator;
use config::{Config, Micro, OffloadOptimizer, OptimizerKind, Precision, ResolvedBatch};
use data::{
    BatchShape, Corpus, DataFormat, EpochOrder, Sampler, Samples, SftDataset, SftOptions, Tokenizer, TokenizerSpec,
};
use engine::{
    AdamW, LossScalerConfig, LrSchedule, Model, Optimizer, Sgd, TokenBatch, Trainer, TrainerOptions, ZeroConfig,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The bundled public-domain corpus (see data/README.md).
const BUNDLED_CORPUS: &[u8] = include_bytes!("../../../data/moby-dick.txt");
const BUNDLED_NAME: &str = "bundled corpus (Moby-Dick)";

/// Everything a run needs, checked before the first step.
pub struct Plan {
    pub cfg: Config,
    /// The model family and shape.
    pub family: Arc<dyn Family>,
    /// With `batch.micro = "auto"`: the budget the micro-batch was chosen
    /// for, checked against the measured peak after the first step.
    pub memory_budget: Option<u64>,
    pub backend: Backend,
    pub batch: ResolvedBatch,
    pub train: Samples,
    pub val: Samples,
    /// The tokenizer of the data (saved into the run folder for `generate`).
    pub tokenizer: Arc<Tokenizer>,
    pub sampler: Sampler,
}

impl Plan {
    /// How the model is built: activation precision and checkpointing.
    pub fn build(&self) -> Build {
        Build { precision: self.cfg.train.precision, checkpointing: self.cfg.train.activation_checkpointing }
    }
}

/// Reads the config file (if any) and applies `--set` overrides. A path
/// ending in `.json` is a DeepSpeed config, translated (with
/// `--config-model` for what it does not describe); its warnings go to stderr.
pub fn load_config(path: Option<&Path>, sets: &[String], ds: &DeepSpeedArgs) -> Result<Config> {
    let read =
        |p: &Path| std::fs::read_to_string(p).with_context(|| format!("cannot read config file {}", p.display()));
    let is_json = path.is_some_and(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")));
    if !is_json {
        if ds.config_model.is_some() || ds.strict {
            bail!("--config-model and --strict go with a DeepSpeed JSON config (CONFIG ending in .json); a TOML config holds [model] and [data] itself");
        }
        let (text, origin) = match path {
            Some(p) => (read(p)?, p.display().to_string()),
            None => (String::new(), "default config".to_string()),
        };
        return Ok(Config::from_toml(&text, &origin, sets)?);
    }
    let path = path.context("a DeepSpeed config needs its path")?;
    let companion = match &ds.config_model {
        Some(p) => Some((read(p)?, p.display().to_string())),
        None => None,
    };
    let opts = config::DeepSpeedOptions {
        launcher_world: comm::launcher::launcher_world_size().map(|(n, _)| n),
        strict: ds.strict,
    };
    let translated = Config::from_deepspeed_json(
        &read(path)?,
        &path.display().to_string(),
        companion.as_ref().map(|(t, o)| (t.as_str(), o.as_str())),
        sets,
        opts,
    )?;
    for w in &translated.warnings {
        eprintln!("warning: {w}");
    }
    Ok(translated.config)
}

/// Validates the whole configuration against the model, the data and the
/// launcher, before anything runs.
pub fn plan(mut cfg: Config, backend: Backend) -> Result<Plan> {
    cfg.validate()?;
    let auto_micro = start_auto_micro(&mut cfg)?;
    let family = family::from_config(&cfg.model, cfg.lora.as_ref())?;
    // An error at micro 1 is the user's "auto", not a micro they wrote.
    let auto_context = |e: anyhow::Error| match auto_micro {
        true => e.context("batch.micro = \"auto\" (checked at micro = 1, the smallest it can choose)"),
        false => e,
    };
    let batch = cfg.batch.resolve(backend.world_size()).map_err(|e| auto_context(e.into()))?;
    let max_seq = family.max_seq_len();
    let seq_len = cfg.data.seq_len.unwrap_or(max_seq);
    if seq_len > max_seq {
        bail!(
            "data.seq_len = {seq_len} is longer than the model's context of {max_seq} tokens; lower data.seq_len or raise model.block_size"
        );
    }
    let spec = cfg.data.tokenizer.clone().unwrap_or(TokenizerSpec::Byte);
    let tokenizer = spec.build().with_context(|| format!("data.tokenizer = \"{}\"", spec.name()))?;
    if tokenizer.vocab_size() > family.vocab_size() {
        bail!(
            "data.tokenizer = \"{}\" has {} tokens but the model's vocabulary holds {}; use the model's own tokenizer or raise model.vocab_size",
            spec.name(),
            tokenizer.vocab_size(),
            family.vocab_size()
        );
    }
    let (train, val) = load_samples(&cfg, &tokenizer, seq_len, family.vocab_size())?;
    let sampler = sampler_for(&cfg, &batch, &train).map_err(auto_context)?;
    // The layout alone (no activations are allocated before the first batch).
    apply_trainable(&mut family.build(Build::default())?, &trainable_patterns(&cfg))?;
    let tokenizer = Arc::new(tokenizer);
    let mut plan = Plan { cfg, family, memory_budget: None, backend, batch, train, val, tokenizer, sampler };
    if auto_micro {
        choose_micro(&mut plan)?;
    }
    Ok(plan)
}

/// With `batch.micro = "auto"`: sets micro 1 (the planner then picks the
/// largest that fits) and the default global batch if none is given;
/// returns whether it was "auto".
pub fn start_auto_micro(cfg: &mut Config) -> Result<bool> {
    if cfg.batch.micro != Some(Micro::Auto) {
        return Ok(false);
    }
    if let Some(k) = cfg.batch.accumulation_steps {
        bail!(
            "batch.micro = \"auto\" derives the accumulation steps from batch.global, but batch.accumulation_steps = {k} is also given; remove batch.accumulation_steps"
        );
    }
    cfg.batch.global.get_or_insert(config::DEFAULT_GLOBAL_BATCH);
    cfg.batch.micro = Some(Micro::Sequences(1));
    Ok(true)
}

/// Training and validation samples of `[data]`: windows of a token stream
/// (the bundled corpus or `data.path` as text through `tokenizer`, or a
/// token file), or fine-tuning examples (`jsonl`, at most `seq_len`
/// positions each).
fn load_samples(cfg: &Config, tokenizer: &Tokenizer, seq_len: usize, vocab: usize) -> Result<(Samples, Samples)> {
    let d = &cfg.data;
    if let (Some(p), Some(v)) = (&d.path, &d.val_path) {
        if folder::same_path(Path::new(p), Path::new(v)) {
            bail!(
                "data.val_path = \"{v}\" is the training file data.path = \"{p}\": the validation loss would be measured on the examples trained on; give a held-out file, or (except for jsonl) unset data.val_path to hold out the last data.val_fraction of data.path"
            );
        }
    }
    let (train, val) = match (&d.path, d.format) {
        (Some(p), DataFormat::Jsonl) => {
            let opts = SftOptions {
                max_len: Some(seq_len),
                pack_seq_len: d.pack.then_some(seq_len),
                drop_empty: d.drop_empty,
            };
            let load = |path: &str| -> Result<Samples> {
                let ds = SftDataset::load(Path::new(path), tokenizer, &opts)?;
                let s = ds.stats();
                if s.n_truncated > 0 {
                    let n_read = s.n_examples + s.n_without_targets;
                    eprintln!(
                        "warning: {path}: {} of {n_read} examples cut to data.seq_len = {seq_len} positions",
                        s.n_truncated
                    );
                }
                if s.n_without_targets > 0 {
                    eprintln!(
                        "warning: {path}: dropped {} examples that keep no target once cut (their replies lie beyond data.seq_len = {seq_len}): lines {}; raise data.seq_len to keep them, or set data.drop_empty = false to refuse such data",
                        s.n_without_targets,
                        data::sft::line_list(ds.dropped_lines())
                    );
                }
                Ok(Samples::Examples(ds))
            };
            let val = d.val_path.as_deref().context("data.format = \"jsonl\" needs data.val_path")?;
            (load(p)?, load(val)?)
        }
        (Some(p), DataFormat::Text) if !matches!(tokenizer, Tokenizer::Byte(_)) => {
            let load_text = |p: &str| -> Result<Corpus> {
                Ok(Corpus::load_files(p, &crate::prepare::text_files(Path::new(p))?, tokenizer)?)
            };
            let corpus = load_text(p)?;
            let (train, val) = match &d.val_path {
                None => corpus.split(d.val_fraction, seq_len)?,
                Some(v) => {
                    let val = load_text(v)?;
                    (corpus.split_all("train", seq_len)?, val.split_all("validation", seq_len)?)
                }
            };
            (Samples::Windows(train), Samples::Windows(val))
        }
        (Some(p), format) => {
            let (train, val) = data::load_splits(
                Path::new(p),
                d.val_path.as_deref().map(Path::new),
                format,
                d.val_fraction,
                seq_len,
                vocab,
            )?;
            (Samples::Windows(train), Samples::Windows(val))
        }
        (None, _) => {
            let text = std::str::from_utf8(BUNDLED_CORPUS).context("the bundled corpus is UTF-8")?;
            let corpus = Corpus::from_text_with(BUNDLED_NAME, text, tokenizer)?;
            corpus.check_vocab(vocab)?;
            let (train, val) = corpus.split(d.val_fraction, seq_len)?;
            (Samples::Windows(train), Samples::Windows(val))
        }
    };
    Ok((train, val))
}

/// The sampler of a resolved batch.
fn sampler_for(cfg: &Config, batch: &ResolvedBatch, train: &Samples) -> Result<Sampler> {
    let shape =
        BatchShape { micro: batch.micro, accumulation_steps: batch.accumulation_steps, world_size: batch.world_size };
    Ok(Sampler::new(train.n_samples(), shape, cfg.data.shuffle, cfg.data.drop_last, cfg.train.seed)?)
}

/// The per-process memory budget of `train.memory_budget` (default all of
/// what is available now; the plan keeps its margin inside it). A size
/// above what is available is cut to it: the memory check would refuse
/// whatever it picked beyond.
pub fn memory_budget(cfg: &Config, ranks_per_process: usize) -> Result<u64> {
    let threads = memory::allocating_threads(crate::plan::compute_threads(cfg), ranks_per_process);
    let available = memory::Available::now().usable(threads);
    let need_available =
        || available.context("cannot read the available memory from /proc; set train.memory_budget to a size");
    Ok(match cfg.train.memory_budget {
        None => need_available()?,
        Some(config::Budget::Fraction(f)) => (need_available()? as f64 * f) as u64,
        Some(config::Budget::Bytes(b)) => match available {
            Some(a) if a < b => {
                eprintln!(
                    "note: train.memory_budget = {} is more than the {} available; planning for what is available",
                    crate::plan::human(b),
                    crate::plan::human(a)
                );
                a
            }
            _ => b,
        },
    })
}

/// `batch.micro = "auto"`: the largest micro-batch whose planned peak fits
/// the budget, with the accumulation steps that keep the global batch
/// (never a smaller global batch). The choice is written into the config, so
/// `config.resolved.toml` (and a resume) use the same factorization.
fn choose_micro(plan: &mut Plan) -> Result<()> {
    let budget = memory_budget(&plan.cfg, plan.backend.ranks_per_process())?;
    let knobs = crate::plan::Knobs::of(plan);
    let Some(best) = crate::plan::largest_fitting(plan, knobs, budget)? else {
        let at_1 = crate::plan::estimate(plan, knobs)?;
        let report = crate::plan::report(plan, knobs, budget, budget, None)?;
        bail!(
            "batch.micro = \"auto\": not even micro-batch 1 fits the memory budget of {} ({} per process planned at micro 1); change one of these (global batch {} kept):\n{}",
            crate::plan::human(budget),
            crate::plan::human(at_1.per_process()),
            plan.batch.global,
            crate::plan::render(&report)
        );
    };
    plan.memory_budget = Some(budget);
    plan.cfg.batch.micro = Some(Micro::Sequences(best.knobs.micro));
    plan.cfg.batch.accumulation_steps = None;
    plan.batch = plan.cfg.batch.resolve(plan.backend.world_size())?;
    plan.sampler = sampler_for(&plan.cfg, &plan.batch, &plan.train)?;
    eprintln!(
        "batch.micro = \"auto\": micro {} × K {} × W {} (global {}) plans {} per process under the budget of {}",
        plan.batch.micro,
        plan.batch.accumulation_steps,
        plan.batch.world_size,
        plan.batch.global,
        crate::plan::human(best.per_process()),
        crate::plan::human(budget)
    );
    Ok(())
}

/// The model for this plan, storing activations in the configured
/// precision, with `train.trainable` applied.
pub fn model_for(plan: &Plan) -> Result<Box<dyn LanguageModel>> {
    let mut model = plan.family.build(plan.build())?;
    apply_trainable(&mut model, &trainable_patterns(&plan.cfg))?;
    Ok(model)
}

/// The tensors to train: `train.trainable`, except that with `[lora]` and
/// the default `["*"]` only the adapters train (the base is frozen).
pub fn trainable_patterns(cfg: &Config) -> Vec<String> {
    let everything = cfg.train.trainable.len() == 1 && cfg.train.trainable[0] == "*";
    if cfg.lora.is_some() && everything {
        return vec!["*.lora_A.weight".into(), "*.lora_B.weight".into()];
    }
    cfg.train.trainable.clone()
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
pub fn trainer_for(plan: &Plan, model: &impl Model, comm: &mut dyn Communicator) -> Result<Trainer> {
    trainer_from(plan, model, comm, None, &scratch_offload_root())
}

/// Where `verify` and `bench` offload optimizer state (no run folder):
/// a folder of this process under the temporary directory.
pub fn scratch_offload_root() -> PathBuf {
    std::env::temp_dir().join(format!("macrobatch-offload-{}", std::process::id()))
}

/// Removes the offload folder once every rank's files are gone (each
/// trainer removes its own `rank-R/`); a no-op if anything is left in it.
pub fn remove_offload_root(root: &Path) {
    let _ = std::fs::remove_dir(root);
}

/// [`trainer_for`] starting from `initial` parameters (a checkpoint's or a
/// pretrained model's), read a segment at a time: no further full copy.
pub fn trainer_from(
    plan: &Plan,
    model: &impl Model,
    comm: &mut dyn Communicator,
    initial: Option<&[f32]>,
    offload_root: &Path,
) -> Result<Trainer> {
    let n_params = model.layout().n_params();
    let (cfg, o) = (&plan.cfg, &plan.cfg.optim);
    let optimizer = match o.name {
        OptimizerKind::Sgd => Optimizer::Sgd(Sgd::new(n_params, o.momentum, o.nesterov, o.weight_decay)?),
        OptimizerKind::AdamW => Optimizer::AdamW(AdamW::new(n_params, o.beta1, o.beta2, o.eps, o.weight_decay)?),
    };
    let schedule = LrSchedule {
        max_lr: o.lr,
        min_lr: cfg.schedule.min_lr,
        warmup_steps: cfg.schedule.warmup_steps,
        total_steps: cfg.train.steps,
        decay: cfg.schedule.kind,
    };
    let options = TrainerOptions {
        grad_clip: (cfg.train.grad_clip > 0.0).then_some(cfg.train.grad_clip),
        normalization: cfg.train.loss_normalization,
        bucket_elems: bucket_elems(cfg),
        precision: cfg.train.precision,
        loss_scaler: LossScalerConfig {
            initial_scale: cfg.train.initial_loss_scale,
            window: cfg.train.loss_scale_window,
            hysteresis: cfg.train.loss_scale_hysteresis,
            min_scale: cfg.train.min_loss_scale,
        },
    };
    let zero = ZeroConfig { stage: cfg.dist.zero_stage, reduce_every_micro_step: cfg.dist.reduce_every_micro_step };
    let segments = model.segments();
    let init = |seg: usize| match initial {
        Some(p) => p[segments[seg].clone()].to_vec(),
        None => plan.family.init_segment(cfg.train.seed, seg),
    };
    if let Some(p) = initial.filter(|p| p.len() != n_params) {
        bail!("the initial parameters hold {} values, the model {n_params}", p.len());
    }
    let mut trainer = Trainer::distributed_with(model, &init, optimizer, schedule, options, zero, comm)?;
    match cfg.dist.offload_optimizer {
        OffloadOptimizer::None => {}
        OffloadOptimizer::Disk => {
            // After the constructor's broadcasts from rank 0, which created
            // the run folder before taking part: no rank makes it first.
            let dir = offload_root.join(format!("rank-{}", comm.rank()));
            trainer
                .offload_optimizer(&dir)
                .with_context(|| format!("dist.offload_optimizer = \"disk\": cannot set up {}", dir.display()))?;
        }
    }
    Ok(trainer)
}

/// Elements per gradient all-reduce bucket (`dist.bucket_mb` of f32).
pub fn bucket_elems(cfg: &Config) -> usize {
    ((cfg.dist.bucket_mb * (1 << 20) as f64 / 4.0) as usize).max(1)
}

/// This rank's K micro-batches of global step `step_idx` (an error names a
/// token file that cannot be read any more).
pub fn rank_batches(
    plan: &Plan,
    sampler: &Sampler,
    order: &EpochOrder,
    step_in_epoch: usize,
    rank: usize,
) -> Result<Vec<TokenBatch>> {
    (0..sampler.shape().accumulation_steps)
        .map(|k| Ok(plan.train.batch(&sampler.micro_batch(order, step_in_epoch, k, rank))?))
        .collect()
}

/// Mean validation loss over the first `eval_batches` micro-batches (at
/// ZeRO-3 a collective: every rank evaluates the same batches).
fn evaluate(
    trainer: &mut Trainer,
    model: &mut impl Model<Batch = TokenBatch>,
    comm: &mut dyn Communicator,
    plan: &Plan,
) -> Result<f64> {
    let (val, micro) = (&plan.val, plan.batch.micro);
    let n = (micro * plan.cfg.train.eval_batches).min(val.n_samples());
    let idx: Vec<usize> = (0..n).collect();
    let (mut sum, mut count) = (0.0, 0u64);
    for chunk in idx.chunks(micro) {
        let s = trainer.loss(model, comm, &val.batch(chunk)?)?;
        sum += s.loss_sum;
        count += s.n_targets;
    }
    if count == 0 {
        // Loading drops (or refuses) examples without targets, so this is
        // unreachable; a loss of 0 would read as a perfect model.
        bail!("the validation batches hold no target tokens: no validation loss can be measured; check data.val_path");
    }
    Ok(sum / count as f64)
}

/// A `/proc/self/status` memory figure in bytes (`VmHWM`: peak, `VmRSS`: now).
fn proc_status_bytes(key: &str) -> Option<u64> {
    memory::read_kib("/proc/self/status", key)
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
    /// The memory model's per-rank and per-process prediction (`macrobatch plan`).
    predicted: crate::plan::Estimate,
    /// Per rank: resident-set growth from before the trainer existed to after
    /// the first step, less the accounted activations and collective buffers
    /// (the trainer's and the communicator's): the model states as the OS sees them.
    measured_model_states: Vec<u64>,
}

/// The per-rank model-state bytes of docs/contract.md (Memory) in f32 (params 4Ψ, grads 4Ψ, AdamW
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

/// A new run id: sub-second time, process id and a per-process counter, so
/// two runs never share one.
fn new_run_id() -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!(
        "{}-{:09}-{}-{}",
        now.as_secs(),
        now.subsec_nanos(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The run id stored in `dir`, if any.
fn read_run_id(dir: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(dir.join(RUN_ID_FILE)) {
        Ok(t) => Ok(Some(t.trim().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", dir.join(RUN_ID_FILE).display())),
    }
}

/// Where a new run writes: `--out`, or `runs/run-<id>` (created exclusively
/// in [`open_outputs`]). Refuses a folder that holds anything but the
/// leftovers of an unstarted run of ours ([`folder::check_new_run`]).
fn output_dir(args: &TrainArgs, run_id: &str) -> Result<(PathBuf, bool)> {
    let Some(dir) = &args.out else { return Ok((PathBuf::from("runs").join(format!("run-{run_id}")), true)) };
    folder::check_new_run(dir, family::WEIGHTS_FILE)?;
    Ok((dir.clone(), false))
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
        micro: Some(Micro::Sequences(plan.batch.micro)),
        accumulation_steps: Some(plan.batch.accumulation_steps),
    };
    resolved.data.seq_len = Some(plan.train.seq_len());
    resolved.to_toml()
}

/// Creates `dir` for a new run: exclusively for a generated name (two runs
/// started at once never share a folder), or as given by `--out`.
fn create_run_dir(dir: &Path, exclusive: bool) -> Result<PathBuf> {
    if !exclusive {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))?;
        return Ok(dir.to_path_buf());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create output directory {}", parent.display()))?;
    }
    for i in 0..1000 {
        let candidate = if i == 0 { dir.to_path_buf() } else { PathBuf::from(format!("{}-{i}", dir.display())) };
        match std::fs::create_dir(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create output directory {}", candidate.display())),
        }
    }
    bail!("cannot create a new output directory next to {}: 1000 names taken", dir.display())
}

fn open_outputs(plan: &Plan, dir: &Path, resume_step: Option<u64>, run_id: &str) -> Result<Outputs> {
    if resume_step.is_none() {
        gpt::hf::write_atomic(&dir.join(RUN_ID_FILE), format!("{run_id}\n").as_bytes())?;
    }
    gpt::hf::write_atomic(&dir.join(checkpoint::CONFIG), resolved_toml(plan).as_bytes())?;
    // The tokenizer travels with the run, so `generate` and transformers
    // read the model's text as it was trained.
    plan.tokenizer.save_pretrained(dir).with_context(|| format!("cannot save the tokenizer into {}", dir.display()))?;
    let metrics = dir.join("metrics.jsonl");
    if let Some(step) = resume_step {
        checkpoint::truncate_metrics(&metrics, step, |w| eprintln!("{w}"))?;
    }
    let reporter = Reporter::new(&metrics, plan.cfg.train.steps, plan.cfg.train.log_every, resume_step.is_some())?;
    reporter.println(&format!(
        "macrobatch: {} {} ({:.2}M params, {}), batch {} = micro {} × K {} × W {} ({:?}), seq {} | {} train / {} val sequences, {} steps/epoch | {} threads | out {}",
        plan.family.name(),
        plan.cfg.model.preset,
        plan.family.n_params() as f64 / 1e6,
        plan.family.describe(),
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
    pub resume: Option<Arc<Handoff<Loaded>>>,
    /// Pretrained parameters (`--init-from`).
    pub init_params: Option<Arc<Handoff<Vec<f32>>>>,
    /// Stop after this many steps of this invocation.
    pub stop_after: Option<u64>,
    /// Set by SIGINT / SIGTERM.
    pub stop_signal: Arc<AtomicBool>,
    /// Test fault injection.
    pub fault: Option<Fault>,
    /// The number of the signal that asked to stop (0: none).
    pub signal: Arc<AtomicUsize>,
    /// Set when the ranks stopped before `train.steps` (signal or --stop-after).
    pub stopped_early: Arc<AtomicBool>,
    /// This run's identity, written into every checkpoint.
    pub run_id: String,
    /// `--dump-steps`: where the initial trainable tensors and every step's
    /// micro-batches go (one rank).
    pub dump_steps: Option<PathBuf>,
    /// `--merge`: also save the model with its LoRA adapters merged.
    pub merge: bool,
    /// `dist.offload_optimizer = "disk"`: the run folder's `offload/`
    /// (each rank's files in `rank-R/`, removed at the end of the run).
    /// Set once the run folder is known (rank 0 may pick a fresh name).
    pub offload_root: Arc<std::sync::OnceLock<PathBuf>>,
}

/// A value each of `n` ranks of this process takes once; after the last
/// take it is released (the ranks' own references go when they are done).
pub struct Handoff<T> {
    slot: std::sync::Mutex<Option<Arc<T>>>,
    remaining: AtomicUsize,
}

impl<T> Handoff<T> {
    /// `value` for `n` ranks.
    pub fn new(value: T, n: usize) -> Arc<Self> {
        Arc::new(Self { slot: std::sync::Mutex::new(Some(Arc::new(value))), remaining: AtomicUsize::new(n) })
    }

    /// The value (`None` once every rank took it).
    pub fn take(&self) -> Option<Arc<T>> {
        let mut slot = self.slot.lock().ok()?;
        let v = slot.clone();
        if self.remaining.fetch_sub(1, Ordering::SeqCst) <= 1 {
            *slot = None;
        }
        v
    }
}

/// How a training invocation ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// All `train.steps` done and the model saved.
    Finished,
    /// Stopped early by `--stop-after` (checkpoint written).
    StoppedAfter,
    /// Stopped by a signal (checkpoint written): exit 128 + its number.
    Signalled(i32),
}

/// Runs `work` (rank 0's alone: writing a checkpoint) while every other rank
/// waits in tiny all-reduces that rank 0 answers every `interval` — so
/// rank-0-only work of any length never counts against the others'
/// `dist.timeout_s`, while a rank 0 that dies or stalls is still noticed
/// within it. Every rank must call it at the same point (`work` is `Some` on
/// rank 0 only).
fn rank0_phase<T: Send>(
    comm: &mut dyn Communicator,
    interval: Duration,
    work: Option<impl FnOnce() -> Result<T> + Send>,
) -> Result<Option<T>> {
    let Some(work) = work else {
        loop {
            let mut done = [0.0f64];
            comm.all_reduce_sum_f64(&mut done)?;
            if done[0] > 0.0 {
                return Ok(None);
            }
        }
    };
    if comm.world_size() == 1 {
        return work().map(Some);
    }
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        s.spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
                .unwrap_or_else(|_| Err(anyhow!("rank 0 panicked while writing a checkpoint")));
            let _ = tx.send(r);
        });
        loop {
            let r = match rx.recv_timeout(interval) {
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Ok(r) => Some(r),
                Err(mpsc::RecvTimeoutError::Disconnected) => Some(Err(anyhow!("the checkpoint writer vanished"))),
            };
            let mut done = [r.is_some() as u8 as f64];
            comm.all_reduce_sum_f64(&mut done)?;
            if let Some(r) = r {
                return r.map(Some);
            }
        }
    })
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
    // The rank's own heap, from here on (a single rank's thread also holds
    // the data set and the program's allocations from before).
    let heap_base = crate::heap::reset_peak();
    crate::heap::set_phase(crate::heap::Phase::Build);
    let mut model = model_for(plan)?;
    let predicted = crate::plan::estimate(plan, crate::plan::Knobs::of(plan))?;
    let rss_before = proc_status_bytes("VmRSS:");
    // A checkpoint or pretrained parameters: each rank takes them once and
    // the last lets them go, so they are not held for the whole run.
    let resume = start_from.resume.as_ref().and_then(|h| h.take());
    let pretrained = start_from.init_params.as_ref().and_then(|h| h.take());
    let initial = resume.as_ref().map(|l| l.params.as_slice()).or(pretrained.as_deref().map(Vec::as_slice));
    let offload_root = start_from.offload_root.get().context("the run folder is not known yet")?;
    let mut trainer = trainer_from(plan, &model, comm, initial, offload_root)?;
    drop(pretrained);
    let mut model_states_rss = None;
    let mut first_step = 0;
    if let Some(l) = resume {
        let st = &l.state;
        trainer.restore_optimizer(st.schedule_step.unwrap_or(st.step), st.n_updates, |name| {
            l.optimizer.get(name).cloned()
        })?;
        if let Some(sc) = &st.loss_scaler {
            trainer.set_loss_scaler(sc.scale, sc.good_steps, sc.hysteresis_left, sc.n_skipped);
        }
        first_step = st.step;
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
        if mem.offloaded > 0 {
            out.reporter.println(&format!(
                "optimizer state offloaded to disk: {:.1} MB per rank in {}",
                mem.offloaded as f64 / 1e6,
                offload_root.display()
            ));
        }
    }
    // At stage 3 evaluation gathers segments, and wherever the master weights
    // are sharded saving gathers them: every rank joins those collectives.
    let all_ranks_eval = cfg.dist.zero_stage == 3;
    let all_ranks_gather = trainer.master_sharded();
    let steps = cfg.train.steps;
    let config_toml = resolved_toml(plan);
    let start = Instant::now();
    let mut order: Option<(u64, EpochOrder)> = None;
    // Heartbeat of rank-0-only phases: well inside every rank's timeout.
    let heartbeat = Duration::from_secs_f64((cfg.dist.timeout_s / 4.0).clamp(0.001, 1.0));
    let mut skips_at_floor = 0u64;
    for step_idx in first_step..steps {
        let step = step_idx + 1;
        crate::heap::set_phase(crate::heap::Phase::Step);
        if let Some(f) = &start_from.fault {
            f.maybe_fire(rank, step)?;
        }
        let (epoch, step_in_epoch) = plan.sampler.position(step_idx);
        if order.as_ref().map(|o| o.0) != Some(epoch) {
            order = Some((epoch, plan.sampler.epoch_order(epoch)));
        }
        let Some((_, ord)) = order.as_ref() else { bail!("no sample order for epoch {epoch}") };
        let batches = rank_batches(plan, &plan.sampler, ord, step_in_epoch, rank)?;
        // Every rank's input positions, from the indices alone (no collective).
        let input_tokens = if outputs.is_some() {
            let shape = plan.sampler.shape();
            (0..shape.world_size)
                .flat_map(|r| (0..shape.accumulation_steps).map(move |k| (r, k)))
                .map(|(r, k)| plan.train.input_positions(&plan.sampler.micro_batch(ord, step_in_epoch, k, r)) as u64)
                .sum()
        } else {
            0
        };
        if let Some(dir) = &start_from.dump_steps {
            dump_step(dir, step, &batches, (step_idx == first_step).then(|| (&trainer, model.layout())))?;
        }
        let t0 = Instant::now();
        let report = trainer.step(&mut model, comm, &batches)?;
        let step_s = t0.elapsed().as_secs_f64();
        // f16: a scale stuck at its floor that still overflows skips every
        // step and the run makes no progress. (Every rank skips alike.)
        let at_floor = trainer.loss_scaler().is_some_and(|s| s.scale <= cfg.train.min_loss_scale);
        skips_at_floor = if report.skipped && at_floor { skips_at_floor + 1 } else { 0 };
        let max_skips = cfg.train.max_skips_at_min_scale;
        if max_skips > 0 && skips_at_floor >= max_skips {
            bail!(
                "step {step}: {skips_at_floor} steps in a row were skipped for non-finite gradients at the minimum loss scale ({}); the run cannot make progress (lower optim.lr, enable train.grad_clip, use train.precision=bf16, or lower train.min_loss_scale; train.max_skips_at_min_scale sets this limit)",
                cfg.train.min_loss_scale
            );
        }
        if model_states_rss.is_none() {
            drop(batches);
            // The trial that confirms the planner's choice: the first step's
            // measured peak (every allocation of a step has happened by now).
            if let (Some(budget), Some(peak)) = (plan.memory_budget, peak_rss_bytes()) {
                if peak > budget {
                    bail!(
                        "batch.micro = \"auto\" chose micro {} for a budget of {}, but the first step peaked at {} (planned {}); lower train.memory_budget or set batch.micro by hand",
                        plan.batch.micro,
                        crate::plan::human(budget),
                        crate::plan::human(peak),
                        crate::plan::human(predicted.per_process())
                    );
                }
            }
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
        if stop {
            // Agreed by every rank; an error later still wins over this.
            start_from.stopped_early.store(true, Ordering::SeqCst);
        }
        let is_eval = step == steps || (cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0);
        let val_loss = if is_eval && (outputs.is_some() || all_ranks_eval) {
            crate::heap::set_phase(crate::heap::Phase::Eval);
            Some(evaluate(&mut trainer, &mut model, comm, plan)?)
        } else {
            None
        };
        let every = cfg.train.checkpoint_every;
        let is_checkpoint = stop || (every > 0 && (step % every == 0 || step == steps));
        // Full state for the checkpoint (collectives at ZeRO ≥ 1).
        let full_state = if is_checkpoint && (outputs.is_some() || cfg.dist.zero_stage >= 1 || all_ranks_gather) {
            crate::heap::set_phase(crate::heap::Phase::Checkpoint);
            let what = || {
                format!(
                    "writing the checkpoint of step {step}: {}",
                    crate::heap::advice(crate::heap::Phase::Checkpoint)
                )
            };
            let params = trainer.full_params_to_rank0(comm).with_context(what)?;
            let opt = trainer.full_optimizer_state(comm, false).with_context(what)?;
            params.map(|p| (p, opt))
        } else {
            None
        };
        let Some(out) = outputs.as_mut() else {
            if is_checkpoint {
                rank0_phase(comm, heartbeat, None::<fn() -> Result<()>>)?;
            }
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
            input_tokens,
            input_tokens_per_s: input_tokens as f64 / step_s,
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
            mem_predicted: predicted.per_process(),
        })?;
        if let Some((mut params, opt_state)) = full_state {
            if start_from.fault.is_some_and(|f| f.poisons(step)) {
                let last = params.len() - 1;
                params[last] = f32::NAN;
            }
            let (epoch, step_in_epoch) = plan.sampler.position(step);
            let state = TrainerState {
                step,
                n_updates: trainer.optimizer().n_updates(),
                epoch,
                step_in_epoch,
                seed: cfg.train.seed,
                global_batch: plan.batch.global,
                world_size: plan.batch.world_size,
                optimizer: cfg.optim.name,
                schedule_step: Some(trainer.n_steps()),
                loss_scaler: trainer.loss_scaler().map(|s| checkpoint::ScalerState {
                    scale: s.scale,
                    good_steps: s.good_steps,
                    hysteresis_left: s.hysteresis_left,
                    n_skipped: s.n_skipped,
                }),
                run_id: Some(start_from.run_id.clone()),
            };
            let delay = start_from.fault.and_then(|f| f.checkpoint_delay(rank, step));
            let (dir, layout) = (&out.dir, model.layout());
            let write = || -> Result<PathBuf> {
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                let path =
                    checkpoint::save(dir, plan.family.as_ref(), layout, &params, &opt_state, &state, &config_toml)?;
                checkpoint::prune(dir, cfg.train.keep_checkpoints)?;
                Ok(path)
            };
            let path = rank0_phase(comm, heartbeat, Some(write))?.context("rank 0 wrote no checkpoint")?;
            if stop {
                out.reporter.finish();
                let signal = start_from.signal.load(Ordering::SeqCst);
                let how =
                    if signal != 0 { format!(" (signal {signal}: exit code {})", 128 + signal) } else { String::new() };
                eprintln!(
                    "stopped after step {step}{how}; checkpoint {} written. Continue with: macrobatch train --resume {}",
                    path.display(),
                    out.dir.display()
                );
                return Ok(());
            }
        } else if is_checkpoint {
            // Rank 0 without the full state cannot happen; keep the phases paired.
            rank0_phase(comm, heartbeat, Some(|| Ok(())))?;
        }
        if stop {
            return Ok(());
        }
    }
    // Per-rank memory to rank 0 (KiB in f32: exact up to 16 GiB).
    let kib = |b: Option<u64>| (b.unwrap_or(0) / 1024) as f32;
    let rank_heap = Some((crate::heap::peak() - heap_base).max(0) as u64);
    let mine = [kib(peak_rss_bytes()), kib(model_states_rss), kib(rank_heap)];
    let mut all = vec![0.0f32; 3 * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    crate::heap::set_phase(crate::heap::Phase::Save);
    let params = if outputs.is_some() || all_ranks_gather {
        let what = || format!("saving the model: {}", crate::heap::advice(crate::heap::Phase::Save));
        trainer.full_params_to_rank0(comm).with_context(what)?
    } else {
        None
    };
    if let Some(out) = &outputs {
        let m = trainer.memory();
        let file = MemoryFile {
            zero_stage: cfg.dist.zero_stage,
            world_size: comm.world_size(),
            n_params: model.layout().n_params(),
            accounting: m,
            precision: cfg.train.precision,
            formula_model_states: (cfg.train.precision == Precision::F32).then(|| {
                formula_model_states(
                    cfg.dist.zero_stage,
                    !cfg.dist.reduce_every_micro_step,
                    model.layout().n_params(),
                    comm.world_size(),
                )
            }),
            peak_rss: all.chunks(3).map(|c| c[0] as u64 * 1024).collect(),
            peak_rank_heap: all.chunks(3).map(|c| c[2] as u64 * 1024).collect(),
            predicted,
            measured_model_states: all.chunks(3).map(|c| c[1] as u64 * 1024).collect(),
        };
        gpt::hf::write_atomic(&out.dir.join("memory.json"), serde_json::to_string_pretty(&file)?.as_bytes())?;
    }
    if let (Some(out), Some(params)) = (outputs, params) {
        out.reporter.finish();
        checkpoint::check_finite(model.layout(), &params, "final parameters")?;
        plan.family.save_hf(&out.dir, model.layout(), &params)?;
        if start_from.merge {
            match plan.family.merged(&params)? {
                Some((family, merged)) => {
                    let dir = out.dir.join("merged");
                    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
                    let layout = family.build(Build::default())?.layout().clone();
                    family.save_hf(&dir, &layout, &merged)?;
                    plan.tokenizer.save_pretrained(&dir)?;
                    eprintln!("merged model (adapters folded into the weights) saved to {}", dir.display());
                }
                None => eprintln!("warning: --merge: this run has no LoRA adapters to merge; nothing written"),
            }
        }
        eprintln!(
            "done: {steps} steps in {:.1}s; model saved to {} (try: macrobatch generate {} --prompt \"Call me\")",
            start.elapsed().as_secs_f64(),
            out.dir.display(),
            out.dir.display()
        );
    }
    Ok(())
}

/// `--dump-steps`: appends step `step`'s micro-batches to `DIR/steps.jsonl`
/// and, with `initial`, first writes the trainable tensors' values.
fn dump_step(
    dir: &Path,
    step: u64,
    batches: &[TokenBatch],
    initial: Option<(&Trainer, &engine::ParamLayout)>,
) -> Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if let Some((trainer, layout)) = initial {
        let params = trainer.params();
        if params.len() != layout.n_params() {
            bail!("--dump-steps needs unsharded parameters (dist.zero_stage < 3 and f32 or stage 0)");
        }
        let tensors: Vec<(String, Vec<usize>, &[f32])> = layout
            .tensors()
            .iter()
            .filter(|t| t.trainable)
            .map(|t| (t.name.clone(), t.shape.clone(), &params[t.range()]))
            .collect();
        gpt::hf::write_safetensors(&dir.join("initial_trainable.safetensors"), &tensors, &[])?;
    }
    let line = serde_json::json!({
        "step": step,
        "micro_batches": batches.iter().map(|b| serde_json::json!({
            "n_seqs": b.n_seqs, "seq_len": b.seq_len, "inputs": b.inputs, "targets": b.targets,
        })).collect::<Vec<_>>(),
    });
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("steps.jsonl"))
        .with_context(|| format!("cannot write {}", dir.join("steps.jsonl").display()))?;
    writeln!(f, "{line}")?;
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

/// The memory check of a training plan: per-process need against what is available.
pub fn check_memory(plan: &Plan) -> Result<()> {
    let cfg = &plan.cfg;
    let advice = "use a smaller batch.micro (more batch.accumulation_steps keep the global batch), train.activation_checkpointing = \"blocks\", a higher dist.zero_stage with more ranks, train.precision = bf16, or a smaller model (`macrobatch plan` shows what fits)";
    // Shapes whose byte counts overflow 64 bits cannot be planned element by
    // element; their parameters alone rule them out.
    let n_params = plan.family.n_params();
    let threads = memory::allocating_threads(crate::plan::compute_threads(cfg), plan.backend.ranks_per_process());
    if n_params > (u64::MAX / 64) as u128 {
        return memory::check("this run", 4 * n_params, threads, &format!("{n_params} parameters × 4 bytes"), advice);
    }
    let e = crate::plan::estimate(plan, crate::plan::Knobs::of(plan))?;
    let auto = if plan.memory_budget.is_some() { " (chosen by batch.micro = \"auto\")" } else { "" };
    let breakdown = format!(
        "{n_params} parameters; per rank {} bytes of parameters, gradients and optimizer state at ZeRO stage {} in {}, {} bytes of collective buffers and {} bytes of activations for batch.micro = {}{auto} × seq {} (checkpointing {}); {} rank(s) in this process; {} bytes at the peak of all phases (a step: {}, + {} while a checkpoint or the model is saved), + the {}% + {} MiB margin",
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
        crate::plan::MARGIN_PERCENT,
        crate::plan::MARGIN_FIXED >> 20
    );
    memory::check("this run", e.needed() as u128, threads, &breakdown, advice)
}

/// `--set model.KEY=…` that the pretrained model's shape replaced: an error
/// naming both values, instead of silently training another shape.
fn refuse_shape_overrides(
    sets: &[String],
    asked: &serde_json::Value,
    pinned: &serde_json::Value,
    source: &Path,
) -> Result<()> {
    // The last --set of a key is the one in effect.
    let mut seen = std::collections::HashSet::new();
    for set in sets.iter().rev() {
        let Some(key) = set.split_once('=').map(|(k, _)| k.trim()).and_then(|k| k.strip_prefix("model.")) else {
            continue;
        };
        if !seen.insert(key) {
            continue;
        }
        // Token ids are not shape: --set may choose them.
        if matches!(key, "bos_token_id" | "eos_token_id") {
            continue;
        }
        let (a, p) = (asked.get(key), pinned.get(key));
        // A float read from GGUF went through f32: equal within its precision.
        let same_float = matches!((a.and_then(|v| v.as_f64()), p.and_then(|v| v.as_f64())),
            (Some(x), Some(y)) if (x - y).abs() <= 1e-6 * x.abs().max(y.abs()));
        if a != p && !same_float {
            let show = |v: Option<&serde_json::Value>| v.map_or("unset".to_string(), |v| v.to_string());
            bail!(
                "--set {set} conflicts with --init-from {}: the pretrained model has model.{key} = {}, and its shape is what gets trained; drop --set model.{key} (the shape comes from the pretrained model)",
                source.display(),
                show(p)
            );
        }
    }
    Ok(())
}

/// `macrobatch train`.
pub fn run(args: TrainArgs) -> Result<Outcome> {
    // The run folder's lock, held until this function returns.
    let held_lock: std::sync::Mutex<Option<folder::FolderLock>> = std::sync::Mutex::new(None);
    let writes_folder = folder::writes_run_folder()?;
    let resume_dir = match &args.resume {
        None => None,
        Some(Some(d)) => {
            if let Some(out) = args.out.as_ref().filter(|o| !folder::same_path(o, d)) {
                bail!(
                    "--resume {} continues that run in its own folder, so --out {} would be ignored; drop --out (or copy the run folder to {} and resume that)",
                    d.display(),
                    out.display(),
                    out.display()
                );
            }
            Some(d.clone())
        }
        Some(None) => Some(args.out.clone().context("--resume needs the run directory: --resume DIR (or --out DIR)")?),
    };
    let (cfg, resume) = match &resume_dir {
        Some(dir) => {
            if args.config.is_some() || args.deepspeed.config_model.is_some() || args.deepspeed.strict {
                bail!("--resume continues with the config saved in the checkpoint; drop the CONFIG argument (and --config-model, --strict; use --set to override single keys)");
            }
            if !dir.is_dir() {
                bail!("--resume {}: no such run folder", dir.display());
            }
            // Before anything in the folder is read or moved: one process
            // per run folder (rank 0 of an MPI job; the others only read).
            if writes_folder {
                *held_lock.lock().map_err(|_| anyhow!("lock slot poisoned"))? =
                    Some(folder::lock(dir, "train --resume")?);
                for line in checkpoint::clean_leftovers(dir)? {
                    eprintln!("{line}");
                }
            }
            let loaded =
                crate::heap::during(crate::heap::Phase::Load, || checkpoint::latest_valid(dir, |w| eprintln!("{w}")))?;
            let folder_id = read_run_id(dir)?;
            match (&folder_id, &loaded.state.run_id) {
                (Some(f), Some(c)) if f != c => bail!(
                    "checkpoint {} belongs to run {c}, but {} is run {f}: refusing to continue another run's checkpoint",
                    loaded.dir.display(),
                    dir.display()
                ),
                (Some(f), None) => bail!(
                    "checkpoint {} has no run id, but {} is run {f}: it was not written by this run; refusing to adopt it",
                    loaded.dir.display(),
                    dir.display()
                ),
                _ => {}
            }
            eprintln!("resuming from {} (step {})", loaded.dir.display(), loaded.state.step);
            let origin = loaded.dir.join(checkpoint::CONFIG).display().to_string();
            (Config::from_toml(&loaded.config_toml, &origin, &args.set)?, Some(loaded))
        }
        None => (load_config(args.config.as_deref(), &args.set, &args.deepspeed)?, None),
    };
    let mut cfg = cfg;
    // Checked before anything is read or created.
    cfg.validate()?;
    let init_params = match &args.init_from {
        Some(path) if resume.is_none() => {
            memory::check_load(path, &format!("--init-from {}", path.display()))
                .with_context(|| format!("--init-from {}: cannot load the model", path.display()))?;
            let (pretrained, params) = crate::heap::during(crate::heap::Phase::Load, || family::load_hf(path))
                .with_context(|| format!("--init-from {}: cannot load the model", path.display()))?;
            // The pretrained family and shape win over the preset; with
            // [lora], freshly initialised adapters join the pretrained base.
            let asked = serde_json::to_value(&cfg.model).unwrap_or_default();
            pretrained.pin_shape(&mut cfg.model);
            refuse_shape_overrides(&args.set, &asked, &serde_json::to_value(&cfg.model).unwrap_or_default(), path)?;
            // Its tokenizer, unless one is configured.
            if cfg.data.tokenizer.is_none() {
                if family::is_gguf(path) {
                    cfg.data.tokenizer = Some(TokenizerSpec::Gguf(path.clone()));
                } else if path.join("tokenizer.json").exists() {
                    cfg.data.tokenizer = Some(TokenizerSpec::TokenizerJson(path.join("tokenizer.json")));
                }
            }
            let family = family::from_config(&cfg.model, cfg.lora.as_ref())?;
            Some(family.start_from_pretrained(params, cfg.train.seed)?)
        }
        Some(_) => bail!("--init-from and --resume exclude each other: a resumed run continues from its checkpoint"),
        None => {
            if cfg.lora.is_some() && resume.is_none() {
                eprintln!(
                    "warning: [lora] without --init-from trains adapters on a randomly initialised, frozen base; fine-tuning means --init-from a pretrained model (a Hugging Face folder or a GGUF file)"
                );
            }
            None
        }
    };
    let backend = dist::detect(cfg.dist.world_size)?;
    let plan = Arc::new(plan(cfg, backend)?);
    if let Some(l) = &resume {
        let (saved, wanted) = (l.model.hf_config(), plan.family.hf_config());
        if saved != wanted {
            let keys: std::collections::BTreeSet<&String> =
                saved.as_object().into_iter().chain(wanted.as_object()).flat_map(|o| o.keys()).collect();
            let differ: Vec<String> = keys
                .into_iter()
                .filter(|k| saved.get(k.as_str()) != wanted.get(k.as_str()))
                .map(|k| {
                    let show = |v: Option<&serde_json::Value>| v.map_or("absent".to_string(), |v| v.to_string());
                    format!("{k}: {} in the checkpoint, {} in the config", show(saved.get(k)), show(wanted.get(k)))
                })
                .collect();
            bail!(
                "the checkpoint in {} holds a model of shape {} {} but the config asks for {} {} ({}); resume with the run's own [model] settings",
                l.dir.display(),
                l.model.name(),
                l.model.describe(),
                plan.family.name(),
                plan.family.describe(),
                differ.join("; ")
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
        if plan.cfg.train.steps < l.state.step {
            bail!(
                "train.steps = {} is below the checkpoint's step {} ({}): a run cannot go back; resume with train.steps >= {} (or start a new run)",
                plan.cfg.train.steps,
                l.state.step,
                l.dir.display(),
                l.state.step
            );
        }
    }
    let cfg = &plan.cfg;
    if args.dump_steps.is_some() && plan.batch.world_size > 1 {
        bail!("--dump-steps records one rank's run; use dist.world_size = 1");
    }
    for w in cfg.warnings() {
        eprintln!("warning: {w}");
    }
    check_memory(&plan)?;
    if cfg.train.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.train.threads)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let run_id = match (&resume_dir, &resume) {
        (Some(dir), Some(l)) => match read_run_id(dir)? {
            Some(id) => id,
            None => {
                // A folder from before run ids: take the checkpoint's, or give it one.
                let id = l.state.run_id.clone().unwrap_or_else(new_run_id);
                if writes_folder {
                    gpt::hf::write_atomic(&dir.join(RUN_ID_FILE), format!("{id}\n").as_bytes())?;
                }
                id
            }
        },
        _ => new_run_id(),
    };
    // Checked on every rank; created by rank 0 alone (under MPI the other
    // ranks never touch the file system).
    let (planned_dir, generated) = match &resume_dir {
        Some(d) => (d.clone(), false),
        None => output_dir(&args, &run_id)?,
    };
    let created_dir = resume_dir.is_none() && !planned_dir.exists();
    let made: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    let offload_root: Arc<std::sync::OnceLock<PathBuf>> = Arc::default();
    let make_dir = || -> Result<PathBuf> {
        let d = if resume_dir.is_some() {
            planned_dir.clone()
        } else {
            let d = create_run_dir(&planned_dir, generated)?;
            // Checked again under the lock: another process may have
            // started a run here since the check before the plan.
            let lock = folder::lock_then(&d, "train", || folder::check_new_run(&d, family::WEIGHTS_FILE))?;
            if folder::unstarted_run(&d) {
                eprintln!("{}: replacing what a run that never finished a step left there", d.display());
                folder::clear_unstarted(&d, false);
            }
            *held_lock.lock().map_err(|_| anyhow!("lock slot poisoned"))? = Some(lock);
            d
        };
        let _ = offload_root.set(d.join("offload"));
        if let Ok(mut m) = made.lock() {
            *m = Some(d.clone());
        }
        Ok(d)
    };
    let stop_signal = Arc::new(AtomicBool::new(false));
    let signal = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // A second signal while the first is being honoured ends the process at once.
        signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, stop_signal.clone())
            .context("cannot install signal handler")?;
        signal_hook::flag::register_usize(sig, signal.clone(), sig as usize)
            .context("cannot install signal handler")?;
        signal_hook::flag::register(sig, stop_signal.clone()).context("cannot install signal handler")?;
    }
    let resume_step = resume.as_ref().map(|l| l.state.step);
    // Every rank of this process takes the start once; the last lets it go.
    let ranks_here = backend.ranks_per_process();
    let start = Start {
        resume: resume.map(|l| Handoff::new(l, ranks_here)),
        init_params: init_params.map(|p| Handoff::new(p, ranks_here)),
        stop_after: args.stop_after,
        dump_steps: args.dump_steps.clone(),
        merge: args.merge,
        stop_signal: stop_signal.clone(),
        fault: Fault::from_env()?,
        signal: signal.clone(),
        stopped_early: Arc::new(AtomicBool::new(false)),
        run_id: run_id.clone(),
        offload_root: offload_root.clone(),
    };
    let stopped_early = start.stopped_early.clone();
    let timeout = Duration::from_secs_f64(cfg.dist.timeout_s);
    let result = match backend {
        Backend::Single => make_dir()
            .and_then(|dir| open_outputs(&plan, &dir, resume_step, &run_id))
            .and_then(|out| train_rank(&plan, &mut comm::SingleProcess::new(), Some(out), &start)),
        Backend::Threads(world) => {
            make_dir().and_then(|dir| open_outputs(&plan, &dir, resume_step, &run_id)).and_then(|out| {
                let outputs = std::sync::Mutex::new(Some(out));
                let plan = plan.clone();
                let start = start.clone();
                run_thread_ranks(world, timeout, move |c| {
                    let out = if c.rank() == 0 { outputs.lock().ok().and_then(|mut o| o.take()) } else { None };
                    train_rank(&plan, c, out, &start)
                })
            })
        }
        Backend::Mpi(_) => {
            let mut c = dist::mpi_comm(timeout)?;
            // Every rank checked the output directory above; rank 0 alone writes it.
            let r = match c.rank() {
                0 => make_dir()
                    .and_then(|dir| open_outputs(&plan, &dir, resume_step, &run_id))
                    .and_then(|out| train_rank(&plan, c.as_mut(), Some(out), &start)),
                _ => {
                    // Other processes never create the run folder; rank 0
                    // has by the time the trainers' broadcast completes.
                    let _ = offload_root.set(planned_dir.join("offload"));
                    train_rank(&plan, c.as_mut(), None, &start)
                }
            };
            if let Err(e) = &r {
                c.abort(&format!("{e:#}"));
            }
            r
        }
    };
    if let Some(root) = offload_root.get() {
        remove_offload_root(root);
    }
    if let (Ok(()), Some(dir)) = (&result, made.lock().ok().and_then(|m| m.clone())) {
        crate::plot::after_train(&dir);
    }
    if let Err(e) = result {
        if resume_step.is_none() {
            if let Some(dir) = made.lock().ok().and_then(|m| m.clone()) {
                // Only what this run wrote; anything else that appeared
                // meanwhile (a `tee DIR/log.txt`) stays, and so does a folder holding it.
                folder::remove_unstarted(&dir, created_dir);
            }
        }
        return Err(e);
    }
    Ok(match (stopped_early.load(Ordering::SeqCst), signal.load(Ordering::SeqCst)) {
        (false, _) => Outcome::Finished,
        (true, 0) => Outcome::StoppedAfter,
        (true, n) => Outcome::Signalled(n as i32),
    })
}
