//! LoRA inside the model (`y = x·Wᵀ + (α/r)·(x·Aᵀ)·Bᵀ` on the targeted
//! projections), its initialisation as PEFT does it, merging into the base
//! weights, and adapters in PEFT's on-disk format (`adapter_config.json` +
//! `adapter_model.safetensors`), so `PeftModel.from_pretrained` loads ours
//! and we load theirs.

use crate::error::LlamaError;
use crate::frozen::FrozenBase;
use crate::hf::{self, NamedTensor};
use crate::layout::Proj;
use crate::model::Llama;
use engine::rng::SplitMix64;
use engine::Model;
use nn::{gemm_into, parallelism, GemmDims, GemmOut, Strided};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// File name of PEFT's adapter configuration.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// File name of PEFT's adapter weights.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT puts before the model's own tensor names.
const PEFT_PREFIX: &str = "base_model.model.";
/// `target_modules` shorthand for every projection of every layer (PEFT's
/// meaning: all linear layers but the output head).
pub const ALL_LINEAR: &str = "all-linear";

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
    /// Projections to adapt: `q_proj`, `k_proj`, `v_proj`, `o_proj`,
    /// `gate_proj`, `up_proj`, `down_proj`, or `all-linear` (in a list, or
    /// alone as a string, as PEFT writes it).
    #[serde(deserialize_with = "target_modules")]
    pub target_modules: Vec<String>,
    /// rsLoRA (PEFT's `use_rslora`): the update is scaled by α/√r instead of α/r.
    #[serde(default, skip_serializing_if = "is_false")]
    pub use_rslora: bool,
    /// DoRA (PEFT's `use_dora`): a trainable magnitude per output feature
    /// rescales each row of the adapted weight `W + s·B·A` to it
    /// ([`crate::dora`]).
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
    enum Targets {
        One(String),
        List(Vec<String>),
    }
    match Targets::deserialize(d) {
        Ok(Targets::List(names)) => Ok(names),
        Ok(Targets::One(s)) if s == ALL_LINEAR => Ok(vec![s]),
        Ok(Targets::One(s)) => Err(serde::de::Error::custom(format!(
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

    /// Checks every field.
    pub fn validate(&self) -> Result<(), LlamaError> {
        if self.r == 0 {
            return Err(LlamaError::lora("r", "must be at least 1"));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(LlamaError::lora("lora_alpha", format!("must be positive, got {}", self.alpha)));
        }
        if !(self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout)) {
            return Err(LlamaError::lora("lora_dropout", format!("must be in [0, 1), got {}", self.dropout)));
        }
        // PEFT's DoRA under dropout multiplies the base weight a second
        // time, by the dropped input; that product is not implemented.
        if self.use_dora && self.dropout > 0.0 {
            return Err(LlamaError::lora(
                "lora_dropout",
                format!("= {} with use_dora is not supported; set dropout = 0.0 or use_dora = false", self.dropout),
            ));
        }
        self.targets().map(|_| ())
    }

    /// Which projections carry adapters, indexed by [`Proj`].
    pub fn targets(&self) -> Result<[bool; 7], LlamaError> {
        let mut on = [false; 7];
        if self.target_modules.is_empty() {
            return Err(LlamaError::lora("target_modules", "is empty; name projections or use \"all-linear\""));
        }
        for m in &self.target_modules {
            if m == ALL_LINEAR {
                on = [true; 7];
                continue;
            }
            let p = Proj::from_name(m).ok_or_else(|| {
                let names: Vec<_> = Proj::ALL.iter().map(|p| p.name()).collect();
                LlamaError::lora(
                    "target_modules",
                    format!("holds `{m}`; choose from {}, or {ALL_LINEAR}", names.join(", ")),
                )
            })?;
            on[p as usize] = true;
        }
        Ok(on)
    }

    /// The targeted projections' names in layout order (`all-linear` expanded).
    pub fn target_names(&self) -> Result<Vec<&'static str>, LlamaError> {
        let on = self.targets()?;
        Ok(Proj::ALL.iter().filter(|p| on[**p as usize]).map(|p| p.name()).collect())
    }

    /// The update's scale: α/r, or α/√r with rsLoRA (PEFT computes both in
    /// f64 — `lora_alpha / math.sqrt(r)` — and multiplies in f32).
    pub fn scale(&self) -> f32 {
        match self.use_rslora {
            true => (self.alpha as f64 / (self.r as f64).sqrt()) as f32,
            false => self.alpha / self.r as f32,
        }
    }
}

/// Whether a tensor is a LoRA adapter (everything else is the base model):
/// the binary freezes the rest with `Model::set_trainable`.
pub fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.") || name.ends_with(crate::dora::MAGNITUDE)
}

/// `n` values of `nn.init.kaiming_uniform_(w, a=√5)` for fan-in `fan_in`
/// (`nn.Linear`'s default, which PEFT uses for lora_A): gain √(2/(1+a²)) =
/// √(1/3), bound = gain·√(3/fan_in) = 1/√fan_in, uniform in [−bound, bound).
pub fn kaiming_uniform(rng: &mut SplitMix64, n: usize, fan_in: usize) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    (0..n).map(|_| ((2.0 * rng.next_f64() - 1.0) * bound) as f32).collect()
}

fn require_lora(model: &Llama) -> Result<&LoraConfig, LlamaError> {
    model.lora().ok_or_else(|| LlamaError::lora("model", "has no LoRA adapters"))
}

/// Parameters for `model` (with adapters) from base-model parameters
/// (layout of `Llama::new`): base tensors copied by name, adapters
/// initialised as [`Llama::init_params`] does (A Kaiming-uniform, B zero,
/// a DoRA magnitude the row norms of the base weight) from `seed`.
pub fn attach(model: &Llama, base: &[f32], seed: u64) -> Result<Vec<f32>, LlamaError> {
    attach_with(model, base, seed, model.frozen_base().map(|b| &**b))
}

/// [`attach`] for a model whose projections are packed in `frozen`
/// (outside `base`, which then has the packed layout's tensors): DoRA's
/// magnitudes are the row norms of the dequantised projections.
pub fn attach_with(
    model: &Llama,
    base: &[f32],
    seed: u64,
    frozen: Option<&FrozenBase>,
) -> Result<Vec<f32>, LlamaError> {
    require_lora(model)?;
    let base_model = model.plain()?;
    let base_layout = base_model.layout();
    LlamaError::check_count("base model", base_layout.n_params(), base.len())?;
    let mut out = vec![0.0f32; model.layout().n_params()];
    for t in base_layout.tensors() {
        let dst = model.layout().get(&t.name).ok_or_else(|| LlamaError::MissingTensor { name: t.name.clone() })?;
        out[dst.range()].copy_from_slice(&base[t.range()]);
    }
    init_in_place(model, &mut out, seed, frozen)?;
    Ok(out)
}

/// [`attach_with`] on parameters already laid out for `model`, with the
/// base's tensors in place (the adapters' values are ignored): each
/// adapter starts as initialised from `seed` (B = 0, so the model is the
/// base's function), DoRA's magnitudes at the base's row norms. A loader
/// that places the base straight into the adapted layout needs no second
/// copy of the model.
pub fn init_in_place(
    model: &Llama,
    params: &mut [f32],
    seed: u64,
    frozen: Option<&FrozenBase>,
) -> Result<(), LlamaError> {
    require_lora(model)?;
    LlamaError::check_count("model with adapters", model.layout().n_params(), params.len())?;
    let segs = model.segments();
    for idx in 0..model.config().n_layer {
        let seg = segs[1 + idx].clone();
        model.init_adapters(seed, idx, &mut params[seg.clone()]);
        crate::dora::init_magnitudes(model, idx, &mut params[seg], frozen);
    }
    Ok(())
}

/// The base-model parameters (layout of `Llama::new`) with every adapter
/// merged: `W += (α/r)·B·A` (for `--merge`: a plain Llama checkpoint that
/// computes what the adapted model computes).
pub fn merge(model: &Llama, params: &[f32]) -> Result<Vec<f32>, LlamaError> {
    merge_with(model, params, model.frozen_base().map(|b| &**b))
}

/// [`merge`] of a model whose projections are packed in `base` (outside
/// `params`): each projection dequantised, one at a time, into the result.
pub fn merge_with(model: &Llama, params: &[f32], base: Option<&FrozenBase>) -> Result<Vec<f32>, LlamaError> {
    let lora = require_lora(model)?;
    let layout = model.layout();
    LlamaError::check_count("model", layout.n_params(), params.len())?;
    let base_model = Llama::new(model.config().clone())?;
    let mut out = vec![0.0f32; base_model.layout().n_params()];
    for t in base_model.layout().tensors() {
        if let Some(src) = layout.get(&t.name) {
            out[t.range()].copy_from_slice(&params[src.range()]);
            continue;
        }
        match (base, crate::frozen::proj_of(&t.name)) {
            (Some(b), Some((layer, pr))) => out[t.range()].copy_from_slice(&b.dequantize(model.config(), layer, pr)),
            _ => return Err(LlamaError::MissingTensor { name: t.name.clone() }),
        }
    }
    for idx in 0..model.config().n_layer {
        let (bl, ml) = (base_model.layer_params(idx), model.layer_params(idx));
        for pr in Proj::ALL {
            let Some(lr) = &ml.lora[pr as usize] else { continue };
            let [oc, ic] = pr.shape(model.config());
            let (a, b) = (&params[lr.a.clone()], &params[lr.b.clone()]);
            let w = &mut out[bl.w(pr)];
            // W[oc, ic] += s · B[oc, r] · A[r, ic]
            let (bv, av) = (Strided::rows(b, lora.r), Strided::rows(a, ic));
            gemm_into(
                GemmDims { m: oc, n: ic, k: lora.r },
                w,
                GemmOut { offset: 0, rs: ic, accumulate: true },
                bv,
                av,
                lora.scale(),
                parallelism(false),
            );
            // DoRA: each row of W + s·B·A rescaled to its magnitude (PEFT's merge).
            if let Some(m) = &lr.m {
                crate::dora::rescale_rows(w, &params[m.clone()], ic);
            }
        }
    }
    Ok(out)
}

/// `x` as the f64 its shortest decimal spelling names (0.1f32 is written
/// 0.1, not 0.10000000149011612, as PEFT's Python float would read it).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// `adapter_config.json` as PEFT writes it for a causal LM.
pub fn adapter_config_json(lora: &LoraConfig, base_model_name_or_path: Option<&str>) -> Result<Value, LlamaError> {
    Ok(serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.r,
        "lora_alpha": shortest(lora.alpha),
        "lora_dropout": shortest(lora.dropout),
        "target_modules": lora.target_names()?,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": lora.use_rslora,
        "use_dora": lora.use_dora,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    }))
}

/// Saves `model`'s adapters (from `params`) into `dir` in PEFT's format:
/// `adapter_config.json` and `adapter_model.safetensors` with keys
/// `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`...,
/// each written atomically.
pub fn save_adapter(
    dir: &Path,
    model: &Llama,
    params: &[f32],
    base_model_name_or_path: Option<&str>,
) -> Result<(), LlamaError> {
    let lora = require_lora(model)?;
    let layout = model.layout();
    LlamaError::check_count("model", layout.n_params(), params.len())?;
    std::fs::create_dir_all(dir).map_err(crate::hf::io_err(dir))?;
    let tensors: Vec<_> =
        hf::named(layout, params, PEFT_PREFIX).into_iter().filter(|(n, _, _)| is_adapter(n)).collect();
    nn::io::write_safetensors(&dir.join(ADAPTER_WEIGHTS_FILE), &tensors, &[])?;
    let cfg = adapter_config_json(lora, base_model_name_or_path)?;
    let text = serde_json::to_string_pretty(&cfg).map_err(|e| LlamaError::lora("adapter_config", e.to_string()))?;
    nn::io::write_atomic(&dir.join(ADAPTER_CONFIG_FILE), text.as_bytes())?;
    Ok(())
}

/// A LoRA adapter read from disk.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// Its configuration (build the model with it: `Llama::with_lora`).
    pub config: LoraConfig,
    /// `base_model_name_or_path` from the file, if any.
    pub base_model_name_or_path: Option<String>,
    /// Its tensors under our names (PEFT's prefix removed), by name.
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

/// Reads PEFT's `adapter_config.json` into a [`LoraConfig`]. Settings that
/// change the math and are not implemented (per-layer ranks, biases, regex
/// targets) are errors naming the key.
pub fn lora_config_from_peft(v: &Value) -> Result<(LoraConfig, Option<String>), LlamaError> {
    let get = |key: &str| v.get(key).filter(|x| !x.is_null());
    if let Some(t) = get("peft_type") {
        if t.as_str() != Some("LORA") {
            return Err(LlamaError::lora("peft_type", format!("is {t}; only \"LORA\" adapters are supported")));
        }
    }
    let off = |key: &str, ok: &dyn Fn(&Value) -> bool| -> Result<(), LlamaError> {
        match get(key) {
            Some(x) if !ok(x) => Err(LlamaError::lora(key, format!("= {x} is not supported"))),
            _ => Ok(()),
        }
    };
    let empty = |x: &Value| x.as_object().is_some_and(|o| o.is_empty()) || x.as_array().is_some_and(|a| a.is_empty());
    let flag = |key: &str| -> Result<bool, LlamaError> {
        match get(key) {
            None => Ok(false),
            Some(x) => x.as_bool().ok_or_else(|| LlamaError::lora(key, format!("= {x} is not true or false"))),
        }
    };
    let (use_rslora, use_dora) = (flag("use_rslora")?, flag("use_dora")?);
    off("fan_in_fan_out", &|x| x.as_bool() == Some(false))?;
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
        .ok_or_else(|| LlamaError::lora("r", "is missing or not a positive integer"))? as usize;
    let alpha =
        get("lora_alpha").and_then(Value::as_f64).ok_or_else(|| LlamaError::lora("lora_alpha", "is missing"))?;
    let dropout = get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let target_modules = match get("target_modules") {
        Some(Value::String(s)) if s == ALL_LINEAR => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str().map(str::to_string).ok_or_else(|| LlamaError::lora("target_modules", "must hold strings"))
            })
            .collect::<Result<_, _>>()?,
        other => {
            return Err(LlamaError::lora(
                "target_modules",
                format!("= {other:?} is not supported; give a list of module names or \"all-linear\""),
            ))
        }
    };
    let cfg = LoraConfig { r, alpha: alpha as f32, dropout: dropout as f32, target_modules, use_rslora, use_dora };
    cfg.targets()?;
    Ok((cfg, get("base_model_name_or_path").and_then(Value::as_str).map(str::to_string)))
}

/// Loads an adapter saved in PEFT's format from `dir`.
pub fn load_adapter(dir: &Path) -> Result<Adapter, LlamaError> {
    let cfg_path = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(crate::hf::io_err(&cfg_path))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| crate::hf::bad(&cfg_path, format!("not valid JSON: {e}")))?;
    let (config, base_model_name_or_path) = lora_config_from_peft(&v).map_err(|e| e.in_file(&cfg_path))?;
    let weights = dir.join(ADAPTER_WEIGHTS_FILE);
    let tensors = hf::read_tensors(&weights)?
        .into_iter()
        .map(|(name, shape, data): NamedTensor| {
            let ours = name.strip_prefix(PEFT_PREFIX).unwrap_or(&name).to_string();
            (ours, (shape, data))
        })
        .collect();
    Ok(Adapter { config, base_model_name_or_path, tensors })
}

impl Adapter {
    /// Copies the adapter's tensors into `params` (laid out for `model`,
    /// which must carry the same targets and rank). Every adapter tensor of
    /// the model must be present with its shape, and nothing else.
    pub fn apply(&self, model: &Llama, params: &mut [f32]) -> Result<(), LlamaError> {
        let lora = require_lora(model)?;
        let (m, a) = (lora, &self.config);
        if (m.use_rslora, m.use_dora) != (a.use_rslora, a.use_dora) {
            return Err(LlamaError::lora(
                "use_dora",
                format!(
                    "the model has use_rslora = {}, use_dora = {}; the adapter use_rslora = {}, use_dora = {} \
                     (build the model with the adapter's config)",
                    m.use_rslora, m.use_dora, a.use_rslora, a.use_dora
                ),
            ));
        }
        if m.r != a.r || m.alpha != a.alpha || m.targets()? != a.targets()? {
            return Err(LlamaError::lora(
                "target_modules",
                format!(
                    "the model has r = {}, lora_alpha = {} on {:?}; the adapter r = {}, lora_alpha = {} on {:?} \
                     (build the model with the adapter's config)",
                    m.r,
                    m.alpha,
                    m.target_names()?,
                    a.r,
                    a.alpha,
                    a.target_names()?
                ),
            ));
        }
        let layout = model.layout();
        let mut used = 0;
        for t in layout.tensors().iter().filter(|t| is_adapter(&t.name)) {
            let (shape, data) =
                self.tensors.get(&t.name).ok_or_else(|| LlamaError::MissingTensor { name: t.name.clone() })?;
            if *shape != t.shape || data.len() != t.numel() {
                return Err(LlamaError::ShapeMismatch {
                    name: t.name.clone(),
                    got: shape.clone(),
                    expected: t.shape.clone(),
                });
            }
            params[t.range()].copy_from_slice(data);
            used += 1;
        }
        if used != self.tensors.len() {
            let mut names: Vec<String> =
                self.tensors.keys().filter(|n| layout.get(n).is_none_or(|t| !is_adapter(&t.name))).cloned().collect();
            names.sort();
            names.truncate(5);
            return Err(LlamaError::UnexpectedTensors { names });
        }
        Ok(())
    }
}
