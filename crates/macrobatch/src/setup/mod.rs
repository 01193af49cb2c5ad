//! Run set-up shared by the commands that train, measure or plan a run
//! (`train`, `bench`, `verify`, `plan`): the config as read (TOML or
//! DeepSpeed JSON, with `--set`), the validated [`Plan`] (model, data,
//! batch, launcher), `batch.micro = "auto"`, and the model, trainer,
//! groups ([`RankComms`]) and micro-batches of a rank.

mod optimizer;
mod rank_comms;
mod samples;
mod sources;
mod trainer;

pub use optimizer::state_size;
pub use rank_comms::{FullState, RankComms};
pub use samples::{rank_batches, text_corpus, text_files};
pub use sources::check_mixture_position;
pub use trainer::{
    apply_trainable, bucket_elems, model_for, model_for_rank, remove_offload_root, remove_scratch_offload_root,
    scratch_offload_root, tensor_family, trainable_patterns, trainer_for, trainer_from, trainer_placed, Initial,
    Placement,
};

use crate::dist::{Backend, Grid};
use crate::family::{self, Build, Family};
use crate::DeepSpeedArgs;
use anyhow::{bail, Context, Result};
use config::{Config, Micro, ResolvedBatch};
use data::{Sampler, Samples, Tokenizer, TokenizerSpec};
use engine::StagedModel;
use samples::{load_samples, sampler_for};
use std::path::Path;
use std::sync::Arc;

/// Everything a run needs, checked before the first step.
pub struct Plan {
    /// The validated config (with "auto" resolved to the chosen micro-batch).
    pub cfg: Config,
    /// The model family and shape.
    pub family: Arc<dyn Family>,
    /// With `batch.micro = "auto"`: the budget the micro-batch was chosen
    /// for, checked against the measured peak after the first step.
    pub memory_budget: Option<u64>,
    /// How the ranks run: one, threads of this process, or MPI.
    pub backend: Backend,
    /// The global batch as micro × K × D, D the data-parallel ranks
    /// (`world_size` here: the world's ranks without a split, world / (P · T) with one).
    pub batch: ResolvedBatch,
    /// The world's ranks as pipeline stages × data-parallel ranks × tensor-parallel ranks.
    pub grid: Grid,
    /// The training samples.
    pub train: Samples,
    /// The validation samples.
    pub val: Samples,
    /// The tokenizer of the data (saved into the run folder for `generate`).
    pub tokenizer: Arc<Tokenizer>,
    /// The order of the training samples, step by step and rank by rank.
    pub sampler: Sampler,
}

impl Plan {
    /// How the model is built: activation precision and checkpointing.
    pub fn build(&self) -> Build {
        Build {
            precision: self.cfg.train.precision,
            checkpointing: self.cfg.train.activation_checkpointing,
            whole_len: None,
        }
    }
}

/// Reads the config file (if any; TOML with its `extends` chain resolved)
/// and applies `--set` overrides. A path ending in `.json` is a DeepSpeed config, translated (with
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
            Some(p) => (config::read_toml(p)?, p.display().to_string()),
            None => (String::new(), "default config".to_string()),
        };
        return Ok(Config::from_toml(&text, &origin, sets)?);
    }
    let path = path.context("a DeepSpeed config needs its path")?;
    let companion = match &ds.config_model {
        Some(p) => Some((config::read_toml(p)?, p.display().to_string())),
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
/// launcher, before anything runs, into a [`Plan`]. With `batch.micro =
/// "auto"` the plan is at micro 1 and the flag is set:
/// [`crate::planning::plan`] then picks the micro-batch that fits.
pub fn resolve(cfg: Config, backend: Backend) -> Result<(Plan, bool)> {
    resolve_with(cfg, backend, true)
}

/// [`resolve`] without reading any data: the configuration's `[data]` is
/// set aside but for `data.seq_len` (unset: the model's context), and
/// the plan holds one synthetic window of that length per split (a byte
/// tokenizer) — what `plan --no-data` plans a shape with.
pub fn resolve_shapes(mut cfg: Config, backend: Backend) -> Result<(Plan, bool)> {
    if cfg.train.objective == config::Objective::Dpo {
        bail!("plan --no-data plans the language-modelling loss on synthetic windows; train.objective = \"dpo\" reads its preference pairs: drop --no-data and give data.path");
    }
    cfg.data = config::DataConfig { seq_len: cfg.data.seq_len, drop_last: false, ..config::DataConfig::default() };
    resolve_with(cfg, backend, false)
}

fn resolve_with(mut cfg: Config, backend: Backend, read_data: bool) -> Result<(Plan, bool)> {
    cfg.validate()?;
    let auto_micro = start_auto_micro(&mut cfg)?;
    let family = with_frozen_storage(family::from_config(&cfg.model, cfg.lora.as_ref())?, &cfg)?;
    if let (config::Objective::Dpo, Some(e)) = (cfg.train.objective, family.n_experts()) {
        bail!(
            "train.objective = \"dpo\" with a mixture of experts ({e} experts) is not implemented: its router losses have no place in the preference loss yet; train it with objective = \"lm\""
        );
    }
    // An error at micro 1 is the user's "auto", not a micro they wrote.
    let auto_context = |e: anyhow::Error| match auto_micro {
        true => e.context("batch.micro = \"auto\" (checked at micro = 1, the smallest it can choose)"),
        false => e,
    };
    // The layout alone (no activations are allocated before the first batch).
    let mut layout_model = family.build(Build::default())?;
    apply_trainable(&mut layout_model, &trainable_patterns(&cfg))?;
    let grid = Grid::new(&cfg.dist, backend.world_size(), backend.world_source(), layout_model.n_blocks())?;
    drop(layout_model);
    if grid.is_tensor_parallel() {
        // Rank 0's shard (every rank's has the same shape): a shape or a
        // family that cannot split is refused here, before any folder exists.
        tensor_family(family.as_ref(), grid.tp_rank(0))?;
    }
    let batch = resolve_batch(&cfg, &grid).map_err(auto_context)?;
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
    let (train, val) = match read_data {
        true => load_samples(&cfg, &tokenizer, seq_len, family.vocab_size())?,
        false => {
            let windows = |split, n: usize| data::TokenDataset::new(split, vec![0; n * seq_len + 1], seq_len);
            (Samples::Windows(windows("train", 1)?), Samples::Windows(windows("val", 1)?))
        }
    };
    let sampler = sampler_for(&cfg, &batch, &train).map_err(auto_context)?;
    let tokenizer = Arc::new(tokenizer);
    let plan = Plan { cfg, family, memory_budget: None, backend, batch, grid, train, val, tokenizer, sampler };
    Ok((plan, auto_micro))
}

impl Plan {
    /// The plan at micro-batch `micro` with the accumulation steps that
    /// keep the global batch, written into the config (so
    /// `config.resolved.toml` and a resume use the same factorization).
    pub fn set_micro(&mut self, micro: usize) -> Result<()> {
        self.cfg.batch.micro = Some(Micro::Sequences(micro));
        self.cfg.batch.accumulation_steps = None;
        self.batch = resolve_batch(&self.cfg, &self.grid)?;
        self.sampler = sampler_for(&self.cfg, &self.batch, &self.train)?;
        Ok(())
    }
}

/// What `train.frozen_dtype` asks of the frozen tensors, read from
/// `train.frozen_source` (or `source` when given). A split model keeps its
/// base in f32 under `auto` (a packed base is kept whole).
pub fn frozen_storage(cfg: &Config, source: Option<&Path>) -> family::FrozenStorage {
    let split = cfg.dist.tensor_parallel > 1 || cfg.dist.pipeline_parallel > 1 || cfg.dist.context_parallel > 1;
    let dtype = match cfg.train.frozen_dtype {
        config::FrozenDtype::Auto if split => config::FrozenDtype::F32,
        d => d,
    };
    family::FrozenStorage {
        dtype,
        double_quant: cfg.train.frozen_double_quant,
        source: source.map(Path::to_path_buf).or_else(|| cfg.train.frozen_source.clone()),
    }
}

/// `family` with its frozen tensors stored as `train.frozen_dtype` says
/// (itself when they stay f32 in the layout).
pub fn with_frozen_storage(family: Arc<dyn Family>, cfg: &Config) -> Result<Arc<dyn Family>> {
    let storage = frozen_storage(cfg, None);
    Ok(family.with_frozen_storage(&storage)?.unwrap_or(family))
}

/// The batch triple over the data-parallel ranks: global = micro × K × D
/// (every stage of a pipeline and every tensor-parallel rank sees the same
/// micro-batches, so neither multiplies the batch).
fn resolve_batch(cfg: &Config, grid: &Grid) -> Result<ResolvedBatch> {
    let split = grid.is_tensor_parallel() || grid.context > 1;
    cfg.batch.resolve(grid.data).map_err(|e| match (grid.is_pipeline(), split) {
        (false, false) => e.into(),
        (true, false) => anyhow::Error::from(e).context(format!(
            "with dist.pipeline_parallel = {} the batch counts the data-parallel ranks: world_size = D = {} here (world / P)",
            grid.stages, grid.data
        )),
        (_, true) => anyhow::Error::from(e).context(format!(
            "with dist.pipeline_parallel = {}, dist.tensor_parallel = {} and dist.context_parallel = {} the batch counts the data-parallel ranks: world_size = D = {} here (world / (P · T · C))",
            grid.stages, grid.tensor, grid.context, grid.data
        )),
    })
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
