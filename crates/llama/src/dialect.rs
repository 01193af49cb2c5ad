//! A family on the Llama block as a [`Dialect`] (its names, presets and
//! `config.json`), and what the dialects share in reading and
//! writing `config.json`: a family's file is Llama's with a few keys of its
//! own, so each reads it as Llama's once those keys are taken out
//! ([`read_as_llama`]) and writes Llama's with its own put in
//! ([`written_as`]). Windows are read and written once: a positive
//! `sliding_window` or null ([`read_window`]), transformers' `layer_types`
//! ([`read_layer_types`], [`layer_types`]), and Qwen2's and Qwen3's keys
//! around them ([`QwenWindows`]).

use crate::LlamaConfig;
use family::Result;
use serde_json::{Map, Value};

/// How one family built on the Llama block names itself and maps its
/// `config.json`.
pub trait Dialect: Sync + std::fmt::Debug {
    /// The family's names and presets.
    fn names(&self) -> Names;
    /// `model.family` and `config.json`'s `model_type` (`llama`).
    fn family(&self) -> &'static str {
        self.names().family
    }
    /// Human name (`Llama`).
    fn name(&self) -> &'static str {
        self.names().name
    }
    /// The presets `model.preset` may name.
    fn presets(&self) -> &'static [&'static str] {
        self.names().presets
    }
    /// The shape of a preset.
    fn preset(&self, name: &str) -> Result<LlamaConfig>;
    /// The shape a `config.json` of this family describes.
    fn parse_hf_json(&self, v: &serde_json::Value) -> Result<LlamaConfig>;
    /// `config.json` for this family in transformers.
    fn hf_json(&self, cfg: &LlamaConfig) -> serde_json::Value;
    /// The GGUF `general.architecture` this family loads, if any: the one
    /// it is written as ([`crate::import`] reads what [`crate::export`] writes).
    fn gguf_architecture(&self) -> Option<&'static str> {
        self.gguf_arch().map(|a| a.name)
    }
    /// How this family is written as GGUF, if it is.
    fn gguf_arch(&self) -> Option<crate::export::GgufArch> {
        None
    }
}

/// How a dialect names itself: [`Dialect::names`].
#[derive(Debug, Clone, Copy)]
pub struct Names {
    /// `model.family` and `config.json`'s `model_type` (`llama`).
    pub family: &'static str,
    /// Human name (`Llama`).
    pub name: &'static str,
    /// The presets `model.preset` may name.
    pub presets: &'static [&'static str],
}

/// `v`, a `config.json` of `model_type`, read as Llama's: `v` must be an
/// object with that `model_type` (or none); `own` (the family's keys,
/// already read by the caller) and `architectures` are removed first.
/// Errors say they read `what` (e.g. "Qwen3 config.json (read as the Llama
/// block with per-head q/k norms)").
pub fn read_as_llama(v: &Value, model_type: &str, own: &[&str], what: &str) -> Result<LlamaConfig> {
    let o = object(v)?;
    if let Some(mt) = o.get("model_type").filter(|m| m.as_str() != Some(model_type)) {
        return Err(format!("model_type = {mt} is not \"{model_type}\"").into());
    }
    let mut as_llama = o.clone();
    for k in own.iter().chain(&["architectures"]) {
        as_llama.remove(*k);
    }
    as_llama.insert("model_type".into(), Value::from("llama"));
    Ok(LlamaConfig::from_hf_json(&Value::Object(as_llama)).map_err(|e| format!("{what}: {e}"))?)
}

/// `v` as a JSON object, or an error saying it must be one.
pub fn object(v: &Value) -> Result<&Map<String, Value>> {
    v.as_object().ok_or_else(|| "config.json must be a JSON object".into())
}

/// Llama's `config.json` of `cfg` written as `architecture` /
/// `model_type`: Llama's keys `drop` removed, `own` keys put in.
pub fn written_as(
    cfg: &LlamaConfig,
    (architecture, model_type): (&str, &str),
    drop: &[&str],
    own: Map<String, Value>,
) -> Value {
    let mut v = cfg.to_hf_json();
    if let Some(o) = v.as_object_mut() {
        for k in drop {
            o.remove(*k);
        }
        o.insert("architectures".into(), serde_json::json!([architecture]));
        o.insert("model_type".into(), Value::from(model_type));
        o.extend(own);
    }
    v
}

/// `sliding_window`: a positive integer, or `None` where it is absent or null.
pub fn read_window(v: &Value) -> Result<Option<usize>> {
    match object(v)?.get("sliding_window") {
        None | Some(Value::Null) => Ok(None),
        Some(w) => match w.as_u64() {
            Some(w) if w > 0 => Ok(Some(w as usize)),
            _ => Err(format!("sliding_window = {w}: must be a positive integer or null").into()),
        },
    }
}

/// transformers' `layer_types` as windowed flags (`"sliding_attention"`:
/// windowed, `"full_attention"`: not), one per layer of `n_layer`; `None`
/// where it is absent or null.
pub fn read_layer_types(v: &Value, n_layer: usize) -> Result<Option<Vec<bool>>> {
    let types = match object(v)?.get("layer_types") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(types)) => types,
        Some(t) => return Err(format!("layer_types = {t}: must be a list").into()),
    };
    if types.len() != n_layer {
        return Err(format!("layer_types has {} entries for {n_layer} layers: give one per layer", types.len()).into());
    }
    let flag = |t: &Value| match t.as_str() {
        Some("sliding_attention") => Ok(true),
        Some("full_attention") => Ok(false),
        _ => Err(format!("layer_types holds {t}: each must be \"sliding_attention\" or \"full_attention\"")),
    };
    Ok(Some(types.iter().map(flag).collect::<std::result::Result<_, _>>()?))
}

/// `cfg`'s `layer_types` as transformers writes them.
pub fn layer_types(cfg: &LlamaConfig) -> Value {
    let name = |i| if cfg.window_of(i).is_some() { "sliding_attention" } else { "full_attention" };
    Value::from((0..cfg.n_layer).map(name).collect::<Vec<_>>())
}

/// Qwen2's and Qwen3's sliding-window keys: `use_sliding_window` switches
/// the window on, `sliding_window` is its width, and the layers it applies
/// to are `layer_types`' sliding ones, or — without that list — those from
/// `max_window_layers` on (transformers' `Qwen2Config.__post_init__`).
#[derive(Debug)]
pub struct QwenWindows;

impl QwenWindows {
    /// The keys, which Llama's reader does not know.
    pub const KEYS: [&'static str; 4] = ["use_sliding_window", "sliding_window", "max_window_layers", "layer_types"];

    /// transformers' default `max_window_layers` (Qwen2Config's and Qwen3Config's).
    const MAX_WINDOW_LAYERS: usize = 28;

    /// The window and the windowed layers `v` says a model of `n_layer`
    /// layers has: `(None, None)` unless `use_sliding_window` is true and
    /// `sliding_window` is set.
    pub fn read(v: &Value, n_layer: usize) -> Result<(Option<usize>, Option<Vec<bool>>)> {
        let o = object(v)?;
        let on = match o.get("use_sliding_window") {
            None | Some(Value::Null) => false,
            Some(b) => b.as_bool().ok_or_else(|| format!("use_sliding_window = {b}: must be true or false"))?,
        };
        // Off, the width is not read (Qwen2-MoE's files hold 0 there).
        let window = if on { read_window(v)? } else { None };
        let layers = read_layer_types(v, n_layer)?;
        let Some(w) = window else { return Ok((None, None)) };
        let layers = match layers {
            Some(l) => l,
            None => {
                let from = match o.get("max_window_layers") {
                    None | Some(Value::Null) => Self::MAX_WINDOW_LAYERS,
                    Some(m) => {
                        m.as_u64().ok_or_else(|| format!("max_window_layers = {m}: must be a non-negative integer"))?
                            as usize
                    }
                };
                (0..n_layer).map(|i| i >= from).collect()
            }
        };
        Ok((Some(w), Some(layers)))
    }

    /// The keys as transformers writes them for `cfg` (its window off when
    /// it has none; `max_window_layers`: the leading layers without one).
    pub fn written(cfg: &LlamaConfig) -> Map<String, Value> {
        let n = cfg.n_layer;
        let mut m = Map::new();
        m.insert("use_sliding_window".into(), Value::Bool(cfg.sliding_window.is_some()));
        m.insert("sliding_window".into(), cfg.sliding_window.map_or(Value::Null, Value::from));
        let leading_full = (0..n).find(|&i| cfg.window_of(i).is_some()).unwrap_or(n);
        m.insert("max_window_layers".into(), Value::from(leading_full));
        m.insert("layer_types".into(), layer_types(cfg));
        m
    }
}
