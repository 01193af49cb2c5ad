//! The TOML configuration: sections, defaults, `--set section.key=value`
//! overrides, and validation of everything that does not need the model or
//! the data. One spelling per field: the Rust field, the TOML key and the
//! `--set` path are the same.

mod deepspeed;
mod extends;
mod loop_controls;
mod objective;
mod optimizers;
mod sources;
mod validate;

pub use data::{DataFormat, Schema, TokenizerSpec};
pub use deepspeed::{DeepSpeedConfig, DeepSpeedOptions};
pub use engine::{
    AdafactorConfig, Checkpointing, ContextAttention, Decay, LossNormalization, OptimizerKind, Precision, ScheduleKind,
};
pub use extends::read_toml;
pub use loop_controls::EarlyStopping;
pub use objective::Objective;
pub use optimizers::LionConfig;
use serde::{Deserialize, Serialize};
pub use sources::SourceConfig;
use thiserror::Error;

/// Errors in the configuration, each naming the field and the fix.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The base file an `extends` names cannot be read.
    #[error("cannot read base config {path} (extends in {named_by})")]
    ReadBase {
        /// The base file, relative to the folder of the file naming it.
        path: String,
        /// The file whose `extends` names it.
        named_by: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// TOML syntax or an unknown / mistyped key.
    #[error("{origin}: {message}")]
    Parse {
        /// Which file or override.
        origin: String,
        /// The parser's message (names the key and its line).
        message: String,
    },
    /// A `--set` argument is not `key=value`.
    #[error("--set `{0}`: expected section.key=value, e.g. --set train.steps=30")]
    BadOverride(String),
    /// The batch triple is inconsistent or not divisible.
    #[error("batch: {0}")]
    Batch(String),
    /// A value is out of range.
    #[error("{field} = {value}: {rule}")]
    Invalid {
        /// Dotted key.
        field: &'static str,
        /// The value given.
        value: String,
        /// What it must satisfy.
        rule: String,
    },
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Model shape.
    pub model: ModelConfig,
    /// Data source.
    pub data: DataConfig,
    /// Batch factorization.
    pub batch: BatchConfig,
    /// The run.
    pub train: TrainConfig,
    /// Optimizer.
    pub optim: OptimConfig,
    /// Learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// Data parallelism.
    pub dist: DistConfig,
    /// LoRA adapters: `r`, `alpha`, `dropout`, `target_modules` (the
    /// family's projection names, or `all-linear`). The base is frozen: no
    /// gradient, no optimizer state; the adapters train. Parsed and checked
    /// by the family, which knows its projections.
    pub lora: Option<toml::Table>,
}

/// `[dist]`: data, tensor and pipeline parallelism.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// Ranks as threads of this process (ignored under an MPI launcher, which
    /// sets the world size itself; there it must be 1 or equal to it).
    pub world_size: usize,
    /// Gradient all-reduce bucket size in MiB.
    pub bucket_mb: f64,
    /// Seconds a rank waits in a collective before declaring the others lost.
    pub timeout_s: f64,
    /// Compare parameter checksums across ranks every N optimizer steps (0: only at start).
    pub check_every: u64,
    /// ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 + gradients, 3 + parameters.
    pub zero_stage: u8,
    /// Stage 2: reduce-scatter gradients after every micro-step (gradient memory 1/W, K× the bytes).
    pub reduce_every_micro_step: bool,
    /// Start each gradient bucket's collective (stage 2: each segment's
    /// reduce-scatter) under the last micro-step's backward, as soon as its
    /// layers are done, on a thread of its own; per-segment reduction
    /// (ZeRO-3, `reduce_every_micro_step`) sends each segment's without
    /// waiting, and ZeRO-3 gathers the next segment ahead. The same
    /// collectives, the same bits. Data parallelism only; under MPI it
    /// needs `MPI_THREAD_MULTIPLE`.
    pub overlap_comm: bool,
    /// Where the optimizer state lives: memory, or files streamed through
    /// small window buffers during the update (`"disk"`).
    pub offload_optimizer: OffloadOptimizer,
    /// Pipeline stages P: the model's layer stack cut into P contiguous
    /// stages (the embedding with the first, the final norm, head and loss
    /// with the last); the world's ranks form P × D with D = world / P
    /// data-parallel ranks per stage. 1: no pipeline.
    pub pipeline_parallel: usize,
    /// The order a stage runs its micro-batches in: `1f1b` (one forward,
    /// one backward; at most P − s micro-batches' activations alive on
    /// stage s) or `gpipe` (every forward, then every backward).
    pub pipeline_schedule: ScheduleKind,
    /// Layers per stage, by hand (P positive counts summing to the model's
    /// layers); unset: an even split, the first stages taking the remainder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_layers: Option<Vec<usize>>,
    /// Tensor-parallel ranks T: each block's attention heads and MLP
    /// columns split over T ranks (Megatron-LM's split), which run the same
    /// micro-batches; the world's ranks form P × D × T. 1: no split.
    pub tensor_parallel: usize,
    /// With `tensor_parallel` > 1, the token embedding and the head split
    /// by vocabulary rows over the T ranks too (Megatron-LM's
    /// vocab-parallel embedding and cross-entropy: each rank holds V / T
    /// rows and the logits of its slice only; T must divide the
    /// vocabulary). `false`: both whole on every rank; at T = 1 nothing
    /// is split either way.
    pub vocab_parallel: bool,
    /// With `tensor_parallel` > 1, sequence parallelism (Korthikanti et
    /// al., Megatron-LM's `--sequence-parallel`): the residual stream's
    /// rows — the embedding's output, every norm and residual addition,
    /// the final norm — split over the T ranks (⌈B·T / T⌉ rows each), the
    /// all-reduce after each row-parallel projection a reduce-scatter and
    /// the one before each column-parallel projection's input gradient an
    /// all-gather in forward and a reduce-scatter in backward (the
    /// backward gathers each column projection's input again for its
    /// weights' gradient, as Megatron-LM does), the activations of those
    /// regions divided by T.
    /// `false`: every rank holds every row.
    pub sequence_parallel: bool,
    /// Context-parallel ranks C: each sequence's positions split over C
    /// ranks, which run the same micro-batches — each sequence cut into 2C
    /// chunks, rank c holding chunks c and 2C − 1 − c (the causal load
    /// balanced), every layer run on its positions only, attention over
    /// every rank's keys and values (gathered per layer; their gradients
    /// summed back). The world's ranks form P × D × C × T (rank r = stage ·
    /// (D·C·T) + d · (C·T) + c · T + t); the C ranks of a data rank sum
    /// their gradients with the data-parallel ranks. 1: whole sequences.
    pub context_parallel: usize,
    /// With `context_parallel` > 1, how attention reaches the other
    /// ranks' keys and values: `"ring"` (each rank's block passed around
    /// the group, C − 1 buffered sends per layer overlapping the attention
    /// over the block at hand; two blocks held at a time) or `"all_gather"`
    /// (one all-gather per layer and one reduce-scatter of the gradients;
    /// the whole sequence's keys and values held during the call).
    pub context_attention: ContextAttention,
}

impl DistConfig {
    /// The data-parallel width D = `world` / (`pipeline_parallel` ·
    /// `tensor_parallel` · `context_parallel`) of a world of `world` ranks
    /// (`source` names where that number comes from); an error naming the
    /// keys and the fix unless P · T · C divides it.
    pub fn data_parallel(&self, world: usize, source: &str) -> Result<usize, ConfigError> {
        let c = self.context_parallel;
        if c == 0 {
            return Err(invalid("dist.context_parallel", c, "must be at least 1 (1: whole sequences)"));
        }
        if c > 1 {
            let replica = self.pipeline_parallel.saturating_mul(self.tensor_parallel).saturating_mul(c);
            if !world.is_multiple_of(replica) {
                return Err(invalid(
                    "dist.context_parallel",
                    c,
                    &format!(
                        "dist.pipeline_parallel = {} × dist.tensor_parallel = {} × dist.context_parallel = {c} = {replica} ranks per data-parallel replica must divide the world size {world} ({source}); use a world size that is a multiple of {replica}, or a smaller dist.context_parallel",
                        self.pipeline_parallel, self.tensor_parallel
                    ),
                ));
            }
            let whole = DistConfig { context_parallel: 1, ..self.clone() };
            return whole.data_parallel(world / c, source);
        }
        let (p, t) = (self.pipeline_parallel, self.tensor_parallel);
        if p == 0 {
            return Err(invalid("dist.pipeline_parallel", p, "must be at least 1 (1: no pipeline)"));
        }
        if t == 0 {
            return Err(invalid("dist.tensor_parallel", t, "must be at least 1 (1: no tensor split)"));
        }
        if t == 1 && !world.is_multiple_of(p) {
            return Err(invalid(
                "dist.pipeline_parallel",
                p,
                &format!(
                    "must divide the world size {world} ({source}) into P stages × D data-parallel ranks; use a world size that is a multiple of {p}, or a divisor of {world} as dist.pipeline_parallel"
                ),
            ));
        }
        let pt = p.saturating_mul(t);
        if !world.is_multiple_of(pt) {
            return Err(invalid(
                "dist.tensor_parallel",
                t,
                &format!(
                    "dist.pipeline_parallel = {p} × dist.tensor_parallel = {t} = {pt} ranks per data-parallel replica must divide the world size {world} ({source}) into P stages × T tensor ranks × D data-parallel ranks; use a world size that is a multiple of {pt}, or a smaller dist.tensor_parallel or dist.pipeline_parallel"
                ),
            ));
        }
        Ok(world / pt)
    }
}

/// `dist.offload_optimizer`: where each rank keeps its optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadOptimizer {
    /// In memory (default).
    #[default]
    None,
    /// In files under the run folder's `offload/rank-R/`, read and written
    /// back window by window during each update; bit-identical updates.
    Disk,
}

impl Default for DistConfig {
    fn default() -> Self {
        Self {
            world_size: 1,
            bucket_mb: 25.0,
            timeout_s: 300.0,
            check_every: 100,
            zero_stage: 0,
            reduce_every_micro_step: false,
            overlap_comm: false,
            offload_optimizer: OffloadOptimizer::None,
            pipeline_parallel: 1,
            pipeline_schedule: ScheduleKind::OneFOneB,
            pipeline_layers: None,
            tensor_parallel: 1,
            vocab_parallel: false,
            sequence_parallel: false,
            context_parallel: 1,
            context_attention: ContextAttention::Ring,
        }
    }
}

/// `[model]`: a family, a preset, and the family's own keys (single
/// dimensions overridden, e.g. `n_layer = 4`). The family parses and checks
/// those keys itself (an unknown key or one the family does not have is its
/// error), so this crate knows no model family. A shape taken whole from a
/// pretrained model (`train --init-from`) names that model as its `source`
/// and no preset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelConfig {
    /// The family: Hugging Face's `model_type` (`gpt2`, `llama`, `qwen2`, `qwen3`, `mistral`).
    pub family: String,
    /// One of the family's presets (`macrobatch plan --help` lists them);
    /// none when the shape was pinned from a model (`source`): the keys are
    /// that model's, and the family starts from its default preset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    /// The pretrained model (folder or GGUF file) whose shape the keys are,
    /// recorded by `--init-from`; a record only: nothing is loaded from it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The family's keys, as written.
    #[serde(flatten)]
    pub shape: toml::Table,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            family: DEFAULT_FAMILY.into(),
            preset: Some(DEFAULT_PRESET.into()),
            source: None,
            shape: toml::Table::new(),
        }
    }
}

impl ModelConfig {
    /// The preset the family's keys override: `preset`, else the default
    /// (always the default under a `source`, whose keys are the whole shape).
    pub fn base_preset(&self) -> &str {
        match self.source {
            Some(_) => DEFAULT_PRESET,
            None => self.preset.as_deref().unwrap_or(DEFAULT_PRESET),
        }
    }

    /// The shape's name for people: its source, else its preset.
    pub fn label(&self) -> String {
        match &self.source {
            Some(s) => format!("from {s}"),
            None => self.base_preset().to_string(),
        }
    }
}

/// The preset `[model]` means when it names none.
pub const DEFAULT_PRESET: &str = "tiny";

/// The family `[model]` means when it names none.
pub const DEFAULT_FAMILY: &str = "gpt2";

/// `[data]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// A data file; unset means the bundled corpus (Moby-Dick).
    pub path: Option<String>,
    /// `text` (UTF-8, byte tokens), or a token file (read a sample at a time): `u16`
    /// (nanoGPT `.bin`; `tokens_u16` is an alias) or `u32`.
    pub format: DataFormat,
    /// `jsonl`: how lines are read — `auto` (each line's schema from its
    /// keys), `text`, `messages`, `alpaca`, `sharegpt` or `prompt_completion`
    /// (every line that schema).
    pub schema: Schema,
    /// A separate validation file in `format`; unset: the last `val_fraction`
    /// of `path` (for `jsonl`, of its examples).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_path: Option<String>,
    /// `byte`, `gpt2`, `PATH.gguf` (the tokenizer in a GGUF model) or
    /// `PATH/tokenizer.json`; unset: the tokenizer of `--init-from` (a
    /// `.gguf` file or a folder with `tokenizer.json`), else `byte`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSpec>,
    /// `jsonl`: pack whole examples into rows of `seq_len` positions, each
    /// attending only to itself with positions from 0 (else one example a
    /// row, padded to the longest in its micro-batch).
    pub pack: bool,
    /// `jsonl`: drop the examples that cutting to `seq_len` leaves without a
    /// target (a reply beyond the limit), naming their lines; `false`: refuse them.
    pub drop_empty: bool,
    /// Share of the tokens (from the end) held out for validation when
    /// `val_path` is unset; `jsonl`: the last `round(n · val_fraction)` of
    /// the n examples, at least one.
    pub val_fraction: f64,
    /// Tokens per sequence; unset means the model's block_size.
    pub seq_len: Option<usize>,
    /// Shuffle the sample order each epoch (from train.seed).
    pub shuffle: bool,
    /// Drop the samples that cannot fill a whole global batch.
    pub drop_last: bool,
    /// Several files mixed by weight instead of `path`: `[{ path, weight,
    /// format, schema, val_fraction }, …]` (docs/data.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sources: Option<Vec<SourceConfig>>,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            path: None,
            format: DataFormat::Text,
            schema: Schema::Auto,
            val_path: None,
            tokenizer: None,
            pack: false,
            drop_empty: true,
            val_fraction: 0.1,
            seq_len: None,
            shuffle: true,
            drop_last: true,
            sources: None,
        }
    }
}

/// `[batch]`: give any two of the three (world size comes from the launcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct BatchConfig {
    /// Sequences per optimizer step over all ranks (G).
    pub global: Option<usize>,
    /// Sequences per micro-batch per rank, or `"auto"`: the largest that
    /// fits `train.memory_budget` at the same global batch (chosen by the
    /// memory planner before the first step, then written into the
    /// resolved config so a resume uses the same factorization).
    pub micro: Option<Micro>,
    /// Micro-steps per optimizer step (K).
    pub accumulation_steps: Option<usize>,
}

/// `batch.micro`: a number of sequences, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Micro {
    /// This many sequences.
    Sequences(usize),
    /// Chosen by the memory planner.
    Auto,
}

impl Serialize for Micro {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Micro::Sequences(n) => s.serialize_u64(*n as u64),
            Micro::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Micro {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Micro;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number of sequences (at least 1) or \"auto\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Micro, E> {
                usize::try_from(v).map(Micro::Sequences).map_err(|_| E::custom(format!("{v} is too large")))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Micro, E> {
                u64::try_from(v)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Micro, E> {
                match v {
                    "auto" => Ok(Micro::Auto),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// The resolved factorization `global = micro × accumulation_steps × world_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedBatch {
    /// G.
    pub global: usize,
    /// Per-rank micro-batch.
    pub micro: usize,
    /// K.
    pub accumulation_steps: usize,
    /// W.
    pub world_size: usize,
}

/// Defaults used when fewer than two of the triple are given.
pub const DEFAULT_GLOBAL_BATCH: usize = 16;
/// See [`DEFAULT_GLOBAL_BATCH`].
pub const DEFAULT_MICRO_BATCH: usize = 8;

impl BatchConfig {
    /// Derives the missing member of the triple. With fewer than two given,
    /// `global = 16` and then `micro = 8` fill in.
    pub fn resolve(&self, world_size: usize) -> Result<ResolvedBatch, ConfigError> {
        let rule = "global = micro × accumulation_steps × world_size";
        let m = match self.micro {
            Some(Micro::Auto) => {
                return Err(ConfigError::Batch(
                    "batch.micro = \"auto\" is chosen by the memory planner from train.memory_budget; resolve it before this point".into(),
                ))
            }
            Some(Micro::Sequences(n)) => Some(n),
            None => None,
        };
        let (mut g, mut m, k) = (self.global, m, self.accumulation_steps);
        for (name, v) in [("batch.global", g), ("batch.micro", m), ("batch.accumulation_steps", k)] {
            if v == Some(0) {
                return Err(ConfigError::Batch(format!("{name} must be at least 1, got 0")));
            }
        }
        if world_size == 0 {
            return Err(ConfigError::Batch("world_size must be at least 1".into()));
        }
        let given = |g: Option<usize>, m: Option<usize>| [g, m, k].iter().filter(|x| x.is_some()).count();
        // A default the user never wrote is named as one in every error.
        let (mut g_default, mut m_default) = (false, false);
        if given(g, m) < 2 && g.is_none() {
            (g, g_default) = (Some(DEFAULT_GLOBAL_BATCH), true);
        }
        if given(g, m) < 2 && m.is_none() {
            (m, m_default) = (Some(DEFAULT_MICRO_BATCH), true);
        }
        let show = |v: Option<usize>, default: bool, key: &str| match (v, default) {
            (None, _) => "?".to_string(),
            (Some(v), true) => format!("{v} (the default: {key} unset)"),
            (Some(v), false) => v.to_string(),
        };
        let numbers = format!(
            "global = {}, micro = {}, accumulation_steps = {}, world_size = {world_size}",
            show(g, g_default, "batch.global"),
            show(m, m_default, "batch.micro"),
            show(k, false, "batch.accumulation_steps")
        );
        // What to set when a default is what does not divide.
        let fix = match (g_default, m_default) {
            (_, true) => {
                " — set batch.micro (or batch.accumulation_steps) so that it divides batch.global / world_size"
            }
            (true, _) => " — set batch.global to a multiple of batch.micro × world_size",
            _ => "",
        };
        // Products of user-given numbers can overflow: checked, and an error that names them.
        let overflow = |what: &str| {
            ConfigError::Batch(format!(
                "{numbers}: {what} overflows ({} max); the rule is {rule} — use realistic batch sizes",
                usize::MAX
            ))
        };
        let product = |a: usize, b: usize, what: &str| a.checked_mul(b).ok_or_else(|| overflow(what));
        let (global, micro, accumulation_steps) = match (g, m, k) {
            (Some(g), Some(m), Some(k)) => {
                let mk = product(
                    product(m, k, "micro × accumulation_steps")?,
                    world_size,
                    "micro × accumulation_steps × world_size",
                )?;
                if g != mk {
                    return Err(ConfigError::Batch(format!(
                        "inconsistent: {numbers}, but {m} × {k} × {world_size} = {mk} ≠ {g}; the rule is {rule} — give only two of them and the third is derived",
                    )));
                }
                (g, m, k)
            }
            (Some(g), Some(m), None) => {
                let mw = product(m, world_size, "micro × world_size")?;
                if g % mw != 0 {
                    return Err(ConfigError::Batch(format!(
                        "{numbers}: global {g} is not divisible by micro × world_size = {mw}; the rule is {rule}{fix}",
                    )));
                }
                (g, m, g / mw)
            }
            (Some(g), None, Some(k)) => {
                let kw = product(k, world_size, "accumulation_steps × world_size")?;
                if g % kw != 0 {
                    return Err(ConfigError::Batch(format!(
                        "{numbers}: global {g} is not divisible by accumulation_steps × world_size = {kw}; the rule is {rule}",
                    )));
                }
                (g, g / kw, k)
            }
            (None, Some(m), Some(k)) => {
                let g = product(
                    product(m, k, "micro × accumulation_steps")?,
                    world_size,
                    "micro × accumulation_steps × world_size",
                )?;
                (g, m, k)
            }
            _ => unreachable!("at least two members are filled in above"),
        };
        Ok(ResolvedBatch { global, micro, accumulation_steps, world_size })
    }
}

/// `[train]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps to run.
    pub steps: u64,
    /// Seed of initialisation and sample order.
    pub seed: u64,
    /// Worker threads (0: all cores).
    pub threads: usize,
    /// Evaluate the validation loss every N optimizer steps (0: only at the end).
    pub eval_every: u64,
    /// Micro-batches of validation data per evaluation.
    pub eval_batches: usize,
    /// Print a plain progress line every N steps when not on a terminal.
    pub log_every: u64,
    /// Global-norm clipping threshold (0 disables).
    pub grad_clip: f32,
    /// `token` (mean over all targets of the global batch) or `micro_batch_mean`.
    pub loss_normalization: LossNormalization,
    /// `f32`, `bf16` or `f16`: storage of the model's parameter copy, its
    /// saved activations and (f16) its activation gradients; kernels compute
    /// in f32, master weights and optimizer state stay f32.
    pub precision: Precision,
    /// Activation checkpointing: `none`, `blocks` (recompute every block in
    /// backward, keeping only block outputs), `every_N` (every N-th block),
    /// `attention` (drop the attention core's output, recomputed from
    /// q|k|v) or `selective` (drop every tensor made without a matrix
    /// multiply: attention's output, the norms' and the activation's).
    pub activation_checkpointing: Checkpointing,
    /// f16: the loss scale to start from.
    pub initial_loss_scale: f32,
    /// f16: good steps in a row before the scale doubles.
    pub loss_scale_window: u64,
    /// f16: overflowing steps tolerated before the scale halves (1: at once).
    pub loss_scale_hysteresis: u32,
    /// f16: the scale never drops below this.
    pub min_loss_scale: f32,
    /// Write a checkpoint every N optimizer steps and at the end (0: only on Ctrl-C / SIGTERM).
    pub checkpoint_every: u64,
    /// Checkpoints to keep (0: all).
    pub keep_checkpoints: usize,
    /// Write each checkpoint of `checkpoint_every` in the background: rank 0
    /// hands the gathered state to a writer thread and every rank goes on
    /// stepping; at most one is in flight (the next one, and the end of the
    /// run, wait for it). The state it holds is what the plan counts on top
    /// of a step for every checkpoint (with `ema_decay`, plus a copy of the
    /// average). A checkpoint a signal or `--stop-after` asks for is
    /// written before the run exits.
    pub checkpoint_async: bool,
    /// Sharded checkpoints: every rank writes its own share of the
    /// parameters and optimizer state (nothing is gathered to rank 0), and
    /// a resume at any data, tensor, pipeline or ZeRO layout reads only
    /// the pieces it keeps. Every rank must see the run folder (a shared
    /// file system). Off: rank 0 writes the whole state in Hugging Face
    /// format. Either kind resumes.
    pub checkpoint_sharded: bool,
    /// A LoRA run `--init-from` a file: also write the frozen base (in
    /// f32, as the run holds it) into each checkpoint and the final folder,
    /// which then stand alone. Off: they hold the adapters and a reference
    /// to the file (its path and SHA-256), checked whenever they are read.
    pub save_base: bool,
    /// Tensors the optimizer updates, by name pattern (`*` matches any
    /// run of characters); the others are frozen: no gradient, no optimizer
    /// state, no gradient communication. Default: every tensor.
    pub trainable: Vec<String>,
    /// Memory per process that `batch.micro = "auto"` plans against: a size
    /// (`"12GiB"`, `"800MB"`, bytes) or a fraction of the memory available
    /// at start (`"0.8"`). Unset: all of what is available (the plan keeps
    /// its own margin); a size above what is available is cut to it.
    pub memory_budget: Option<Budget>,
    /// f16: stop with an error after this many consecutive skipped steps at
    /// `min_loss_scale` (the run cannot make progress); 0 never stops.
    pub max_skips_at_min_scale: u64,
    /// How the frozen base projections of a LoRA run (a Llama-block
    /// model's q, k, v, o, gate, up, down; GPT-2's `Conv1D` layers) are
    /// held: [`FrozenDtype`].
    pub frozen_dtype: FrozenDtype,
    /// With `frozen_dtype = "nf4"`: quantise each block's absmax too
    /// (QLoRA's double quantisation, 8-bit scales in blocks of 256).
    pub frozen_double_quant: bool,
    /// The GGUF file or Hugging Face folder a LoRA run's frozen base is
    /// read from: `--init-from` writes it, so a resumed run (whose
    /// checkpoint holds only the adapters and a reference to the base)
    /// reads — and, where `frozen_dtype` packs it, packs — the same base again.
    pub frozen_source: Option<std::path::PathBuf>,
    /// Also write every `metrics.jsonl` line's numbers as TensorBoard
    /// scalars, into the run folder's `tensorboard/` (rank 0; `train
    /// --tensorboard DIR` turns it on and names another folder).
    pub tensorboard: bool,
    /// Also write every `metrics.jsonl` line's numbers as MLflow metrics
    /// (and the resolved config as its params) into this MLflow tracking
    /// folder (MLflow's file store; a path or a `file://` URI), rank 0;
    /// unset: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlflow: Option<String>,
    /// The MLflow experiment of `mlflow` (created if absent).
    pub mlflow_experiment: String,
    /// `lm` (next-token cross-entropy) or `dpo` (preference pairs, with
    /// `[lora]`: [`Objective`]).
    pub objective: Objective,
    /// DPO's β: how far the policy may move from the reference (TRL's
    /// `beta`, default 0.1).
    pub dpo_beta: f32,
    /// Stop when the validation loss stops improving (unset: never).
    pub early_stopping: Option<EarlyStopping>,
    /// Keep the checkpoint of the best validation loss (written when it is
    /// reached, exempt from `keep_checkpoints`, named by `checkpoints/best`).
    pub keep_best: bool,
    /// Decay of an exponential moving average of the trainable weights,
    /// updated after every optimizer step (0: none).
    pub ema_decay: f32,
    /// Label smoothing ε of the training loss (PyTorch's
    /// `cross_entropy(label_smoothing=ε)`; 0: none).
    pub label_smoothing: f32,
    /// Coefficient c of PaLM's z-loss, c·log²Z per target token (0: none).
    pub z_loss: f32,
}

/// `train.frozen_dtype`: the storage of a frozen base projection weight.
/// Every format is read by the GEMMs a tile at a time (dequantised into
/// the packing buffer): the f32 values the products see are the stored
/// format's exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FrozenDtype {
    /// The source's own 16-bit format when the base was loaded from F16 or
    /// BF16 tensors (lossless), f32 otherwise.
    #[default]
    Auto,
    /// f32 inside the engine's parameter buffer (no packing).
    F32,
    /// bfloat16 (rounded to nearest even from the source's values).
    Bf16,
    /// The source file's own blocks (a GGUF tensor's Q8_0 / Q4_0 / Q4_1 /
    /// F16 / BF16 bytes, a safetensors file's dtype).
    Source,
    /// QLoRA's NormalFloat-4 in blocks of 64, quantised on load.
    Nf4,
}

impl FrozenDtype {
    /// The TOML spelling.
    pub fn name(self) -> &'static str {
        match self {
            FrozenDtype::Auto => "auto",
            FrozenDtype::F32 => "f32",
            FrozenDtype::Bf16 => "bf16",
            FrozenDtype::Source => "source",
            FrozenDtype::Nf4 => "nf4",
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 600,
            seed: 1337,
            threads: 0,
            eval_every: 100,
            eval_batches: 8,
            log_every: 10,
            grad_clip: 1.0,
            loss_normalization: LossNormalization::Token,
            precision: Precision::F32,
            activation_checkpointing: Checkpointing::None,
            initial_loss_scale: 65536.0,
            loss_scale_window: 1000,
            loss_scale_hysteresis: 1,
            min_loss_scale: 1.0,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            checkpoint_async: false,
            checkpoint_sharded: false,
            save_base: false,
            trainable: vec!["*".into()],
            max_skips_at_min_scale: 50,
            memory_budget: None,
            frozen_dtype: FrozenDtype::Auto,
            frozen_double_quant: true,
            frozen_source: None,
            tensorboard: false,
            mlflow: None,
            mlflow_experiment: "macrobatch".into(),
            objective: Objective::Lm,
            dpo_beta: 0.1,
            early_stopping: None,
            keep_best: false,
            ema_decay: 0.0,
            label_smoothing: 0.0,
            z_loss: 0.0,
        }
    }
}

/// Whether `name` matches `pattern`, where `*` matches any run of
/// characters (including none) and everything else matches itself.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else { return false };
            (0..=tail.len()).filter(|&i| tail.is_char_boundary(i)).any(|i| name_matches(rest, &tail[i..]))
        }
    }
}

/// `[optim]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// `adamw`, `sgd`, `lion`, `adamw8bit` or `adafactor`.
    pub name: OptimizerKind,
    /// Peak learning rate.
    pub lr: f32,
    /// AdamW β₁.
    pub beta1: f32,
    /// AdamW β₂.
    pub beta2: f32,
    /// AdamW ε.
    pub eps: f32,
    /// Weight decay (decoupled for AdamW, L2 for SGD), matrices and embeddings only.
    pub weight_decay: f32,
    /// SGD momentum.
    pub momentum: f32,
    /// SGD Nesterov momentum.
    pub nesterov: bool,
    /// Tensors without weight decay, by name pattern (`*` any run of
    /// characters); unset: the model family's grouping (matrices and
    /// embeddings decay, biases and norms do not).
    pub no_decay: Option<Vec<String>>,
    /// `[optim.lion]`.
    pub lion: LionConfig,
    /// `[optim.adafactor]`.
    pub adafactor: AdafactorConfig,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            name: OptimizerKind::AdamW,
            lr: 2e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            momentum: 0.9,
            nesterov: false,
            no_decay: None,
            lion: LionConfig::default(),
            adafactor: AdafactorConfig::default(),
        }
    }
}

/// `[schedule]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleConfig {
    /// `constant`, `linear`, `cosine`, or DeepSpeed's `WarmupLR`,
    /// `WarmupDecayLR`, `WarmupCosineLR`.
    pub kind: Decay,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// Floor of the decaying schedules.
    pub min_lr: f32,
    /// `wsd`: the share of `train.steps` spent decaying at the end.
    pub decay_fraction: f32,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            kind: Decay::Cosine,
            warmup_steps: 20,
            min_lr: 2e-4,
            decay_fraction: engine::schedule::WSD_DECAY_FRACTION,
        }
    }
}

impl Config {
    /// Parses TOML text, then applies `--set` overrides, then checks types and keys.
    pub fn from_toml(text: &str, origin: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        let mut table = parse_table(text, origin)?;
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let origin = if overrides.is_empty() { origin.to_string() } else { format!("{origin} with --set overrides") };
        Self::from_table(&table, &origin)
    }

    /// Checks types and keys of a merged table.
    fn from_table(table: &toml::Table, origin: &str) -> Result<Self, ConfigError> {
        // Round-trip through text so that type errors point at the key and line.
        let merged =
            toml::to_string(table).map_err(|e| ConfigError::Parse { origin: origin.into(), message: e.to_string() })?;
        toml::from_str(&merged).map_err(|e| ConfigError::Parse { origin: origin.into(), message: e.to_string() })
    }

    /// The configuration as TOML (for `config.resolved.toml`).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot serialise config: {e}\n"))
    }

    /// Settings that are legal but almost certainly not what was meant.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.schedule.warmup_steps > self.train.steps {
            w.push(format!(
                "schedule.warmup_steps = {} is more than train.steps = {}: the learning rate never reaches optim.lr ({}) and never decays",
                self.schedule.warmup_steps, self.train.steps, self.optim.lr
            ));
        }
        w
    }

    /// Checks every value that does not need the model or the data.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Each section's own rules, then the rules that join sections.
        self.train.validate()?;
        self.validate_frozen_storage()?;
        objective::validate(self)?;
        loop_controls::validate(self)?;
        self.optim.validate()?;
        optimizers::validate(self)?;
        self.schedule.validate(&self.optim)?;
        self.dist.validate()?;
        self.validate_context()?;
        self.data.validate()
    }

    /// `dist.context_parallel` against the rest: what splitting a sequence
    /// over ranks does not (yet) compose with, each refused with the reason.
    fn validate_context(&self) -> Result<(), ConfigError> {
        let c = self.dist.context_parallel;
        if c <= 1 {
            return Ok(());
        }
        let refuse = |what: String| Err(invalid("dist.context_parallel", c, &what));
        if self.dist.zero_stage > 1 {
            return refuse(format!("does not compose with ZeRO stage {} (its shards cut a whole model's gradient; the context ranks train through the staged path, as a pipeline or a tensor split does): set dist.zero_stage = 1 or dist.context_parallel = 1", self.dist.zero_stage));
        }
        if self.dist.overlap_comm {
            return refuse(
                "does not compose with dist.overlap_comm (data parallelism alone): set dist.overlap_comm = false"
                    .into(),
            );
        }
        if self.train.loss_normalization == LossNormalization::MicroBatchMean {
            return refuse("splits each micro-batch's targets over the context ranks, so a micro-batch's mean is not a rank's: use train.loss_normalization = \"token\"".into());
        }
        if matches!(self.train.activation_checkpointing, Checkpointing::Attention | Checkpointing::Selective) {
            return refuse("recomputes attention only inside a block's backward with the context group's keys and values; train.activation_checkpointing = \"attention\" or \"selective\" would recompute it alone: use \"blocks\", \"every_N\" or \"none\"".into());
        }
        Ok(())
    }

    /// `train.frozen_dtype` against the rest: a packed base needs `[lora]`
    /// (something frozen) and one process (no tensor or pipeline split).
    fn validate_frozen_storage(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        let packs = !matches!(t.frozen_dtype, FrozenDtype::Auto | FrozenDtype::F32);
        if packs && self.lora.is_none() {
            return Err(invalid(
                "train.frozen_dtype",
                t.frozen_dtype.name(),
                "packs the frozen base projections of a LoRA run (GPT-2 and the Llama block's families), and there is no [lora] section: nothing is frozen; add [lora] or set train.frozen_dtype = \"auto\"",
            ));
        }
        for (key, n) in [
            ("dist.tensor_parallel", self.dist.tensor_parallel),
            ("dist.pipeline_parallel", self.dist.pipeline_parallel),
            ("dist.context_parallel", self.dist.context_parallel),
        ] {
            if packs && n > 1 {
                return Err(invalid(
                    "train.frozen_dtype",
                    t.frozen_dtype.name(),
                    &format!("keeps the frozen base whole in one process and does not split it ({key} = {n}); set {key} = 1 or train.frozen_dtype = \"f32\""),
                ));
            }
        }
        Ok(())
    }
}

/// A memory size or share: `Bytes` from `"80GiB"`, `"512MiB"`, `"1.5GB"`,
/// `"4096"`; `Fraction` from a number in (0, 1], e.g. `"0.8"`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// Bytes.
    Bytes(u64),
    /// A share of what is available.
    Fraction(f64),
}

impl Serialize for Budget {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Budget::Bytes(b) => s.serialize_u64(*b),
            Budget::Fraction(f) => s.serialize_f64(*f),
        }
    }
}

impl<'de> Deserialize<'de> for Budget {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Budget;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a size (\"80GiB\", \"512MiB\", bytes) or a fraction of the available memory (0.8)")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Budget, E> {
                if v == 0 {
                    return Err(E::custom("a memory budget of 0 bytes fits nothing"));
                }
                Ok(Budget::Bytes(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Budget, E> {
                u64::try_from(v).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))?;
                self.visit_u64(v as u64)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Budget, E> {
                if v > 0.0 && v <= 1.0 {
                    Ok(Budget::Fraction(v))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Float(v), &self))
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Budget, E> {
                parse_budget(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// Parses a [`Budget`]; the error says what is accepted.
pub fn parse_budget(s: &str) -> Result<Budget, String> {
    let t = s.trim();
    let rule =
        || format!("`{s}`: give a size (80GiB, 512MiB, 16GB, bytes) or a fraction of the available memory (0.8)");
    // A bare number with a point is a share; a bare integer is bytes.
    if let (Ok(f), true) = (t.parse::<f64>(), t.contains('.')) {
        return if f > 0.0 && f <= 1.0 { Ok(Budget::Fraction(f)) } else { Err(rule()) };
    }
    parse_bytes(t).map(Budget::Bytes).map_err(|e| format!("{e}; or give a fraction of the available memory (0.8)"))
}

/// Parses `80GiB`, `512MiB`, `1.5GB`, `1000000` (bytes).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.trim().parse().map_err(|_| format!("`{s}`: not a size (e.g. 80GiB, 512MiB, 16GB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => (1u64 << 20) as f64,
        "gib" => (1u64 << 30) as f64,
        "tib" => (1u64 << 40) as f64,
        other => return Err(format!("`{s}`: unknown unit `{other}` (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")),
    };
    if !(n.is_finite() && n > 0.0) {
        return Err(format!("`{s}`: a size must be positive"));
    }
    // A whole number of bytes is read exactly (f64 rounds above 2^53).
    if unit.trim().is_empty() || unit.trim().eq_ignore_ascii_case("b") {
        if let Ok(b) = num.trim().parse::<u64>() {
            return Ok(b);
        }
    }
    let bytes = n * mult;
    // `as u64` would saturate at 16 EiB (and round 0.5 bytes down to 0) without a word.
    if bytes >= u64::MAX as f64 {
        return Err(format!("`{s}`: more than 16 EiB (2^64 bytes), the largest size there is; give a smaller size"));
    }
    if bytes < 1.0 {
        return Err(format!(
            "`{s}`: less than one byte; give a size with a unit (512MiB, 16GB), or a fraction such as 0.5 where a share of the available memory is meant"
        ));
    }
    Ok(bytes as u64)
}

/// TOML text as a table (syntax only; keys are checked by [`Config::from_toml`]).
fn parse_table(text: &str, origin: &str) -> Result<toml::Table, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse { origin: origin.into(), message: e.to_string() })
}

fn invalid(field: &'static str, value: impl std::fmt::Display, rule: &str) -> ConfigError {
    ConfigError::Invalid { field, value: value.to_string(), rule: rule.to_string() }
}

/// Applies `a.b.c=value`; the value is read as TOML (number, bool, string,
/// array) and falls back to a plain string.
fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(), ConfigError> {
    let (key, raw) = arg.split_once('=').ok_or_else(|| ConfigError::BadOverride(arg.into()))?;
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(ConfigError::BadOverride(arg.into()));
    }
    let raw = raw.trim();
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let mut cur = table;
    for part in &path[..path.len() - 1] {
        let entry = cur.entry(part.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => return Err(ConfigError::BadOverride(format!("{arg} (`{part}` is not a section)"))),
        };
    }
    cur.insert(path[path.len() - 1].to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::name_matches;

    #[test]
    fn patterns_match_tensor_names() {
        assert!(name_matches("*", "transformer.wte.weight"));
        assert!(name_matches("transformer.h.3.*", "transformer.h.3.mlp.c_fc.weight"));
        assert!(!name_matches("transformer.h.3.*", "transformer.h.13.mlp.c_fc.weight"));
        assert!(name_matches("*.bias", "transformer.h.0.ln_1.bias"));
        assert!(name_matches("transformer.h.*.attn.*", "transformer.h.10.attn.c_proj.weight"));
        assert!(!name_matches("transformer.ln_f.weight", "transformer.ln_f.bias"));
    }

    use super::*;

    fn parse(text: &str, sets: &[&str]) -> Result<Config, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::from_toml(text, "test.toml", &sets)
    }

    #[test]
    fn overlap_comm_is_refused_with_a_pipeline_or_a_tensor_split() {
        let on = |extra: &[&str]| {
            let sets: Vec<&str> =
                ["dist.overlap_comm=true", "dist.world_size=4"].iter().chain(extra).copied().collect();
            parse("", &sets).unwrap().validate()
        };
        for stage in ["0", "1", "2", "3"] {
            on(&[&format!("dist.zero_stage={stage}")]).unwrap();
        }
        on(&["dist.zero_stage=2", "dist.reduce_every_micro_step=true"]).unwrap();
        // DPO runs two backwards a micro-step: refused where a bucket leaves after its layers' first.
        let dpo = ["model.family=llama", "lora.r=4", "lora.target_modules=[\"q_proj\"]", "train.objective=dpo"];
        let dpo = [&dpo[..], &["data.format=jsonl", "data.path=pairs.jsonl", "data.drop_last=true"]].concat();
        let e = on(&[&dpo[..], &["dist.zero_stage=1"]].concat()).unwrap_err().to_string();
        assert!(e.contains("dist.overlap_comm") && e.contains("two backwards"), "{e}");
        on(&[&dpo[..], &["dist.zero_stage=3"]].concat()).unwrap();
        for sets in [&["dist.tensor_parallel=2"][..], &["dist.pipeline_parallel=2"]] {
            let e = on(sets).unwrap_err().to_string();
            assert!(
                e.contains("dist.overlap_comm") && e.contains("data parallelism alone") && e.contains("= false"),
                "{sets:?}: {e}"
            );
        }
    }

    #[test]
    fn frozen_dtype_parses_and_each_refusal_names_the_key_and_the_fix() {
        let lora = "[model]\nfamily = \"llama\"\n[lora]\nr = 4\ntarget_modules = [\"q_proj\"]\n";
        let c = parse(lora, &[]).unwrap();
        assert_eq!((c.train.frozen_dtype, c.train.frozen_double_quant), (FrozenDtype::Auto, true));
        for (v, want) in [("f32", FrozenDtype::F32), ("bf16", FrozenDtype::Bf16), ("source", FrozenDtype::Source)] {
            let c = parse(lora, &[&format!("train.frozen_dtype=\"{v}\"")]).unwrap();
            assert_eq!((c.train.frozen_dtype, c.train.frozen_dtype.name()), (want, v));
            c.validate().unwrap();
        }
        let nf4 = parse(lora, &["train.frozen_dtype=\"nf4\"", "train.frozen_double_quant=false"]).unwrap();
        assert!(nf4.validate().is_ok() && !nf4.train.frozen_double_quant);
        let e = parse(lora, &["train.frozen_dtype=\"int3\""]).unwrap_err().to_string();
        assert!(e.contains("int3") && e.contains("nf4"), "{e}");
        let refused = |text: &str, sets: &[&str]| parse(text, sets).unwrap().validate().unwrap_err().to_string();
        let e = refused(lora, &["train.frozen_double_quant=false"]);
        assert!(e.contains("train.frozen_double_quant") && e.contains("\"nf4\" only"), "{e}");
        let e = refused("", &["train.frozen_dtype=\"nf4\""]);
        assert!(e.contains("train.frozen_dtype") && e.contains("[lora]"), "{e}");
        for key in ["dist.tensor_parallel", "dist.pipeline_parallel"] {
            let e = refused(lora, &["train.frozen_dtype=\"bf16\"", &format!("{key}=2"), "dist.world_size=2"]);
            assert!(e.contains("train.frozen_dtype") && e.contains(&format!("set {key} = 1")), "{e}");
            // f32 and auto split as before.
            parse(lora, &[&format!("{key}=2"), "dist.world_size=2"]).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn lora_section_is_kept_for_the_family() {
        // The family parses [lora]; here it is kept as written.
        let c = parse("[model]\nfamily = \"llama\"\n[lora]\nr = 4\ntarget_modules = [\"q_proj\"]\n", &[]).unwrap();
        assert_eq!(c.lora.and_then(|l| l.get("r").cloned()), Some(toml::Value::Integer(4)));
    }

    #[test]
    fn overrides_and_defaults() {
        let c =
            parse("[train]\nsteps = 5\n", &["train.steps=30", "batch.micro=4", "data.path=foo.txt", "optim.lr=1e-3"])
                .unwrap();
        assert_eq!(c.train.steps, 30);
        assert_eq!(c.batch.micro, Some(Micro::Sequences(4)));
        assert_eq!(c.data.path.as_deref(), Some("foo.txt"));
        assert_eq!(c.optim.lr, 1e-3);
        assert_eq!(c.model.preset.as_deref(), Some("tiny"));
        c.validate().unwrap();
        // The resolved file parses back to the same config.
        assert_eq!(parse(&c.to_toml(), &[]).unwrap(), c);
    }

    #[test]
    fn unknown_keys_and_bad_types_name_the_key() {
        let e = parse("[train]\nstepz = 5\n", &[]).unwrap_err().to_string();
        assert!(e.contains("stepz"), "{e}");
        let e = parse("", &["batch.micro=-2"]).unwrap_err().to_string();
        assert!(e.contains("micro"), "{e}");
        let e = parse("", &["nonsense.key=1"]).unwrap_err().to_string();
        assert!(e.contains("nonsense"), "{e}");
        assert!(parse("", &["train.steps"]).is_err());
        assert!(parse("[train\n", &[]).is_err());
    }

    #[test]
    fn batch_triple_derivation_and_errors() {
        let b =
            |g, m: Option<usize>, k| BatchConfig { global: g, micro: m.map(Micro::Sequences), accumulation_steps: k };
        let r = b(Some(32), Some(4), None).resolve(2).unwrap();
        assert_eq!((r.global, r.micro, r.accumulation_steps), (32, 4, 4));
        assert_eq!(b(Some(32), None, Some(8)).resolve(1).unwrap().micro, 4);
        assert_eq!(b(None, Some(4), Some(3)).resolve(2).unwrap().global, 24);
        assert_eq!(b(None, Some(4), None).resolve(1).unwrap().accumulation_steps, 4, "global defaults to 16");
        assert_eq!(b(None, None, Some(4)).resolve(1).unwrap().micro, 4);
        assert_eq!(b(None, None, None).resolve(1).unwrap().accumulation_steps, 2);
        let e = b(Some(32), Some(4), Some(4)).resolve(1).unwrap_err().to_string();
        assert!(
            e.contains("global = 32, micro = 4, accumulation_steps = 4, world_size = 1") && e.contains("rule"),
            "{e}"
        );
        let e = b(Some(30), Some(4), None).resolve(1).unwrap_err().to_string();
        assert!(e.contains("not divisible") && !e.contains("default"), "{e}");
        assert!(b(Some(0), Some(4), None).resolve(1).unwrap_err().to_string().contains("at least 1"));
    }

    /// `batch.global = 4` alone: the micro-batch 8 that does not divide it
    /// is the default, not a number the user wrote; the error says so and
    /// names the key to set. Likewise the default global under a micro alone.
    #[test]
    fn a_defaulted_member_of_the_triple_is_named_as_the_default() {
        let b =
            |g, m: Option<usize>, k| BatchConfig { global: g, micro: m.map(Micro::Sequences), accumulation_steps: k };
        let e = b(Some(4), None, None).resolve(1).unwrap_err().to_string();
        assert!(e.contains("micro = 8 (the default: batch.micro unset)"), "{e}");
        assert!(e.contains("set batch.micro"), "{e}");
        let e = b(None, Some(3), None).resolve(1).unwrap_err().to_string();
        assert!(e.contains("global = 16 (the default: batch.global unset)") && e.contains("set batch.global"), "{e}");
    }

    #[test]
    fn huge_batch_numbers_are_errors_not_overflows() {
        // Hostile input: 2^62 × 4 wraps to 0 in release builds (then a divide by
        // zero in the sampler, or a remainder by zero here).
        let b =
            |g, m: Option<usize>, k| BatchConfig { global: g, micro: m.map(Micro::Sequences), accumulation_steps: k };
        let huge = Some(1usize << 62);
        for (cfg, world) in [(b(None, huge, Some(4)), 1), (b(Some(16), huge, None), 4), (b(Some(16), None, huge), 4)] {
            let e = cfg.resolve(world).unwrap_err().to_string();
            assert!(e.contains("overflows") && e.contains("4611686018427387904"), "{e}");
        }
        let e = b(Some(16), huge, Some(4)).resolve(1).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn optimizer_settings_are_checked_before_anything_runs() {
        for bad in [
            "optim.beta1=1.5",
            "optim.beta2=-0.1",
            "optim.eps=0",
            "optim.eps=-1e-8",
            "optim.weight_decay=-0.1",
            "optim.weight_decay=inf",
            "optim.momentum=1.0",
        ] {
            let e = parse("", &[bad]).unwrap().validate().unwrap_err().to_string();
            let field = bad.split('=').next().unwrap();
            assert!(e.contains(field), "{bad}: {e}");
        }
        let e = parse("", &["optim.name=sgd", "optim.nesterov=true", "optim.momentum=0"]).unwrap().validate();
        assert!(e.unwrap_err().to_string().contains("Nesterov"));
        parse("", &["optim.eps=1e-12"]).unwrap().validate().unwrap();
    }

    #[test]
    fn pipeline_keys_parse_validate_and_name_the_fix() {
        let c =
            parse("", &["dist.pipeline_parallel=2", "dist.pipeline_schedule=\"gpipe\"", "dist.pipeline_layers=[1, 3]"])
                .unwrap();
        c.validate().unwrap();
        assert_eq!((c.dist.pipeline_parallel, c.dist.pipeline_schedule), (2, ScheduleKind::GPipe));
        assert_eq!(c.dist.pipeline_layers, Some(vec![1, 3]));
        assert_eq!(parse(&c.to_toml(), &[]).unwrap(), c, "round-trips");
        assert_eq!(Config::default().dist.pipeline_schedule, ScheduleKind::OneFOneB);
        let e = parse("", &["dist.pipeline_schedule=\"zigzag\""]).unwrap_err().to_string();
        assert!(e.contains("pipeline_schedule") && e.contains("`1f1b`") && e.contains("`gpipe`"), "{e}");
        for (sets, field, fix) in [
            (&["dist.pipeline_parallel=0"][..], "dist.pipeline_parallel", "at least 1"),
            (&["dist.pipeline_parallel=2", "dist.zero_stage=3"][..], "dist.zero_stage", "dist.zero_stage = 1"),
            (&["dist.pipeline_parallel=2", "dist.zero_stage=2"][..], "dist.zero_stage", "dist.pipeline_parallel = 1"),
            (&["dist.pipeline_parallel=2", "dist.pipeline_layers=[4]"][..], "dist.pipeline_layers", "2 of them"),
            (&["dist.pipeline_parallel=2", "dist.pipeline_layers=[0, 4]"][..], "dist.pipeline_layers", "positive"),
        ] {
            let e = parse("", sets).unwrap().validate().unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(fix), "{sets:?}: {e}");
        }
        let d = parse("", &["dist.pipeline_parallel=2"]).unwrap().dist;
        assert_eq!(d.data_parallel(8, "dist.world_size").unwrap(), 4);
        let e = d.data_parallel(3, "dist.world_size").unwrap_err().to_string();
        assert!(e.contains("dist.pipeline_parallel = 2") && e.contains("world size 3 (dist.world_size)"), "{e}");
    }

    #[test]
    fn tensor_parallel_is_validated_and_divides_the_world_with_the_pipeline() {
        let c = parse("", &["dist.tensor_parallel=2", "dist.pipeline_parallel=2"]).unwrap();
        c.validate().unwrap();
        assert_eq!(Config::default().dist.tensor_parallel, 1);
        assert_eq!(c.dist.data_parallel(8, "dist.world_size").unwrap(), 2);
        assert_eq!(c.dist.data_parallel(4, "dist.world_size").unwrap(), 1);
        let e = c.dist.data_parallel(6, "dist.world_size").unwrap_err().to_string();
        for needle in
            ["dist.pipeline_parallel = 2", "dist.tensor_parallel = 2", "= 4 ranks", "world size 6 (dist.world_size)"]
        {
            assert!(e.contains(needle), "`{needle}` missing: {e}");
        }
        // A world P divides but P · T does not is T's fault.
        let e = c.dist.data_parallel(2, "dist.world_size").unwrap_err().to_string();
        assert!(e.starts_with("dist.tensor_parallel = 2"), "{e}");
        for (sets, field, fix) in [
            (&["dist.tensor_parallel=0"][..], "dist.tensor_parallel", "at least 1"),
            (&["dist.tensor_parallel=2", "dist.zero_stage=2"][..], "dist.zero_stage", "dist.tensor_parallel = 1"),
            (&["dist.tensor_parallel=2", "dist.zero_stage=3"][..], "dist.zero_stage", "set dist.zero_stage = 1"),
        ] {
            let e = parse("", sets).unwrap().validate().unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(fix), "{sets:?}: {e}");
        }
        parse("", &["dist.tensor_parallel=4", "dist.zero_stage=1"]).unwrap().validate().unwrap();
        // The vocabulary split is over the tensor ranks: with one, nothing to split (a
        // run saved at T = 2 resumes at T = 1 with its config's vocab_parallel).
        for t in [1, 2] {
            parse("", &[&format!("dist.tensor_parallel={t}"), "dist.vocab_parallel=true"]).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn warmup_longer_than_the_run_is_a_warning() {
        let c = parse("", &["train.steps=10", "schedule.warmup_steps=20"]).unwrap();
        c.validate().unwrap();
        let w = c.warnings();
        assert!(w.len() == 1 && w[0].contains("warmup_steps = 20") && w[0].contains("train.steps = 10"), "{w:?}");
        assert!(parse("", &["train.steps=20"]).unwrap().warnings().is_empty());
    }

    #[test]
    fn deepspeed_schedule_names_and_range_checks() {
        let c = parse("", &["schedule.kind=WarmupCosineLR"]).unwrap();
        assert_eq!(c.schedule.kind, Decay::Cosine);
        assert_eq!(parse("[schedule]\nkind = \"WarmupLR\"\n", &[]).unwrap().schedule.kind, Decay::Constant);
        // The resolved file writes our own spelling.
        assert!(c.to_toml().contains("kind = \"cosine\""), "{}", c.to_toml());
        for bad in ["train.steps=0", "optim.lr=-1", "data.val_fraction=1.5"] {
            let e = parse("", &[bad]).unwrap().validate().unwrap_err().to_string();
            let field = bad.split('=').next().unwrap();
            assert!(e.contains(field), "{bad}: {e}");
        }
    }

    #[test]
    fn unknown_names_are_parse_errors_that_list_the_choices() {
        // One typed enum per concept: a wrong name fails when the file is
        // read, naming the key, its line and every accepted spelling.
        for (bad, key, choices) in [
            ("train.precision=\"f8\"", "precision", "`f32`, `bf16`, `f16`"),
            ("optim.name=\"lamb\"", "name", "`adamw`, `sgd`, `lion`, `adamw8bit`, `adafactor`"),
            ("schedule.kind=\"step\"", "kind", "`constant`"),
            ("train.loss_normalization=\"mean\"", "loss_normalization", "`token` or `micro_batch_mean`"),
            ("data.format=\"csv\"", "format", "`u16`, `u32`"),
            ("data.schema=\"dolly\"", "schema", "`alpaca`, `sharegpt`, `prompt_completion`"),
        ] {
            let e = parse("", &[bad]).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(choices), "{bad}: {e}");
        }
    }

    /// `data.schema` names how JSON Lines are read (default `auto`), only
    /// for `jsonl`; JSON Lines hold out `data.val_fraction` without a
    /// `data.val_path`.
    #[test]
    fn data_schema_parses_defaults_to_auto_and_applies_to_jsonl_only() {
        let jsonl = ["data.format=\"jsonl\"", "data.path=\"t.jsonl\""];
        assert_eq!(parse("", &jsonl).unwrap().data.schema, Schema::Auto);
        for (name, schema) in [
            ("text", Schema::Text),
            ("messages", Schema::Messages),
            ("alpaca", Schema::Alpaca),
            ("sharegpt", Schema::ShareGpt),
            ("prompt_completion", Schema::PromptCompletion),
        ] {
            let set = format!("data.schema=\"{name}\"");
            let cfg = parse("", &[jsonl[0], jsonl[1], &set]).unwrap();
            assert_eq!(cfg.data.schema, schema);
            cfg.validate().unwrap();
            assert_eq!(Config::from_toml(&cfg.to_toml(), "resolved", &[]).unwrap(), cfg);
        }
        let e = parse("", &["data.schema=\"alpaca\""]).unwrap().validate().unwrap_err().to_string();
        assert_eq!(e, "data.schema = \"alpaca\": applies to data.format = \"jsonl\", \"parquet\" or \"arrow\" (how its records are read)");
        let e = parse("", &["data.format=\"jsonl\""]).unwrap().validate().unwrap_err().to_string();
        assert!(e.starts_with("data.format = \"jsonl\": needs data.path"), "{e}");
    }

    #[test]
    fn sizes_budgets_and_auto_micro_parse() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("1.5 GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        for bad in ["", "lots", "-1GB", "5 parsecs"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
        // Overflow and sub-byte sizes are refused, never saturated or rounded to 0.
        for huge in ["99999999999999999999999", "20000000TB", "18446744073709551616"] {
            let e = parse_bytes(huge).unwrap_err();
            assert!(e.contains("16 EiB"), "{huge}: {e}");
        }
        assert!(parse_bytes("0.5").unwrap_err().contains("less than one byte"));
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX), "exact, not rounded");
        assert_eq!(parse_bytes("9007199254740993"), Ok(9_007_199_254_740_993));
        assert!(parse_budget("99999999999999999999999").is_err());
        assert_eq!(parse_budget("0.8"), Ok(Budget::Fraction(0.8)));
        assert_eq!(parse_budget("2GiB"), Ok(Budget::Bytes(2 << 30)));
        let e = parse("", &["train.memory_budget=\"1.5\""]).unwrap_err().to_string();
        assert!(e.contains("memory_budget") && e.contains("a fraction of the available memory"), "{e}");
        for (set, want) in [
            ("train.memory_budget=0.5", Budget::Fraction(0.5)),
            ("train.memory_budget=4096", Budget::Bytes(4096)),
            ("train.memory_budget=\"2GiB\"", Budget::Bytes(2 << 30)),
        ] {
            let c = parse("", &[set]).unwrap();
            assert_eq!(c.train.memory_budget, Some(want), "{set}");
            assert_eq!(parse(&c.to_toml(), &[]).unwrap(), c, "{set} round-trips");
        }
        assert!(parse("", &["train.memory_budget=0"]).is_err());
        let c = parse("", &["batch.micro=\"auto\""]).unwrap();
        assert_eq!(c.batch.micro, Some(Micro::Auto));
        assert!(c.batch.resolve(1).unwrap_err().to_string().contains("memory planner"));
        assert_eq!(parse(&c.to_toml(), &[]).unwrap(), c, "auto round-trips");
        let e = parse("", &["batch.micro=\"many\""]).unwrap_err().to_string();
        assert!(e.contains("\"auto\""), "{e}");
    }

    #[test]
    fn tensorboard_is_off_by_default_a_bool_and_round_trips() {
        assert!(!parse("", &[]).unwrap().train.tensorboard);
        let c = parse("[train]\ntensorboard = true\n", &[]).unwrap();
        assert!(c.train.tensorboard && c.validate().is_ok());
        assert_eq!(parse(&c.to_toml(), &[]).unwrap(), c, "the resolved config keeps it");
        assert!(parse("", &["train.tensorboard=true"]).unwrap().train.tensorboard);
        let e = parse("", &["train.tensorboard=\"runs/tb\""]).unwrap_err().to_string();
        assert!(e.contains("tensorboard") && e.contains("bool"), "{e}");
    }
}
