//! DeepSpeed's JSON config (`ds_config.json`) read as a macrobatch [`Config`]: every key is mapped, accepted with a note, or reported as unsupported (see docs/deepspeed.md).

use crate::{apply_override, Config, ConfigError, Micro, OptimConfig};
use serde_json::{Map, Value};

/// How a DeepSpeed config is read.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeepSpeedOptions {
    /// The world size an MPI launcher set (`None`: `dist.world_size`).
    pub launcher_world: Option<usize>,
    /// Keys macrobatch cannot honour are errors instead of warnings.
    pub strict: bool,
}

/// A DeepSpeed config read as ours: the config and what the reader should know.
#[derive(Debug, Clone)]
pub struct DeepSpeedConfig {
    /// The translated configuration (companion TOML, then the JSON, then `--set`).
    pub config: Config,
    /// Unsupported keys (`unsupported: …`, errors under `strict`) first, then
    /// keys accepted without effect and mappings with a caveat (`note: …`).
    pub warnings: Vec<String>,
}

/// DeepSpeed's default `initial_scale_power` (initial loss scale 2^16).
const DS_INITIAL_SCALE_POWER: u64 = 16;
/// DeepSpeed's default `hysteresis`.
const DS_HYSTERESIS: u64 = 2;

impl Config {
    /// Translates DeepSpeed JSON `text` into a [`Config`]. `companion` is a
    /// TOML text and its origin for what DeepSpeed does not describe
    /// (`[model]`, `[data]`, `train.steps`, `dist.world_size`, …); the JSON
    /// replaces the companion's keys it maps, and `overrides` apply last.
    pub fn from_deepspeed_json(
        text: &str,
        origin: &str,
        companion: Option<(&str, &str)>,
        overrides: &[String],
        opts: DeepSpeedOptions,
    ) -> Result<DeepSpeedConfig, ConfigError> {
        let parse_err = |message: String| ConfigError::Parse { origin: origin.into(), message };
        let root: Value =
            serde_json::from_str(text).map_err(|e| parse_err(format!("not a valid DeepSpeed JSON config: {e}")))?;
        // serde_json keeps the last of two equal keys; DeepSpeed's loader
        // refuses them, and so do we (one of the two would be ignored).
        if let Err(e) = serde_json::from_str::<NoDuplicates>(text) {
            return Err(parse_err(format!("not a valid DeepSpeed JSON config: {e}")));
        }
        let Value::Object(mut root) = root else {
            return Err(parse_err("a DeepSpeed config is a JSON object ({ \"train_batch_size\": …, … })".into()));
        };
        let (table, mut label) = match companion {
            Some((text, c_origin)) => (crate::parse_table(text, c_origin)?, format!("{origin} + {c_origin}")),
            None => (toml::Table::new(), origin.to_string()),
        };
        // "auto" takes macrobatch's own value (the companion, --set, the
        // defaults), as Hugging Face's Trainer fills it from its arguments.
        let mut ours = table.clone();
        for o in overrides {
            apply_override(&mut ours, o)?;
        }
        let ours = Config::from_table(&ours, &label)?;
        let mut notes = Vec::new();
        let autos = resolve_autos(&mut root, &ours, &mut notes);
        if !autos.is_empty() {
            return Err(parse_err(format!(
                "\"auto\" is filled in by Hugging Face's Trainer from its own arguments; macrobatch fills the keys it has a value for, and these need numbers: {}",
                autos.join("; ")
            )));
        }
        let mut t = Translation { origin: origin.to_string(), table, notes, unsupported: Vec::new() };
        let batch = t.translate(root)?;
        for o in overrides {
            apply_override(&mut t.table, o)?;
        }
        if !overrides.is_empty() {
            label.push_str(" with --set overrides");
        }
        let config = Config::from_table(&t.table, &label)?;
        if let Some(b) = batch {
            b.check(&config, opts.launcher_world)?;
        }
        if config.train.loss_normalization == crate::LossNormalization::Token {
            t.notes.push(
                "DeepSpeed divides the loss by gradient_accumulation_steps (a mean of micro-batch means); macrobatch weighs every target token alike (train.loss_normalization = \"token\"); --set train.loss_normalization=micro_batch_mean reproduces DeepSpeed's curve".into(),
            );
        }
        if opts.strict && !t.unsupported.is_empty() {
            return Err(parse_err(format!(
                "--strict: {} DeepSpeed key(s) macrobatch cannot honour:\n  {}",
                t.unsupported.len(),
                t.unsupported.join("\n  ")
            )));
        }
        let warnings = t
            .unsupported
            .iter()
            .map(|u| format!("{origin}: unsupported, ignored: {u}"))
            .chain(t.notes.iter().map(|n| format!("{origin}: note: {n}")))
            .collect();
        Ok(DeepSpeedConfig { config, warnings })
    }
}

/// The batch keys as DeepSpeed gave them, checked against the world size
/// with DeepSpeed's names once the world is known.
#[derive(Debug, Clone, Copy)]
struct DsBatch {
    global: Option<usize>,
    micro: Option<usize>,
    gas: Option<usize>,
}

impl DsBatch {
    fn check(self, cfg: &Config, launcher_world: Option<usize>) -> Result<(), ConfigError> {
        // `--set batch.*` replaced them: the usual rule and its message apply.
        let written = (self.global, self.micro.map(Micro::Sequences), self.gas);
        if (cfg.batch.global, cfg.batch.micro, cfg.batch.accumulation_steps) != written {
            return Ok(());
        }
        let (world, from) = match launcher_world {
            Some(n) => (n, "from the MPI launcher"),
            None => (cfg.dist.world_size, "dist.world_size"),
        };
        // With a pipeline or a tensor split DeepSpeed counts the
        // data-parallel ranks only: world / (dist.pipeline_parallel ·
        // dist.tensor_parallel).
        let (p, t) = (cfg.dist.pipeline_parallel, cfg.dist.tensor_parallel);
        let w = cfg.dist.data_parallel(world, from)?;
        let source = match (p, t) {
            (1, 1) => from.to_string(),
            (_, 1) => format!("world {world} {from} / dist.pipeline_parallel {p} stages: the data-parallel ranks"),
            (1, _) => format!("world {world} {from} / dist.tensor_parallel {t} tensor ranks: the data-parallel ranks"),
            _ => format!(
                "world {world} {from} / (dist.pipeline_parallel {p} stages × dist.tensor_parallel {t} tensor ranks): the data-parallel ranks"
            ),
        };
        let rule = "the rule is train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world; give two of them and the third is derived";
        let err = |m: String| Err(ConfigError::Batch(format!("{m} ({source}); {rule}")));
        match (self.global, self.micro, self.gas) {
            (Some(g), Some(m), Some(k)) => {
                let Some(mk) = m.checked_mul(k) else { return Ok(()) };
                if mk.checked_mul(w) != Some(g) {
                    return if g % mk == 0 {
                        err(format!(
                            "train_batch_size {g} = {m} × {k} × world needs world {}, but world is {w}",
                            g / mk
                        ))
                    } else {
                        err(format!(
                            "train_batch_size {g} is not a multiple of train_micro_batch_size_per_gpu {m} × gradient_accumulation_steps {k} = {mk} for any world; world is {w}"
                        ))
                    };
                }
            }
            (Some(g), Some(m), None) | (Some(g), None, Some(m)) => {
                let name =
                    if self.micro.is_some() { "train_micro_batch_size_per_gpu" } else { "gradient_accumulation_steps" };
                let Some(mw) = m.checked_mul(w) else { return Ok(()) };
                if g % mw != 0 {
                    return err(format!(
                        "train_batch_size {g} is not divisible by {name} {m} × world {w} = {mw}, so the third member is not whole"
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// The translation under way: our keys as TOML, and what was said about the rest.
struct Translation {
    origin: String,
    table: toml::Table,
    notes: Vec<String>,
    unsupported: Vec<String>,
}

type Obj = Map<String, Value>;

impl Translation {
    fn err(&self, key: &str, msg: impl std::fmt::Display) -> ConfigError {
        ConfigError::Parse { origin: self.origin.clone(), message: format!("{key}: {msg}") }
    }

    /// Sets `section.key` of our config.
    fn set(&mut self, path: &str, v: impl Into<toml::Value>) {
        // Every dot opens a table: `optim.lion.beta1` is [optim.lion] beta1.
        let mut parts: Vec<&str> = path.split('.').collect();
        let key = parts.pop().unwrap_or(path);
        let mut table = &mut self.table;
        for section in parts {
            let entry = table.entry(section.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !entry.is_table() {
                *entry = toml::Value::Table(toml::Table::new());
            }
            let toml::Value::Table(t) = entry else { unreachable!("made a table just above") };
            table = t;
        }
        table.insert(key.to_string(), v.into());
    }

    /// The value of our `section.key` so far, as a number.
    fn get_f64(&self, path: &str) -> Option<f64> {
        let (section, key) = path.split_once('.')?;
        let v = self.table.get(section)?.get(key)?;
        v.as_float().or_else(|| v.as_integer().map(|i| i as f64))
    }

    fn object(&self, v: Value, key: &str) -> Result<Obj, ConfigError> {
        match v {
            Value::Object(m) => Ok(m),
            other => Err(self.err(key, format!("expected an object {{ … }}, got {other}"))),
        }
    }

    fn number(&self, v: &Value, key: &str) -> Result<f64, ConfigError> {
        v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| self.err(key, format!("expected a number, got {v}")))
    }

    /// A whole number ≥ 0 (DeepSpeed files write sizes as `5e8` too).
    /// A bucket size in elements: positive, named by its JSON key (not the
    /// `dist.bucket_mb` it becomes).
    fn bucket_size(&self, v: &Value, key: &str) -> Result<f64, ConfigError> {
        let n = self.number(v, key)?;
        if !(n >= 1.0 && n.is_finite()) {
            return Err(self.err(key, format!("{v}: a bucket holds at least one element; give e.g. 5e8")));
        }
        Ok(n)
    }

    fn whole(&self, v: &Value, key: &str) -> Result<u64, ConfigError> {
        let x = self.number(v, key)?;
        if x < 0.0 || x.fract() != 0.0 || x > i64::MAX as f64 {
            return Err(self.err(key, format!("expected a whole number >= 0, got {v}")));
        }
        Ok(x as u64)
    }

    fn flag(&self, v: &Value, key: &str) -> Result<bool, ConfigError> {
        v.as_bool().ok_or_else(|| self.err(key, format!("expected true or false, got {v}")))
    }

    fn string(&self, v: &Value, key: &str) -> Result<String, ConfigError> {
        v.as_str().map(str::to_string).ok_or_else(|| self.err(key, format!("expected a string, got {v}")))
    }

    /// Keys left over in `m` (under `prefix`) are unsupported.
    fn rest(&mut self, m: Obj, prefix: &str) {
        for (k, v) in m {
            self.unsupported.push(format!("{prefix}{k} = {v}: not a key macrobatch reads"));
        }
    }

    /// Keys accepted without effect on the result, with the reason.
    fn accept(&mut self, m: &mut Obj, prefix: &str, keys: &[&str], reason: &str) {
        let found: Vec<String> =
            keys.iter().filter_map(|k| m.remove(*k).map(|v| format!("{prefix}{k} = {v}"))).collect();
        if !found.is_empty() {
            self.notes.push(format!("{}: {reason}; ignored", found.join(", ")));
        }
    }

    fn translate(&mut self, mut root: Obj) -> Result<Option<DsBatch>, ConfigError> {
        let batch = self.batch(&mut root)?;
        if let Some(v) = root.remove("gradient_clipping") {
            let c = self.number(&v, "gradient_clipping")?;
            self.set("train.grad_clip", c);
        }
        if let Some(v) = root.remove("steps_per_print") {
            let n = self.whole(&v, "steps_per_print")?;
            self.set("train.log_every", n as i64);
        }
        let fp16 = match root.remove("fp16") {
            Some(v) => self.fp16(v)?,
            None => false,
        };
        let bf16_key = if root.contains_key("bf16") { "bf16" } else { "bfloat16" };
        let bf16 = match root.remove(bf16_key) {
            Some(v) => {
                let mut m = self.object(v, bf16_key)?;
                let on = match m.remove("enabled") {
                    Some(e) => self.flag(&e, &format!("{bf16_key}.enabled"))?,
                    None => false,
                };
                self.rest(m, &format!("{bf16_key}."));
                on
            }
            None => false,
        };
        match (fp16, bf16) {
            (true, true) => {
                return Err(self.err(
                    "fp16.enabled, bf16.enabled",
                    "both are true; enable one (train.precision is either f16 or bf16)",
                ))
            }
            (false, true) => self.set("train.precision", "bf16"),
            _ => {}
        }
        if let Some(v) = root.remove("zero_optimization") {
            self.zero(v)?;
        }
        match root.remove("optimizer") {
            Some(v) => self.optimizer(v)?,
            None => self.notes.push(
                "no \"optimizer\": [optim] comes from the companion TOML, --set or the defaults (adamw, lr 2e-3)"
                    .into(),
            ),
        }
        match root.remove("scheduler") {
            Some(v) => self.scheduler(v)?,
            None => {
                self.set("schedule.kind", "constant");
                self.set("schedule.warmup_steps", 0i64);
                self.set("schedule.min_lr", 0.0);
                self.notes.push(
                    "no \"scheduler\": DeepSpeed keeps the optimizer's lr constant, so schedule.kind = \"constant\" with no warmup"
                        .into(),
                );
            }
        }
        if let Some(v) = root.remove("pipeline") {
            self.pipeline(v)?;
        }
        if let Some(v) = root.remove("tensor_parallel") {
            self.tensor_parallel(v)?;
        }
        if let Some(v) = root.remove("activation_checkpointing") {
            let m = self.object(v, "activation_checkpointing")?;
            self.set("train.activation_checkpointing", "blocks");
            let subs: Vec<String> = m.iter().map(|(k, v)| format!("activation_checkpointing.{k} = {v}")).collect();
            let mut note = "\"activation_checkpointing\" → train.activation_checkpointing = \"blocks\" (every block recomputed in backward)".to_string();
            if !subs.is_empty() {
                note.push_str(&format!(
                    "; {} ignored: macrobatch neither partitions nor offloads the kept activations",
                    subs.join(", ")
                ));
            }
            self.notes.push(note);
        }
        if let Some(v) = root.remove("tensorboard") {
            let mut m = self.object(v, "tensorboard")?;
            let enabled = match m.remove("enabled") {
                Some(e) => self.flag(&e, "tensorboard.enabled")?,
                None => false,
            };
            self.set("train.tensorboard", enabled);
            let mut note = format!(
                "\"tensorboard\": {{\"enabled\": {enabled}}} → train.tensorboard = {enabled} (event files in RUN/tensorboard/)"
            );
            let rest: Vec<String> = m.iter().map(|(k, v)| format!("tensorboard.{k} = {v}")).collect();
            if !rest.is_empty() {
                note.push_str(&format!(
                    "; {} ignored: `train --tensorboard DIR` names another folder",
                    rest.join(", ")
                ));
            }
            self.notes.push(note);
        }
        self.accept(
            &mut root,
            "",
            &[
                "wall_clock_breakdown",
                "memory_breakdown",
                "wandb",
                "csv_monitor",
                "comet",
                "flops_profiler",
                "comms_logger",
                "dump_state",
                "zero_allow_untested_optimizer",
                "zero_force_ds_cpu_optimizer",
            ],
            "DeepSpeed's logging and profiling switches (macrobatch writes metrics.jsonl; see `macrobatch bench`)",
        );
        if let Some(v) = root.remove("prescale_gradients") {
            if self.flag(&v, "prescale_gradients")? {
                self.unsupported.push("prescale_gradients = true: gradients are summed, then divided once".into());
            }
        }
        if let Some(v) = root.remove("gradient_predivide_factor") {
            if self.number(&v, "gradient_predivide_factor")? != 1.0 {
                self.unsupported
                    .push(format!("gradient_predivide_factor = {v}: gradients are summed, then divided once"));
            }
        }
        if self.get_f64("train.steps").is_none() {
            self.notes.push(
                "no scheduler.params.total_num_steps: train.steps comes from the companion TOML, --set or the default (600)".into(),
            );
        }
        self.rest(root, "");
        Ok(batch)
    }

    fn batch(&mut self, root: &mut Obj) -> Result<Option<DsBatch>, ConfigError> {
        let mut read = |key: &str| -> Result<Option<usize>, ConfigError> {
            let Some(v) = root.remove(key) else { return Ok(None) };
            let n = self.whole(&v, key)?;
            if n == 0 {
                return Err(self.err(key, "must be at least 1"));
            }
            usize::try_from(n).map(Some).map_err(|_| self.err(key, "too large"))
        };
        let (global, micro, gas) =
            (read("train_batch_size")?, read("train_micro_batch_size_per_gpu")?, read("gradient_accumulation_steps")?);
        let b = match (global, micro, gas) {
            (None, None, None) => {
                self.notes.push(
                    "no train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps: [batch] comes from the companion TOML, --set or the defaults".into(),
                );
                return Ok(None);
            }
            (None, None, Some(_)) => return Err(self.err(
                "gradient_accumulation_steps",
                "alone does not fix the batch; DeepSpeed also needs train_batch_size or train_micro_batch_size_per_gpu",
            )),
            // DeepSpeed's rule with one of the pair: no accumulation.
            (Some(_), None, None) | (None, Some(_), None) => DsBatch { global, micro, gas: Some(1) },
            _ => DsBatch { global, micro, gas },
        };
        let mut t = toml::Table::new();
        for (k, v) in [("global", b.global), ("micro", b.micro), ("accumulation_steps", b.gas)] {
            if let Some(v) = v {
                t.insert(k.into(), toml::Value::Integer(v as i64));
            }
        }
        // The JSON's batch replaces the companion's whole [batch]: a mix of the two would over-determine it.
        self.table.insert("batch".into(), toml::Value::Table(t));
        Ok(Some(b))
    }

    /// `pipeline`: `stages` → `dist.pipeline_parallel` (DeepSpeed usually
    /// takes it from the `PipelineModule`), `partition` `"uniform"` is our
    /// even split; the partitioning switches have no counterpart.
    fn pipeline(&mut self, v: Value) -> Result<(), ConfigError> {
        let mut m = self.object(v, "pipeline")?;
        if let Some(v) = m.remove("stages") {
            let n = self.whole(&v, "pipeline.stages")?;
            if n == 0 {
                return Err(self.err("pipeline.stages", "must be at least 1"));
            }
            self.set("dist.pipeline_parallel", n as i64);
        }
        if let Some(v) = m.remove("partition") {
            let how = self.string(&v, "pipeline.partition")?;
            if how != "uniform" {
                self.unsupported.push(format!(
                    "pipeline.partition = \"{how}\": macrobatch cuts the layers evenly (\"uniform\"), or as dist.pipeline_layers lists them"
                ));
            }
        }
        self.accept(
            &mut m,
            "pipeline.",
            &["seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant"],
            "macrobatch sends whole activations between stages and seeds every layer from train.seed",
        );
        if let Some(v) = m.remove("activation_checkpoint_interval") {
            if self.whole(&v, "pipeline.activation_checkpoint_interval")? > 0 {
                self.unsupported.push(format!(
                    "pipeline.activation_checkpoint_interval = {v}: use train.activation_checkpointing (\"blocks\" or \"every_N\")"
                ));
            }
        }
        self.rest(m, "pipeline.");
        Ok(())
    }

    /// `tensor_parallel` (AutoTP training): `autotp_size` →
    /// `dist.tensor_parallel`; the rest has no counterpart (macrobatch's
    /// families split their own blocks, Megatron-style).
    fn tensor_parallel(&mut self, v: Value) -> Result<(), ConfigError> {
        let mut m = self.object(v, "tensor_parallel")?;
        if let Some(v) = m.remove("autotp_size") {
            let n = self.whole(&v, "tensor_parallel.autotp_size")?;
            if n == 0 {
                return Err(self.err("tensor_parallel.autotp_size", "must be at least 1"));
            }
            self.set("dist.tensor_parallel", n as i64);
        }
        self.rest(m, "tensor_parallel.");
        Ok(())
    }

    /// `fp16`: whether it is enabled.
    fn fp16(&mut self, v: Value) -> Result<bool, ConfigError> {
        let mut m = self.object(v, "fp16")?;
        let enabled = match m.remove("enabled") {
            Some(e) => self.flag(&e, "fp16.enabled")?,
            None => false,
        };
        if !enabled {
            let keys: Vec<String> = m.keys().map(|k| format!("fp16.{k}")).collect();
            if !keys.is_empty() {
                self.notes.push(format!("{}: fp16 is not enabled; ignored", keys.join(", ")));
            }
            return Ok(false);
        }
        self.set("train.precision", "f16");
        let power = match m.remove("initial_scale_power") {
            Some(v) => self.whole(&v, "fp16.initial_scale_power")?,
            None => DS_INITIAL_SCALE_POWER,
        };
        if power > 127 {
            return Err(self.err("fp16.initial_scale_power", format!("{power}: 2^{power} is not a finite f32")));
        }
        let fixed = match m.remove("loss_scale") {
            Some(v) => self.number(&v, "fp16.loss_scale")?,
            None => 0.0,
        };
        let window = match m.remove("loss_scale_window") {
            Some(v) => self.whole(&v, "fp16.loss_scale_window")?,
            None => 1000,
        };
        let hysteresis = match m.remove("hysteresis") {
            Some(v) => self.whole(&v, "fp16.hysteresis")?,
            None => DS_HYSTERESIS,
        };
        let min_scale = match m.remove("min_loss_scale") {
            Some(v) => self.number(&v, "fp16.min_loss_scale")?,
            None => 1.0,
        };
        if fixed < 0.0 {
            return Err(self.err("fp16.loss_scale", format!("{fixed}: use 0 (dynamic) or a positive fixed scale")));
        }
        if fixed > 0.0 {
            // A fixed scale: start there, never grow, never drop below it.
            self.set("train.initial_loss_scale", fixed);
            self.set("train.min_loss_scale", fixed);
            self.set("train.loss_scale_window", i64::MAX);
            self.notes.push(format!(
                "fp16.loss_scale = {fixed} (fixed): train.initial_loss_scale = train.min_loss_scale = {fixed} and a window that never ends, so the scale stays put; an overflowing step is still skipped"
            ));
        } else {
            self.set("train.initial_loss_scale", 2f64.powi(power as i32));
            self.set("train.min_loss_scale", min_scale);
            self.set("train.loss_scale_window", window as i64);
        }
        self.set("train.loss_scale_hysteresis", hysteresis.min(u32::MAX as u64) as i64);
        for key in ["consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"] {
            if let Some(v) = m.remove(key) {
                if self.flag(&v, &format!("fp16.{key}"))? {
                    self.unsupported.push(format!("fp16.{key} = true: no counterpart in macrobatch's loss scaler"));
                }
            }
        }
        self.rest(m, "fp16.");
        Ok(true)
    }

    fn zero(&mut self, v: Value) -> Result<(), ConfigError> {
        let mut m = self.object(v, "zero_optimization")?;
        if let Some(v) = m.remove("stage") {
            let s = self.whole(&v, "zero_optimization.stage")?;
            if s > 3 {
                return Err(self.err("zero_optimization.stage", format!("{s}: use 0, 1, 2 or 3")));
            }
            self.set("dist.zero_stage", s as i64);
        }
        let mib = |elements: f64| elements * 4.0 / f64::from(1u32 << 20);
        let reduce = m.remove("reduce_bucket_size");
        if let Some(v) = &reduce {
            let n = self.bucket_size(v, "zero_optimization.reduce_bucket_size")?;
            self.set("dist.bucket_mb", mib(n));
        }
        if let Some(v) = m.remove("allgather_bucket_size") {
            let n = self.bucket_size(&v, "zero_optimization.allgather_bucket_size")?;
            if reduce.is_some() {
                self.notes.push(format!(
                    "zero_optimization.allgather_bucket_size = {v}: macrobatch has one bucket size (dist.bucket_mb), taken from reduce_bucket_size; ignored"
                ));
            } else {
                self.set("dist.bucket_mb", mib(n));
            }
        }
        self.accept(
            &mut m,
            "zero_optimization.",
            &["overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients"],
            "macrobatch schedules its own buckets and collectives (ZeRO ≥ 2 always reduce-scatters); no effect on the result",
        );
        self.accept(
            &mut m,
            "zero_optimization.",
            &[
                "sub_group_size",
                "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold",
                "stage3_max_live_parameters",
                "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save",
                "load_from_fp32_weights",
                "elastic_checkpoint",
                "ignore_unused_parameters",
            ],
            "DeepSpeed tuning knobs with no counterpart here; no effect on the result",
        );
        for key in ["offload_optimizer", "offload_param"] {
            let Some(v) = m.remove(key) else { continue };
            let full = format!("zero_optimization.{key}");
            let o = self.object(v.clone(), &full)?;
            let device = match o.get("device") {
                Some(d) => self.string(d, &format!("{full}.device"))?,
                None => "none".into(),
            };
            if device == "none" {
                self.notes.push(format!("{full} = {v}: device \"none\" offloads nothing"));
            } else if key == "offload_optimizer" && device == "nvme" {
                // DeepSpeed's NVMe offload streams the optimizer state through
                // files, as dist.offload_optimizer = "disk" does (in the run folder).
                self.set("dist.offload_optimizer", "disk");
                if o.contains_key("nvme_path") {
                    self.notes.push(format!(
                        "{full}.nvme_path: the state files live in the run folder's offload/ (dist.offload_optimizer = \"disk\"); the path is not used"
                    ));
                }
            } else if key == "offload_optimizer" && device == "cpu" {
                self.notes.push(format!(
                    "{full} = {v}: macrobatch runs on the CPU, where the optimizer state already lives in host memory; nothing to move"
                ));
            } else {
                self.unsupported.push(format!(
                    "{full} = {v}: macrobatch keeps parameters and optimizer state in memory (no offload to {device}); `macrobatch plan` shows what fits"
                ));
            }
        }
        if let Some(v) = m.remove("cpu_offload") {
            if self.flag(&v, "zero_optimization.cpu_offload")? {
                self.unsupported.push("zero_optimization.cpu_offload = true: no offload in macrobatch".into());
            }
        }
        self.rest(m, "zero_optimization.");
        Ok(())
    }

    /// `{"type": …, "params": {…}}` (`optimizer`, `scheduler`); other keys are unsupported.
    fn typed(&mut self, v: Value, section: &str, choices: &str) -> Result<(String, Obj), ConfigError> {
        let mut m = self.object(v, section)?;
        let key = format!("{section}.type");
        let kind = match m.remove("type") {
            Some(t) => self.string(&t, &key)?,
            None => return Err(self.err(&key, format!("missing; give {choices}"))),
        };
        let params = match m.remove("params") {
            Some(p) => self.object(p, &format!("{section}.params"))?,
            None => Obj::new(),
        };
        self.rest(m, &format!("{section}."));
        Ok((kind, params))
    }

    fn optimizer(&mut self, v: Value) -> Result<(), ConfigError> {
        let (kind, mut p) = self.typed(v, "optimizer", "\"Adam\", \"AdamW\", \"Lion\" or \"SGD\"")?;
        let num = |t: &Self, p: &mut Obj, key: &str, default: f64| -> Result<f64, ConfigError> {
            p.remove(key).map_or(Ok(default), |v| t.number(&v, &format!("optimizer.params.{key}")))
        };
        // DeepSpeed's (and torch's) defaults where a key is absent.
        let lr = num(self, &mut p, "lr", 1e-3)?;
        let wd = num(self, &mut p, "weight_decay", 0.0)?;
        self.set("optim.lr", lr);
        self.set("optim.weight_decay", wd);
        let betas = |t: &Self, p: &mut Obj, default: (f64, f64)| -> Result<(f64, f64), ConfigError> {
            match p.remove("betas") {
                Some(Value::Array(b)) if b.len() == 2 => {
                    Ok((t.number(&b[0], "optimizer.params.betas")?, t.number(&b[1], "optimizer.params.betas")?))
                }
                Some(other) => Err(t.err("optimizer.params.betas", format!("expected [beta1, beta2], got {other}"))),
                None => Ok(default),
            }
        };
        match kind.to_ascii_lowercase().as_str() {
            k @ ("adam" | "adamw") => {
                let (b1, b2) = betas(self, &mut p, (0.9, 0.999))?;
                let eps = num(self, &mut p, "eps", 1e-8)?;
                let w_mode = match p.remove("adam_w_mode") {
                    Some(v) => self.flag(&v, "optimizer.params.adam_w_mode")?,
                    None => true,
                };
                if !w_mode && wd != 0.0 {
                    return Err(self.err(
                        "optimizer.params.adam_w_mode",
                        "false with weight_decay > 0 is Adam with L2 regularisation, which macrobatch does not have; use adam_w_mode = true (decoupled, AdamW) or weight_decay = 0",
                    ));
                }
                if k == "adam" {
                    self.notes.push(format!(
                        "optimizer.type = \"{kind}\": DeepSpeed's Adam with adam_w_mode = {w_mode} is decoupled weight decay (AdamW); mapped to optim.name = \"adamw\""
                    ));
                }
                self.set("optim.name", "adamw");
                self.set("optim.beta1", b1);
                self.set("optim.beta2", b2);
                self.set("optim.eps", eps);
                self.accept(&mut p, "optimizer.params.", &["torch_adam"], "an implementation choice");
                for (key, ok) in [("bias_correction", true), ("amsgrad", false)] {
                    if let Some(v) = p.remove(key) {
                        if self.flag(&v, &format!("optimizer.params.{key}"))? != ok {
                            self.unsupported.push(format!(
                                "optimizer.params.{key} = {v}: macrobatch's AdamW has bias correction and no AMSGrad"
                            ));
                        }
                    }
                }
            }
            "lion" => {
                // DeepSpeed's (Fused)Lion: the paper's update, betas (0.9, 0.99) by default.
                let (b1, b2) = betas(self, &mut p, (0.9, 0.99))?;
                self.set("optim.name", "lion");
                self.set("optim.lion.beta1", b1);
                self.set("optim.lion.beta2", b2);
            }
            "sgd" => {
                let momentum = num(self, &mut p, "momentum", 0.0)?;
                let nesterov = match p.remove("nesterov") {
                    Some(v) => self.flag(&v, "optimizer.params.nesterov")?,
                    None => false,
                };
                if let Some(v) = p.remove("dampening") {
                    if self.number(&v, "optimizer.params.dampening")? != 0.0 {
                        self.unsupported.push(format!("optimizer.params.dampening = {v}: macrobatch's SGD has none"));
                    }
                }
                self.set("optim.name", "sgd");
                self.set("optim.momentum", momentum);
                self.set("optim.nesterov", nesterov);
            }
            _ => {
                return Err(self.err(
                    "optimizer.type",
                    format!(
                        "\"{kind}\" is not supported; macrobatch has \"Adam\"/\"AdamW\" (adamw), \"Lion\" (lion) and \"SGD\" (sgd) (8-bit AdamW and Adafactor, which DeepSpeed has no type for: optim.name in the companion TOML)"
                    ),
                ))
            }
        }
        if wd > 0.0 {
            self.notes.push(format!(
                "optimizer.params.weight_decay = {wd} decays matrices and embeddings only (not biases and norms), like the usual DeepSpeed training scripts' parameter groups"
            ));
        }
        self.rest(p, "optimizer.params.");
        Ok(())
    }

    fn scheduler(&mut self, v: Value) -> Result<(), ConfigError> {
        let (kind, mut p) = self.typed(v, "scheduler", "\"WarmupLR\", \"WarmupDecayLR\" or \"WarmupCosineLR\"")?;
        let ours = match kind.as_str() {
            "WarmupLR" => "constant",
            "WarmupDecayLR" => "linear",
            "WarmupCosineLR" => "cosine",
            _ => {
                return Err(self.err(
                    "scheduler.type",
                    format!("\"{kind}\" is not supported; macrobatch has WarmupLR, WarmupDecayLR and WarmupCosineLR"),
                ))
            }
        };
        self.set("schedule.kind", ours);
        let num = |t: &Self, p: &mut Obj, key: &str| -> Result<Option<f64>, ConfigError> {
            p.remove(key).map(|v| t.number(&v, &format!("scheduler.params.{key}"))).transpose()
        };
        let warmup = match p.remove("warmup_num_steps") {
            Some(v) => self.whole(&v, "scheduler.params.warmup_num_steps")?,
            None => 1000,
        };
        self.set("schedule.warmup_steps", warmup as i64);
        if let Some(v) = p.remove("total_num_steps") {
            if kind == "WarmupLR" {
                self.unsupported.push(format!("scheduler.params.total_num_steps = {v}: WarmupLR does not take it"));
            } else {
                let n = self.whole(&v, "scheduler.params.total_num_steps")?;
                self.set("train.steps", n as i64);
            }
        } else if kind != "WarmupLR" {
            return Err(
                self.err("scheduler.params.total_num_steps", format!("{kind} needs it (optimizer steps of the run)"))
            );
        }
        match p.remove("warmup_type") {
            Some(Value::String(s)) if s == "linear" => {}
            Some(v) => self.unsupported.push(format!(
                "scheduler.params.warmup_type = {v}: macrobatch warms up linearly (from lr / warmup_steps to lr)"
            )),
            None => self.unsupported.push(
                "scheduler.params.warmup_type (absent): DeepSpeed's default is \"log\", macrobatch warms up linearly (from lr / warmup_steps to lr); write \"warmup_type\": \"linear\"".into(),
            ),
        }
        let optimizer_lr = self.get_f64("optim.lr");
        if kind == "WarmupCosineLR" {
            let lr = optimizer_lr.unwrap_or(f64::from(OptimConfig::default().lr));
            let ratio = num(self, &mut p, "cos_min_ratio")?.unwrap_or(1e-4);
            self.set("schedule.min_lr", lr * ratio);
            if let Some(r) = num(self, &mut p, "warmup_min_ratio")?.filter(|r| *r != 0.0) {
                self.unsupported.push(format!(
                    "scheduler.params.warmup_min_ratio = {r}: warmup starts at lr / warmup_steps here, not at lr × warmup_min_ratio"
                ));
            }
        } else {
            let max_lr = num(self, &mut p, "warmup_max_lr")?.unwrap_or(1e-3);
            if let Some(lr) = optimizer_lr.filter(|lr| *lr != max_lr) {
                self.notes.push(format!(
                    "scheduler.params.warmup_max_lr = {max_lr} sets the peak lr; optimizer.params.lr = {lr} is not used (as in DeepSpeed)"
                ));
            }
            self.set("optim.lr", max_lr);
            let min_lr = num(self, &mut p, "warmup_min_lr")?.unwrap_or(0.0);
            // The floor of the linear decay; WarmupLR never decays.
            self.set("schedule.min_lr", if kind == "WarmupLR" { 0.0 } else { min_lr });
            if min_lr != 0.0 {
                self.unsupported.push(format!(
                    "scheduler.params.warmup_min_lr = {min_lr}: warmup starts at lr / warmup_steps here, not at warmup_min_lr{}",
                    if kind == "WarmupDecayLR" { " (the decay still ends there: schedule.min_lr)" } else { "" }
                ));
            }
        }
        self.accept(
            &mut p,
            "scheduler.params.",
            &["last_batch_iteration"],
            "a fresh run starts at step 0 (resume with --resume)",
        );
        self.rest(p, "scheduler.params.");
        Ok(())
    }
}

/// Every `"auto"` value, with the key's dotted path and what it needs.
/// Deserialises any JSON and fails on an object with a key given twice.
struct NoDuplicates;

impl<'de> serde::Deserialize<'de> for NoDuplicates {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NoDuplicatesVisitor)
    }
}

struct NoDuplicatesVisitor;

impl<'de> serde::de::Visitor<'de> for NoDuplicatesVisitor {
    type Value = NoDuplicates;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_i64<E>(self, _: i64) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_u64<E>(self, _: u64) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_f64<E>(self, _: f64) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_str<E>(self, _: &str) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_unit<E>(self) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<NoDuplicates, A::Error> {
        while seq.next_element::<NoDuplicates>()?.is_some() {}
        Ok(NoDuplicates)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<NoDuplicates, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!(
                    "the key \"{key}\" appears twice in one object; keep one of them"
                )));
            }
            map.next_value::<NoDuplicates>()?;
        }
        Ok(NoDuplicates)
    }
}

/// Replaces every `"auto"` of `root` that Hugging Face's Trainer fills
/// from its arguments with macrobatch's value of the same setting in
/// `ours` (a note names each), or removes it where the value is derived
/// (a batch key whose two partners are numbers); returns the `"auto"`s
/// left, each with what it needs.
fn resolve_autos(root: &mut Obj, ours: &Config, notes: &mut Vec<String>) -> Vec<String> {
    let is_num = |root: &Obj, k: &str| root.get(k).is_some_and(Value::is_number);
    let batch = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"];
    for (i, key) in batch.iter().enumerate() {
        if root.get(*key).and_then(Value::as_str) != Some("auto") {
            continue;
        }
        let b = &ours.batch;
        let mine = match i {
            0 => b.global,
            1 => match b.micro {
                Some(Micro::Sequences(n)) => Some(n),
                _ => None,
            },
            _ => b.accumulation_steps,
        };
        let our_key = ["batch.global", "batch.micro", "batch.accumulation_steps"][i];
        // macrobatch's own value first: a triple that then disagrees with
        // the world is refused with DeepSpeed's numbers, as a written one.
        match mine {
            Some(n) => {
                root.insert(key.to_string(), Value::from(n));
                notes.push(format!("{key} = \"auto\": {n}, macrobatch's {our_key}"));
            }
            None => {
                root.remove(*key);
                let partners = batch.iter().enumerate().filter(|(j, _)| *j != i).all(|(_, k)| is_num(root, k));
                notes.push(match partners {
                    true => format!("{key} = \"auto\": derived from the other two batch keys and the world size"),
                    false => format!(
                        "{key} = \"auto\": {our_key} is not set (a number) here, so DeepSpeed's rule for the batch keys given decides it"
                    ),
                });
            }
        }
    }
    let (o, prec) = (&ours.optim, ours.train.precision);
    // An f32 setting as the decimal it was written as (3e-4, not 0.000300000014…).
    let f = |x: f32| Value::from(x.to_string().parse::<f64>().unwrap_or(f64::from(x)));
    let bucket = ours.dist.bucket_mb * f64::from(1u32 << 20) / 4.0;
    // The file's own optimizer lr, where it gives one, is the peak the
    // scheduler's "auto" means (HF fills both from one learning rate).
    let json_lr = root
        .get("optimizer")
        .and_then(|o| o.get("params"))
        .and_then(|p| p.get("lr"))
        .filter(|v| v.is_number())
        .cloned();
    let filled: [(&str, &str, Option<Value>); 15] = [
        ("gradient_clipping", "train.grad_clip", Some(f(ours.train.grad_clip))),
        ("fp16.enabled", "train.precision", Some(Value::from(prec == crate::Precision::F16))),
        ("bf16.enabled", "train.precision", Some(Value::from(prec == crate::Precision::Bf16))),
        ("bfloat16.enabled", "train.precision", Some(Value::from(prec == crate::Precision::Bf16))),
        ("optimizer.params.lr", "optim.lr", Some(f(o.lr))),
        ("optimizer.params.betas", "optim.beta1, optim.beta2", Some(Value::from(vec![f(o.beta1), f(o.beta2)]))),
        ("optimizer.params.eps", "optim.eps", Some(f(o.eps))),
        ("optimizer.params.weight_decay", "optim.weight_decay", Some(f(o.weight_decay))),
        ("scheduler.params.warmup_min_lr", "warmup from lr / warmup_steps", Some(Value::from(0))),
        ("scheduler.params.warmup_max_lr", "optim.lr", Some(json_lr.unwrap_or_else(|| f(o.lr)))),
        ("scheduler.params.warmup_num_steps", "schedule.warmup_steps", Some(Value::from(ours.schedule.warmup_steps))),
        ("scheduler.params.total_num_steps", "train.steps", Some(Value::from(ours.train.steps))),
        ("zero_optimization.reduce_bucket_size", "dist.bucket_mb", Some(Value::from(bucket.round()))),
        ("zero_optimization.stage3_prefetch_bucket_size", "", None),
        ("zero_optimization.stage3_param_persistence_threshold", "", None),
    ];
    for (path, our_key, value) in filled {
        let (parent, leaf) = path.rsplit_once('.').unwrap_or(("", path));
        let obj =
            parent.split('.').filter(|p| !p.is_empty()).try_fold(&mut *root, |m, k| m.get_mut(k)?.as_object_mut());
        let Some(obj) = obj.filter(|m| m.get(leaf).and_then(Value::as_str) == Some("auto")) else { continue };
        match value {
            Some(v) => {
                notes.push(format!("{path} = \"auto\": {v}, macrobatch's {our_key}"));
                obj.insert(leaf.to_string(), v);
            }
            None => {
                obj.remove(leaf);
                notes.push(format!("{path} = \"auto\": a DeepSpeed tuning knob with no counterpart here; ignored"));
            }
        }
    }
    let mut left = Vec::new();
    find_auto(&Value::Object(root.clone()), "", &mut left);
    left
}

fn find_auto(v: &Value, path: &str, out: &mut Vec<String>) {
    match v {
        Value::String(s) if s == "auto" => out.push(format!("{path} needs {}", needs(path))),
        Value::Object(m) => {
            for (k, v) in m {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                find_auto(v, &p, out);
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                find_auto(v, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// What the key at `path` holds, for the `"auto"` error.
fn needs(path: &str) -> &'static str {
    let leaf = path.rsplit('.').next().unwrap_or(path);
    let leaf = leaf.split('[').next().unwrap_or(leaf);
    match leaf {
        "train_batch_size" => "a number: sequences per optimizer step over all ranks",
        "train_micro_batch_size_per_gpu" => "a number: sequences per micro-batch per rank",
        "gradient_accumulation_steps" => "a number: micro-steps per optimizer step",
        "gradient_clipping" => "a number: the global-norm threshold (1.0 is DeepSpeed's default, 0 disables)",
        "enabled" => "true or false",
        "lr" | "warmup_max_lr" => "a number: the peak learning rate, e.g. 3e-4",
        "warmup_min_lr" => "a number: 0 (macrobatch warms up from lr / warmup_num_steps)",
        "warmup_num_steps" => "a number: warmup optimizer steps",
        "total_num_steps" => "a number: optimizer steps of the run",
        "betas" => "two numbers: [beta1, beta2], e.g. [0.9, 0.999]",
        "eps" => "a number, e.g. 1e-8",
        "weight_decay" => "a number, e.g. 0.01",
        "reduce_bucket_size" | "allgather_bucket_size" => "a number of elements per bucket, e.g. 5e8",
        "autotp_size" => "a number: tensor-parallel ranks (dist.tensor_parallel)",
        "stages" => "a number: pipeline stages (dist.pipeline_parallel; DeepSpeed's \"auto\" takes them from the PipelineModule, which macrobatch does not have)",
        _ => "a concrete value",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Decay, OptimizerKind, Precision};

    fn ds(json: &str, sets: &[&str], strict: bool) -> Result<DeepSpeedConfig, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::from_deepspeed_json(json, "ds.json", None, &sets, DeepSpeedOptions { launcher_world: None, strict })
    }

    const GPT2_FP16_ZERO1: &str = r#"{
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 5,
        "gradient_clipping": 0.5,
        "fp16": { "enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 200, "hysteresis": 2, "min_loss_scale": 1 },
        "zero_optimization": { "stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "overlap_comm": true, "contiguous_gradients": true },
        "optimizer": { "type": "Adam", "params": { "lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 } },
        "scheduler": { "type": "WarmupDecayLR", "params": { "warmup_min_lr": 0, "warmup_max_lr": 6e-4, "warmup_num_steps": 10, "total_num_steps": 100, "warmup_type": "linear" } }
    }"#;

    #[test]
    fn a_gpt2_fp16_zero1_config_maps_key_by_key() {
        let r = ds(GPT2_FP16_ZERO1, &[], true).unwrap();
        let c = &r.config;
        assert_eq!(
            (c.batch.global, c.batch.micro, c.batch.accumulation_steps),
            (Some(32), Some(Micro::Sequences(8)), None)
        );
        assert_eq!(c.batch.resolve(1).unwrap().accumulation_steps, 4);
        assert_eq!(c.train.log_every, 5);
        assert_eq!(c.train.grad_clip, 0.5);
        assert_eq!(c.train.precision, Precision::F16);
        assert_eq!(c.train.initial_loss_scale, 4096.0);
        assert_eq!((c.train.loss_scale_window, c.train.loss_scale_hysteresis, c.train.min_loss_scale), (200, 2, 1.0));
        assert_eq!(c.dist.zero_stage, 1);
        assert!((c.dist.bucket_mb - 5e8 * 4.0 / 1048576.0).abs() < 1e-9);
        assert_eq!(c.optim.name, OptimizerKind::AdamW);
        assert_eq!((c.optim.lr, c.optim.beta2, c.optim.weight_decay), (6e-4, 0.95, 0.1));
        assert_eq!((c.schedule.kind, c.schedule.warmup_steps, c.schedule.min_lr), (Decay::Linear, 10, 0.0));
        assert_eq!(c.train.steps, 100);
        c.validate().unwrap();
        let all = r.warnings.join("\n");
        assert!(
            all.contains("overlap_comm") && all.contains("adamw") && all.contains("allgather_bucket_size"),
            "{all}"
        );
        assert!(!all.contains("unsupported"), "{all}");
    }

    #[test]
    fn bf16_zero2_sgd_cosine_and_defaults() {
        let r = ds(
            r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "bf16": {"enabled": true},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
                "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": true}},
                "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5, "cos_min_ratio": 0.1, "warmup_type": "linear"}},
                "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": false}}"#,
            &["dist.world_size=2"],
            false,
        )
        .unwrap();
        let c = &r.config;
        assert_eq!(c.batch.resolve(2).unwrap().global, 12);
        assert_eq!((c.train.precision, c.dist.zero_stage, c.dist.world_size), (Precision::Bf16, 2, 2));
        assert_eq!(
            (c.optim.name, c.optim.lr, c.optim.momentum, c.optim.nesterov),
            (OptimizerKind::Sgd, 0.1, 0.9, true)
        );
        assert_eq!((c.optim.weight_decay, c.schedule.kind, c.train.steps), (0.0, Decay::Cosine, 50));
        assert!((c.schedule.min_lr - 0.01).abs() < 1e-7);
        assert_eq!(c.train.activation_checkpointing, crate::Checkpointing::Blocks);
        assert_eq!(c.train.grad_clip, 1.0, "absent gradient_clipping follows DeepSpeed's 1.0");
        c.validate().unwrap();
        let all = r.warnings.join("\n");
        assert!(all.contains("partition_activations") && all.contains("offload_optimizer"), "{all}");
    }

    #[test]
    fn tensorboard_enabled_maps_to_the_event_files() {
        let on = ds(r#"{"train_batch_size": 8, "tensorboard": {"enabled": true, "output_path": "logs/"}}"#, &[], false)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(on.config.train.tensorboard);
        assert!(
            on.warnings.iter().any(|n| n.contains("train.tensorboard = true") && n.contains("output_path")),
            "{:?}",
            on.warnings
        );
        let off = ds(r#"{"train_batch_size": 8, "tensorboard": {"enabled": false}}"#, &[], false)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!off.config.train.tensorboard);
        assert!(ds(r#"{"train_batch_size": 8, "tensorboard": {"enabled": "yes"}}"#, &[], false).is_err());
    }

    /// Hugging Face's `ds_config_zero2.json` (every value its Trainer
    /// fills is "auto") takes macrobatch's own settings, each named in a
    /// note; a batch key whose partners are numbers is derived; an "auto"
    /// with no counterpart is still an error naming what it needs.
    #[test]
    fn auto_values_take_macrobatch_settings_or_name_what_they_need() {
        let hf = r#"{
            "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                "warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_type": "linear"}},
            "zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}"#;
        let sets = [
            "optim.lr=3e-4",
            "optim.beta2=0.95",
            "optim.weight_decay=0.1",
            "train.precision=bf16",
            "train.grad_clip=0.5",
            "train.steps=500",
            "schedule.warmup_steps=25",
            "batch.global=32",
            "batch.micro=4",
            "dist.world_size=2",
        ];
        let c = ds(hf, &sets, false).unwrap_or_else(|e| panic!("{e}"));
        let (cfg, w) = (&c.config, c.warnings.join("\n"));
        assert_eq!((cfg.optim.lr, cfg.optim.beta2, cfg.optim.weight_decay), (3e-4, 0.95, 0.1));
        assert_eq!((cfg.train.precision, cfg.train.grad_clip, cfg.train.steps), (Precision::Bf16, 0.5, 500));
        assert_eq!((cfg.schedule.warmup_steps, cfg.dist.zero_stage, cfg.dist.bucket_mb), (25, 2, 25.0));
        assert_eq!((cfg.batch.global, cfg.batch.micro), (Some(32), Some(Micro::Sequences(4))));
        for needle in [
            "optimizer.params.lr = \"auto\": 0.0003",
            "bf16.enabled = \"auto\": true, macrobatch's train.precision",
            "scheduler.params.total_num_steps = \"auto\": 500, macrobatch's train.steps",
            "train_batch_size = \"auto\": 32, macrobatch's batch.global",
            "gradient_accumulation_steps = \"auto\": derived",
        ] {
            assert!(w.contains(needle), "{needle}: {w}");
        }
        // micro and K given: the global batch is theirs × the world.
        let j =
            r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}"#;
        let c = ds(j, &["dist.world_size=2"], false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((c.config.batch.micro, c.config.batch.accumulation_steps), (Some(Micro::Sequences(2)), Some(4)));
        assert!(c.warnings.iter().any(|w| w.contains("train_batch_size = \"auto\": derived")), "{:?}", c.warnings);
        // The scheduler's peak is the file's own optimizer lr where it gives one.
        let j = r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-5}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 10, "warmup_type": "linear"}}}"#;
        assert_eq!(ds(j, &[], false).unwrap_or_else(|e| panic!("{e}")).config.optim.lr, 3e-5);
        // macrobatch's own batch keys first: the companion's micro stands
        // where the file says "auto" (not one derived from the file's K);
        // one macrobatch does not set, without two numbers beside it, is
        // left to DeepSpeed's rule, and a note says so.
        let j =
            r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}"#;
        let c = ds(j, &["batch.micro=4", "dist.world_size=2"], false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.config.batch.micro, Some(Micro::Sequences(4)));
        let e = ds(j, &["batch.micro=8", "dist.world_size=2"], false).unwrap_err().to_string();
        assert!(e.contains("train_batch_size"), "32 ≠ 8 × 4 × 2 is refused: {e}");
        let j = r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}"#;
        let c = ds(j, &[], false).unwrap_or_else(|e| panic!("{e}"));
        assert!(c.warnings.iter().any(|w| w.contains("batch.global is not set")), "{:?}", c.warnings);
        let e = ds(r#"{"train_batch_size": 8, "comms_logger": {"verbose": "auto"}}"#, &[], false).unwrap_err();
        assert!(e.to_string().contains("comms_logger.verbose needs a concrete value"), "{e}");
    }

    #[test]
    fn a_pipeline_counts_the_data_parallel_ranks_in_the_batch_triple() {
        let j = r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
            "pipeline": {"stages": 2, "partition": "uniform", "pipe_partitioned": true}}"#;
        // 16 = 2 × 4 × D with D = 4 / 2 data-parallel ranks.
        let c = ds(j, &["dist.world_size=4"], false).unwrap();
        assert_eq!(c.config.dist.pipeline_parallel, 2);
        assert!(c.warnings.iter().any(|w| w.contains("pipeline.pipe_partitioned")), "{:?}", c.warnings);
        // The world alone would agree (16 = 2 × 4 × 2 with world 2), but 2 stages leave 1 data rank.
        let e = ds(j, &["dist.world_size=2"], false).unwrap_err().to_string();
        assert!(
            e.contains("needs world 2, but world is 1")
                && e.contains("dist.pipeline_parallel 2 stages: the data-parallel ranks"),
            "{e}"
        );
        let e = ds(j, &["dist.world_size=3"], false).unwrap_err().to_string();
        assert!(e.contains("dist.pipeline_parallel") && e.contains("world size 3"), "{e}");
        let e = ds(r#"{"train_batch_size": 8, "pipeline": {"stages": "auto"}}"#, &[], false).unwrap_err().to_string();
        assert!(e.contains("pipeline.stages needs") && e.contains("dist.pipeline_parallel"), "{e}");
        let w = ds(r#"{"train_batch_size": 8, "pipeline": {"partition": "parameters"}}"#, &[], false).unwrap().warnings;
        assert!(w.iter().any(|w| w.contains("pipeline.partition = \"parameters\"")), "{w:?}");
    }

    #[test]
    fn autotp_size_is_the_tensor_split_and_the_batch_counts_data_ranks() {
        let j = r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": true}}"#;
        // 8 = 2 × 2 × D with D = 4 / 2 data-parallel ranks.
        let c = ds(j, &["dist.world_size=4"], false).unwrap();
        assert_eq!(c.config.dist.tensor_parallel, 2);
        assert!(c.warnings.iter().any(|w| w.contains("tensor_parallel.tp_overlap_comm")), "{:?}", c.warnings);
        let e = ds(j, &["dist.world_size=2"], false).unwrap_err().to_string();
        assert!(
            e.contains("needs world 2, but world is 1")
                && e.contains("dist.tensor_parallel 2 tensor ranks: the data-parallel ranks"),
            "{e}"
        );
        let e = ds(r#"{"train_batch_size": 8, "tensor_parallel": {"autotp_size": 0}}"#, &[], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tensor_parallel.autotp_size") && e.contains("at least 1"), "{e}");
    }

    #[test]
    fn batch_triple_errors_use_deepspeed_numbers() {
        let j = r#"{"train_batch_size": 512, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 4}"#;
        let e = ds(j, &["dist.world_size=2"], false).unwrap_err().to_string();
        assert!(e.contains("train_batch_size 512 = 16 × 4 × world needs world 8, but world is 2"), "{e}");
        assert!(ds(j, &["dist.world_size=8"], false).is_ok());
        let launched = Config::from_deepspeed_json(
            j,
            "ds.json",
            None,
            &[],
            DeepSpeedOptions { launcher_world: Some(8), strict: false },
        );
        assert!(launched.is_ok(), "the launcher's world counts");
        let e = ds(r#"{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}"#, &[], false).unwrap_err();
        assert!(e.to_string().contains("not divisible by train_micro_batch_size_per_gpu 4 × world 1"), "{e}");
        let e = ds(r#"{"gradient_accumulation_steps": 4}"#, &[], false).unwrap_err().to_string();
        assert!(e.contains("alone"), "{e}");
        // One of the pair: DeepSpeed's gradient_accumulation_steps = 1.
        let c = ds(r#"{"train_batch_size": 8}"#, &["dist.world_size=2"], false).unwrap().config;
        assert_eq!(c.batch.resolve(2).unwrap().micro, 4);
    }

    #[test]
    fn unknown_and_unsupported_keys_warn_or_fail_under_strict() {
        let j = r#"{"train_batch_size": 8, "fancy_new_thing": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "mystery": true},
                    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}"#;
        let r = ds(j, &[], false).unwrap();
        let all = r.warnings.join("\n");
        for key in ["fancy_new_thing", "zero_optimization.mystery", "zero_optimization.offload_param", "warmup_type"] {
            assert!(all.contains(key), "{key}: {all}");
        }
        let e = ds(j, &[], true).unwrap_err().to_string();
        assert!(
            e.contains("--strict") && e.contains("fancy_new_thing") && e.contains("zero_optimization.mystery"),
            "{e}"
        );
    }

    #[test]
    fn lion_maps_with_its_betas_and_defaults() {
        let j =
            r#"{"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}}}"#;
        let c = ds(j, &[], true).unwrap().config;
        assert_eq!((c.optim.name, c.optim.lr, c.optim.weight_decay), (OptimizerKind::Lion, 1e-4, 0.1));
        assert_eq!((c.optim.lion.beta1, c.optim.lion.beta2), (0.95, 0.98));
        let c = ds(r#"{"optimizer": {"type": "Lion"}}"#, &[], true).unwrap().config;
        assert_eq!((c.optim.lion.beta1, c.optim.lion.beta2), (0.9, 0.99), "DeepSpeed's defaults");
    }

    #[test]
    fn conflicts_and_unsupported_values_are_errors() {
        let e = ds(r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}}"#, &[], false).unwrap_err().to_string();
        assert!(e.contains("fp16.enabled, bf16.enabled"), "{e}");
        let e = ds(r#"{"optimizer": {"type": "Lamb"}}"#, &[], false).unwrap_err().to_string();
        assert!(e.contains("Lamb"), "{e}");
        let e =
            ds(r#"{"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "weight_decay": 0.1}}}"#, &[], false);
        assert!(e.unwrap_err().to_string().contains("L2"));
        let e = ds(r#"{"zero_optimization": {"stage": "two"}}"#, &[], false).unwrap_err().to_string();
        assert!(e.contains("zero_optimization.stage"), "{e}");
        assert!(ds("[1, 2]", &[], false).is_err());
        assert!(ds("{", &[], false).is_err());
    }

    #[test]
    fn fixed_loss_scale_stays_put_and_companion_and_overrides_layer() {
        let r = ds(r#"{"fp16": {"enabled": true, "loss_scale": 128}}"#, &[], false).unwrap();
        let t = &r.config.train;
        assert_eq!((t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window), (128.0, 128.0, i64::MAX as u64));
        r.config.validate().unwrap();
        assert_eq!(Config::from_toml(&r.config.to_toml(), "resolved", &[]).unwrap(), r.config, "round-trips");
        let companion = "[model]\nn_layer = 2\n[batch]\nglobal = 64\n[train]\nsteps = 7\n";
        let c = Config::from_deepspeed_json(
            r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}"#,
            "ds.json",
            Some((companion, "model.toml")),
            &["train.steps=9".to_string()],
            DeepSpeedOptions::default(),
        )
        .unwrap()
        .config;
        assert_eq!(
            (c.model.shape.get("n_layer"), c.train.steps, c.batch.global),
            (Some(&toml::Value::Integer(2)), 9, None),
            "JSON replaces [batch]"
        );
        let e = Config::from_deepspeed_json(
            "{}",
            "ds.json",
            Some(("[train]\nstepz = 2\n", "m.toml")),
            &[],
            Default::default(),
        );
        assert!(e.unwrap_err().to_string().contains("stepz"));
    }

    #[test]
    fn duplicate_keys_nvme_offload_and_bucket_sizes_name_the_json() {
        // Two equal keys: serde_json would keep the last silently.
        let e = ds(r#"{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}"#, &[], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"stage\" appears twice"), "{e}");
        let e = ds(r#"{"train_batch_size": 8, "train_batch_size": 16}"#, &[], false).unwrap_err().to_string();
        assert!(e.contains("\"train_batch_size\" appears twice"), "{e}");
        // NVMe offload of the optimizer state is the disk offload here.
        let j = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}}"#;
        let r = ds(j, &[], true).unwrap();
        assert_eq!(r.config.dist.offload_optimizer, crate::OffloadOptimizer::Disk);
        assert!(r.warnings.join("\n").contains("nvme_path"), "{:?}", r.warnings);
        // A negative bucket is named by its JSON key and value, not by dist.bucket_mb.
        let e = ds(r#"{"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": -1}}"#, &[], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("zero_optimization.reduce_bucket_size") && e.contains("-1"), "{e}");
        assert!(!e.contains("bucket_mb"), "{e}");
    }
}
