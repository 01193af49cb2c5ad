//! What the dialects of the Llama block's families share in reading and
//! writing `config.json`: a family's file is Llama's with a few keys of its
//! own, so each reads it as Llama's once those keys are taken out
//! ([`read_as_llama`]) and writes Llama's with its own put in
//! ([`written_as`]). Qwen2 and Qwen3 also share their sliding-window keys
//! ([`QwenWindows`]), which must say "off" (their per-layer windows are not
//! implemented).

use crate::LlamaConfig;
use family::Result;
use serde_json::{Map, Value};

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

/// Qwen2's and Qwen3's sliding-window keys: read (every layer must be full
/// attention, or the model would compute something else) and written (off).
#[derive(Debug)]
pub struct QwenWindows;

impl QwenWindows {
    /// The keys, which Llama's reader does not know.
    pub const KEYS: [&'static str; 4] = ["use_sliding_window", "sliding_window", "max_window_layers", "layer_types"];

    /// Refuses a file whose layers are not all full attention.
    pub fn refuse_windows(v: &Value) -> Result<()> {
        let o = object(v)?;
        if o.get("use_sliding_window").is_some_and(|u| u.as_bool() != Some(false)) {
            return Err("use_sliding_window must be false: sliding-window attention is not implemented".into());
        }
        if let Some(layers) = o.get("layer_types").and_then(Value::as_array) {
            if let Some(l) = layers.iter().find(|l| l.as_str() != Some("full_attention")) {
                return Err(format!("layer_types holds {l}: only full_attention layers are implemented").into());
            }
        }
        Ok(())
    }

    /// The keys as transformers writes them for `n_layer` full-attention layers.
    pub fn off(n_layer: usize) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("use_sliding_window".into(), Value::Bool(false));
        m.insert("sliding_window".into(), Value::Null);
        m.insert("max_window_layers".into(), Value::from(n_layer));
        m.insert("layer_types".into(), Value::from(vec!["full_attention"; n_layer]));
        m
    }
}
