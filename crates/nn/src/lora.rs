//! LoRA, written once for every family: the configuration (PEFT's
//! `LoraConfig` fields that matter here), a family's target names, the
//! branch's arithmetic (`y += s·(x·Aᵀ)·Bᵀ` and its backward), PEFT's
//! initialisation, and adapters in PEFT's on-disk format
//! (`adapter_config.json` + `adapter_model.safetensors`), so
//! `PeftModel.from_pretrained` loads ours and we load theirs.
//!
//! A family names its projections once ([`Targets`]); the layout names
//! its adapter tensors `{projection}.lora_A.weight` `[r, in]` and
//! `{projection}.lora_B.weight` `[out, r]` whatever the base weight's own
//! layout (`nn.Linear` or GPT-2's `Conv1D`), as PEFT does.

use crate::io::{self, FileError};
use crate::linear::{linear_backward_input, linear_backward_weight, linear_forward, Cols, LinearShape};
use crate::{Operands, ParamGrad, Strided};
use engine::rng::SplitMix64;
use engine::ParamLayout;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// File name of PEFT's adapter configuration.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// File name of PEFT's adapter weights.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT puts before the model's own tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// `target_modules` shorthand for every projection of every layer (PEFT's
/// meaning: all linear layers but the output head).
pub const ALL_LINEAR: &str = "all-linear";

/// What can be wrong with a LoRA configuration or adapter files.
#[derive(Debug, Error)]
pub enum LoraError {
    /// A field of the configuration.
    #[error("invalid LoRA config: `{field}` {problem}")]
    Invalid {
        /// The field (`r`, `lora_alpha`, `target_modules`, ...).
        field: String,
        /// What is wrong with it, and the fix.
        problem: String,
    },
    /// Reading or writing an adapter file.
    #[error(transparent)]
    File(#[from] FileError),
    /// An error about the file `path`.
    #[error("{}: {source}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        source: Box<LoraError>,
    },
    /// An adapter tensor of the model is not in the adapter file.
    #[error("adapter tensor `{name}` is missing from the adapter file")]
    Missing {
        /// Its name (without PEFT's prefix).
        name: String,
    },
    /// An adapter tensor has another shape than the model's.
    #[error("adapter tensor `{name}` has shape {got:?}, the model's is {expected:?}")]
    Shape {
        /// Its name.
        name: String,
        /// Its shape in the file.
        got: Vec<usize>,
        /// The model's.
        expected: Vec<usize>,
    },
    /// Tensors of the file that are no adapter of the model (first few, sorted).
    #[error("the adapter file holds tensors the model has no adapter for: {names:?}")]
    Unexpected {
        /// Their names.
        names: Vec<String>,
    },
}

impl LoraError {
    /// A [`LoraError::Invalid`] of `field`.
    pub fn invalid(field: &str, problem: impl Into<String>) -> Self {
        LoraError::Invalid { field: field.to_string(), problem: problem.into() }
    }
}

/// A family's adaptable projections as `target_modules` names them: each
/// name with the projections (indices into the family's list of `n`) it
/// selects — PEFT matches a name against the end of a module's path, so
/// GPT-2's `c_proj` is both the attention's and the MLP's. Names are tried
/// in order when a set is written back ([`LoraConfig::target_names`]):
/// the short names first.
#[derive(Debug, Clone, Copy)]
pub struct Targets {
    /// `(name, projections)`.
    pub modules: &'static [(&'static str, &'static [usize])],
    /// Number of projections per block.
    pub n: usize,
    /// PEFT's `fan_in_fan_out`: the base weights are stored `[in, out]`
    /// (GPT-2's `Conv1D`); PEFT sets it for such layers.
    pub fan_in_fan_out: bool,
}

impl Targets {
    fn names(&self) -> String {
        let names: Vec<_> = self.modules.iter().map(|(n, _)| *n).collect();
        names.join(", ")
    }
}

/// A LoRA configuration (PEFT's `LoraConfig` fields that matter here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank r.
    pub r: usize,
    /// α: the update is scaled by α/r (PEFT's default, 8, when not given).
    #[serde(default = "default_alpha")]
    pub alpha: f32,
    /// Dropout on the adapter's input (PEFT's `lora_dropout`): during
    /// training each input feature of the LoRA branch is zeroed with this
    /// probability and the rest scaled by 1/(1 − p); evaluation runs without.
    #[serde(default)]
    pub dropout: f32,
    /// Projections to adapt, by the family's names (Llama: `q_proj`,
    /// `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`;
    /// GPT-2: `c_attn`, `c_proj`, `c_fc`), or `all-linear` (in a list, or
    /// alone as a string, as PEFT writes it).
    #[serde(deserialize_with = "target_modules")]
    pub target_modules: Vec<String>,
    /// rsLoRA (PEFT's `use_rslora`): the update is scaled by α/√r instead of α/r.
    #[serde(default, skip_serializing_if = "is_false")]
    pub use_rslora: bool,
    /// DoRA (PEFT's `use_dora`): a trainable magnitude per output feature
    /// rescales each row of the adapted weight `W + s·B·A` to it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub use_dora: bool,
}

/// `skip_serializing_if` for flags that are off by default, so a
/// configuration without them serialises as it did before they existed.
fn is_false(b: &bool) -> bool {
    !*b
}

/// `target_modules` as a list of names, or PEFT's string form
/// `"all-linear"` (the same as the list `["all-linear"]`). Any other string
/// is refused: PEFT reads one as a regular expression over module paths.
fn target_modules<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Named {
        One(String),
        List(Vec<String>),
    }
    match Named::deserialize(d) {
        Ok(Named::List(names)) => Ok(names),
        Ok(Named::One(s)) if s == ALL_LINEAR => Ok(vec![s]),
        Ok(Named::One(s)) => Err(serde::de::Error::custom(format!(
            "target_modules = \"{s}\": a string must be \"{ALL_LINEAR}\"; list module names instead, e.g. [\"q_proj\", \"v_proj\"]"
        ))),
        Err(_) => Err(serde::de::Error::custom(format!(
            "target_modules must be a list of module names (e.g. [\"q_proj\", \"v_proj\"]) or \"{ALL_LINEAR}\""
        ))),
    }
}

/// PEFT's `LoraConfig.lora_alpha` default.
fn default_alpha() -> f32 {
    8.0
}

impl LoraConfig {
    /// A configuration without dropout.
    pub fn new(r: usize, alpha: f32, target_modules: &[&str]) -> Self {
        Self {
            r,
            alpha,
            dropout: 0.0,
            target_modules: target_modules.iter().map(|s| s.to_string()).collect(),
            use_rslora: false,
            use_dora: false,
        }
    }

    /// Checks every field against the family's projections `t`.
    pub fn validate(&self, t: &Targets) -> Result<(), LoraError> {
        if self.r == 0 {
            return Err(LoraError::invalid("r", "must be at least 1"));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(LoraError::invalid("lora_alpha", format!("must be positive, got {}", self.alpha)));
        }
        if !(self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout)) {
            return Err(LoraError::invalid("lora_dropout", format!("must be in [0, 1), got {}", self.dropout)));
        }
        // PEFT's DoRA under dropout multiplies the base weight a second
        // time, by the dropped input; that product is not implemented.
        if self.use_dora && self.dropout > 0.0 {
            return Err(LoraError::invalid(
                "lora_dropout",
                format!("= {} with use_dora is not supported; set dropout = 0.0 or use_dora = false", self.dropout),
            ));
        }
        self.targets(t).map(|_| ())
    }

    /// Which of the family's `t.n` projections carry adapters.
    pub fn targets(&self, t: &Targets) -> Result<Vec<bool>, LoraError> {
        let mut on = vec![false; t.n];
        if self.target_modules.is_empty() {
            return Err(LoraError::invalid("target_modules", "is empty; name projections or use \"all-linear\""));
        }
        for m in &self.target_modules {
            if m == ALL_LINEAR {
                // Every projection a module of `t` names (a fused module's
                // adapter sits at its first projection only).
                t.modules.iter().flat_map(|(_, p)| p.iter()).for_each(|&p| on[p] = true);
                continue;
            }
            let (_, projs) = t.modules.iter().find(|(name, _)| name == m).ok_or_else(|| {
                LoraError::invalid("target_modules", format!("holds `{m}`; choose from {}, or {ALL_LINEAR}", t.names()))
            })?;
            projs.iter().for_each(|&p| on[p] = true);
        }
        Ok(on)
    }

    /// The targeted projections as the fewest names of `t.modules`, in
    /// their order (`all-linear` expanded): what `adapter_config.json` lists.
    pub fn target_names(&self, t: &Targets) -> Result<Vec<&'static str>, LoraError> {
        let on = self.targets(t)?;
        let mut covered = vec![false; t.n];
        let mut names = Vec::new();
        for (name, projs) in t.modules {
            if projs.iter().all(|&p| on[p]) && projs.iter().any(|&p| !covered[p]) {
                projs.iter().for_each(|&p| covered[p] = true);
                names.push(*name);
            }
        }
        Ok(names)
    }

    /// The update's scale: α/r, or α/√r with rsLoRA (PEFT computes both in
    /// f64 — `lora_alpha / math.sqrt(r)` — and multiplies in f32).
    pub fn scale(&self) -> f32 {
        match self.use_rslora {
            true => (self.alpha as f64 / (self.r as f64).sqrt()) as f32,
            false => self.alpha / self.r as f32,
        }
    }

    /// `adapter_config.json` as PEFT writes it for a causal LM of the
    /// family with projections `t`.
    pub fn adapter_config_json(&self, t: &Targets, base_model_name_or_path: Option<&str>) -> Result<Value, LoraError> {
        Ok(serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.r,
            "lora_alpha": shortest(self.alpha),
            "lora_dropout": shortest(self.dropout),
            "target_modules": self.target_names(t)?,
            "bias": "none",
            "fan_in_fan_out": t.fan_in_fan_out,
            "inference_mode": true,
            "init_lora_weights": true,
            "use_rslora": self.use_rslora,
            "use_dora": self.use_dora,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        }))
    }

    /// Reads PEFT's `adapter_config.json` for the family with projections
    /// `t`, and its `base_model_name_or_path`. Settings that change the
    /// math and are not implemented (per-layer ranks, biases, regex
    /// targets) are errors naming the key.
    pub fn from_peft(v: &Value, t: &Targets) -> Result<(LoraConfig, Option<String>), LoraError> {
        let get = |key: &str| v.get(key).filter(|x| !x.is_null());
        if let Some(p) = get("peft_type") {
            if p.as_str() != Some("LORA") {
                return Err(LoraError::invalid("peft_type", format!("is {p}; only \"LORA\" adapters are supported")));
            }
        }
        let off = |key: &str, ok: &dyn Fn(&Value) -> bool| -> Result<(), LoraError> {
            match get(key) {
                Some(x) if !ok(x) => Err(LoraError::invalid(key, format!("= {x} is not supported"))),
                _ => Ok(()),
            }
        };
        let empty =
            |x: &Value| x.as_object().is_some_and(|o| o.is_empty()) || x.as_array().is_some_and(|a| a.is_empty());
        let flag = |key: &str| -> Result<bool, LoraError> {
            match get(key) {
                None => Ok(false),
                Some(x) => x.as_bool().ok_or_else(|| LoraError::invalid(key, format!("= {x} is not true or false"))),
            }
        };
        let (use_rslora, use_dora) = (flag("use_rslora")?, flag("use_dora")?);
        // PEFT sets fan_in_fan_out itself from the layer type: only the
        // family's own value describes these tensors.
        off("fan_in_fan_out", &|x| x.as_bool() == Some(t.fan_in_fan_out))?;
        off("lora_bias", &|x| x.as_bool() == Some(false))?;
        off("bias", &|x| x.as_str() == Some("none"))?;
        off("rank_pattern", &empty)?;
        off("alpha_pattern", &empty)?;
        off("layers_to_transform", &|_| false)?;
        off("modules_to_save", &empty)?;
        for key in ["exclude_modules", "target_parameters", "trainable_token_indices", "layer_replication"] {
            off(key, &empty)?;
        }
        let r = get("r")
            .and_then(Value::as_u64)
            .ok_or_else(|| LoraError::invalid("r", "is missing or not a positive integer"))? as usize;
        let alpha =
            get("lora_alpha").and_then(Value::as_f64).ok_or_else(|| LoraError::invalid("lora_alpha", "is missing"))?;
        let dropout = get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
        let target_modules = match get("target_modules") {
            Some(Value::String(s)) if s == ALL_LINEAR => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| LoraError::invalid("target_modules", "must hold strings"))
                })
                .collect::<Result<_, _>>()?,
            other => {
                return Err(LoraError::invalid(
                    "target_modules",
                    format!("= {other:?} is not supported; give a list of module names or \"{ALL_LINEAR}\""),
                ))
            }
        };
        let cfg = LoraConfig { r, alpha: alpha as f32, dropout: dropout as f32, target_modules, use_rslora, use_dora };
        cfg.targets(t)?;
        Ok((cfg, get("base_model_name_or_path").and_then(Value::as_str).map(str::to_string)))
    }
}

/// The key of `config.json` that holds a LoRA model's adapters (not a
/// transformers key): it makes a LoRA shape differ from its base's.
pub const CONFIG_KEY: &str = "macrobatch_lora";

/// `lora` as [`CONFIG_KEY`]'s value: its targets as the fewest names of
/// `t`, so `all-linear` and its list (as PEFT's adapter config spells it,
/// and as a checkpoint reads back) are the same shape.
pub fn config_value(lora: &LoraConfig, t: &Targets) -> Value {
    let mut l = lora.clone();
    if let Ok(names) = lora.target_names(t) {
        l.target_modules = names.into_iter().map(String::from).collect();
    }
    serde_json::to_value(&l).unwrap_or_default()
}

/// The LoRA configuration of the adapters saved in the model folder `dir`
/// (PEFT's `adapter_config.json` beside the base), for the family with
/// projections `t`; `None` when there are none. Adapter weights (or
/// `config`'s [`CONFIG_KEY`]) without their configuration are an error:
/// never silently the base alone.
pub fn config_beside(dir: &Path, config: &Value, t: &Targets) -> Result<Option<LoraConfig>, LoraError> {
    let path = dir.join(ADAPTER_CONFIG_FILE);
    if path.exists() {
        let text = std::fs::read_to_string(&path).map_err(io::io_err(&path))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| io::bad(&path, format!("not valid JSON: {e}")))?;
        let (lora, _) =
            LoraConfig::from_peft(&v, t).map_err(|e| LoraError::InFile { path: path.clone(), source: Box::new(e) })?;
        return Ok(Some(lora));
    }
    if dir.join(ADAPTER_WEIGHTS_FILE).exists() || config.get(CONFIG_KEY).is_some() {
        return Err(io::bad(
            dir,
            format!(
                "the folder holds LoRA adapters ({ADAPTER_WEIGHTS_FILE}, or \"{CONFIG_KEY}\" in config.json) but {ADAPTER_CONFIG_FILE} is missing, so they cannot be applied and the model would silently be the base alone; put the run's {ADAPTER_CONFIG_FILE} back beside them (or move the adapter files away to load the base on purpose)"
            ),
        )
        .into());
    }
    Ok(None)
}

/// `x` as the f64 its shortest decimal spelling names (0.1f32 is written
/// 0.1, not 0.10000000149011612, as PEFT's Python float would read it).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// Whether a tensor is a LoRA adapter (everything else is the base model):
/// the binary freezes the rest with `Model::set_trainable`.
pub fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.") || name.ends_with(MAGNITUDE)
}

/// The name ending of a DoRA magnitude (PEFT's `lora_magnitude_vector`).
pub const MAGNITUDE: &str = "lora_magnitude_vector";

/// `n` values of `nn.init.kaiming_uniform_(w, a=√5)` for fan-in `fan_in`
/// (`nn.Linear`'s default, which PEFT uses for lora_A): gain √(2/(1+a²)) =
/// √(1/3), bound = gain·√(3/fan_in) = 1/√fan_in, uniform in [−bound, bound).
pub fn kaiming_uniform(rng: &mut SplitMix64, n: usize, fan_in: usize) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    (0..n).map(|_| ((2.0 * rng.next_f64() - 1.0) * bound) as f32).collect()
}

/// Element ranges of one adapter's tensors in a block's segment:
/// `lora_A` `[r, in]`, `lora_B` `[out, r]`, and with DoRA the magnitude `[out]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraRanges {
    /// `lora_A.weight`.
    pub a: std::ops::Range<usize>,
    /// `lora_B.weight`.
    pub b: std::ops::Range<usize>,
    /// `lora_magnitude_vector` (DoRA only).
    pub m: Option<std::ops::Range<usize>>,
}

/// One adapter as a block runs it on `n` rows: A `[r, in]`, B `[out, r]`,
/// the update's scale and the GEMM operands.
#[derive(Debug, Clone, Copy)]
pub struct Branch<'a> {
    /// lora_A.
    pub a: &'a [f32],
    /// lora_B.
    pub b: &'a [f32],
    /// Rank r.
    pub r: usize,
    /// α/r (or α/√r).
    pub scale: f32,
    /// Rows.
    pub n: usize,
    /// GEMM operands.
    pub ops: Operands,
}

impl Branch<'_> {
    fn down_shape(&self) -> LinearShape {
        LinearShape::new(self.n, self.a.len() / self.r, self.r, self.ops)
    }

    fn up_shape(&self) -> LinearShape {
        LinearShape::new(self.n, self.r, self.b.len() / self.r, self.ops).scaled(self.scale)
    }

    /// `xa = x·Aᵀ`: (n, in) @ (in, r) -> (n, r), overwritten.
    pub fn down(&self, xa: &mut [f32], x: &[f32]) {
        linear_forward(Cols::all(xa, self.r), false, x, self.a, self.down_shape());
    }

    /// `y += s · xa·Bᵀ`: (n, r) @ (r, out) -> (n, out), added into `y`'s columns.
    pub fn up(&self, y: Cols<'_>, xa: &[f32]) {
        linear_forward(y, true, xa, self.b, self.up_shape());
    }

    /// The weight gradients from the output gradient `dy` and the forward's
    /// input `x` and `xa`: `dB (+)= s·dyᵀ·xa`, `dxa = s·dy·B` (into `dxa`,
    /// overwritten: (n, r)), `dA (+)= dxaᵀ·x`. A frozen tensor's gradient
    /// (`None`) is skipped; `dxa` never is.
    pub fn backward(
        &self,
        (ga, gb): (Option<ParamGrad<'_>>, Option<ParamGrad<'_>>),
        dy: Strided<'_>,
        (x, xa): (&[f32], &[f32]),
        dxa: &mut [f32],
    ) {
        let up = self.up_shape();
        // dB (+)= s · dyᵀ · xa: (out, n) @ (n, r) -> (out, r)
        linear_backward_weight(gb, dy, xa, up);
        // dxa = s · dy · B: (n, out) @ (out, r) -> (n, r)
        linear_backward_input(dxa, false, dy, self.b, up);
        // dA (+)= dxaᵀ · x: (r, n) @ (n, in) -> (r, in)
        linear_backward_weight(ga, Strided::rows(dxa, self.r), x, self.down_shape());
    }

    /// The input gradient through the branch: `dx (+)= dxa · A`:
    /// (n, r) @ (r, in) -> (n, in).
    pub fn input_grad(&self, dx: &mut [f32], accumulate: bool, dxa: &[f32]) {
        linear_backward_input(dx, accumulate, Strided::rows(dxa, self.r), self.a, self.down_shape());
    }
}

/// Saves the adapter tensors of `layout` (values from `params`) into `dir`
/// in PEFT's format: `adapter_model.safetensors` with PEFT's prefix on
/// each name, and `config` (from [`LoraConfig::adapter_config_json`]) as
/// `adapter_config.json`; each file written atomically.
pub fn save_adapter(dir: &Path, layout: &ParamLayout, params: &[f32], config: &Value) -> Result<(), LoraError> {
    std::fs::create_dir_all(dir).map_err(io::io_err(dir))?;
    let tensors: Vec<_> = layout
        .tensors()
        .iter()
        .filter(|t| is_adapter(&t.name))
        .map(|t| (format!("{PEFT_PREFIX}{}", t.name), t.shape.clone(), &params[t.range()]))
        .collect();
    io::write_safetensors(&dir.join(ADAPTER_WEIGHTS_FILE), &tensors, &[])?;
    let text = serde_json::to_string_pretty(config).map_err(|e| LoraError::invalid("adapter_config", e.to_string()))?;
    io::write_atomic(&dir.join(ADAPTER_CONFIG_FILE), text.as_bytes())?;
    Ok(())
}

/// A LoRA adapter read from disk.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// Its configuration (build the model with it).
    pub config: LoraConfig,
    /// `base_model_name_or_path` from the file, if any.
    pub base_model_name_or_path: Option<String>,
    /// Its tensors under our names (PEFT's prefix removed), by name.
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

/// Loads an adapter saved in PEFT's format from `dir`, for the family with
/// projections `t` (F32, F16 and BF16 tensors, widened exactly).
pub fn load_adapter(dir: &Path, t: &Targets) -> Result<Adapter, LoraError> {
    let cfg_path = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(io::io_err(&cfg_path))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| io::bad(&cfg_path, format!("not valid JSON: {e}")))?;
    let (config, base_model_name_or_path) =
        LoraConfig::from_peft(&v, t).map_err(|e| LoraError::InFile { path: cfg_path.clone(), source: Box::new(e) })?;
    let path = dir.join(ADAPTER_WEIGHTS_FILE);
    let bytes = io::map_file(&path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| io::bad(&path, format!("not a valid safetensors file ({e}); it may be truncated or corrupt")))?;
    let mut tensors = HashMap::new();
    for (name, view) in st.tensors() {
        let mut data = vec![0.0; view.shape().iter().product()];
        io::decode_into(view.dtype(), view.data(), &mut data)
            .map_err(|p| io::bad(&path, format!("tensor `{name}` {p}")))?;
        let ours = name.strip_prefix(PEFT_PREFIX).unwrap_or(&name).to_string();
        tensors.insert(ours, (view.shape().to_vec(), data));
    }
    Ok(Adapter { config, base_model_name_or_path, tensors })
}

impl Adapter {
    /// Copies the adapter's tensors into `params` (laid out as `layout`,
    /// whose model has adapters configured as `model`, for the family's
    /// projections `t`): the configuration must match, and every adapter
    /// tensor of the layout must be present with its shape, and nothing else.
    pub fn apply(
        &self,
        (layout, model, t): (&ParamLayout, &LoraConfig, &Targets),
        params: &mut [f32],
    ) -> Result<(), LoraError> {
        let (m, a) = (model, &self.config);
        if (m.use_rslora, m.use_dora) != (a.use_rslora, a.use_dora) {
            return Err(LoraError::invalid(
                "use_dora",
                format!(
                    "the model has use_rslora = {}, use_dora = {}; the adapter use_rslora = {}, use_dora = {} \
                     (build the model with the adapter's config)",
                    m.use_rslora, m.use_dora, a.use_rslora, a.use_dora
                ),
            ));
        }
        if m.r != a.r || m.alpha != a.alpha || m.targets(t)? != a.targets(t)? {
            return Err(LoraError::invalid(
                "target_modules",
                format!(
                    "the model has r = {}, lora_alpha = {} on {:?}; the adapter r = {}, lora_alpha = {} on {:?} \
                     (build the model with the adapter's config)",
                    m.r,
                    m.alpha,
                    m.target_names(t)?,
                    a.r,
                    a.alpha,
                    a.target_names(t)?
                ),
            ));
        }
        let mut used = 0;
        for spec in layout.tensors().iter().filter(|s| is_adapter(&s.name)) {
            let (shape, data) =
                self.tensors.get(&spec.name).ok_or_else(|| LoraError::Missing { name: spec.name.clone() })?;
            if *shape != spec.shape || data.len() != spec.numel() {
                return Err(LoraError::Shape {
                    name: spec.name.clone(),
                    got: shape.clone(),
                    expected: spec.shape.clone(),
                });
            }
            params[spec.range()].copy_from_slice(data);
            used += 1;
        }
        if used != self.tensors.len() {
            let mut names: Vec<String> =
                self.tensors.keys().filter(|n| layout.get(n).is_none_or(|s| !is_adapter(&s.name))).cloned().collect();
            names.sort();
            names.truncate(5);
            return Err(LoraError::Unexpected { names });
        }
        Ok(())
    }
}
