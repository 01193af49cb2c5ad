//! Model shapes, the named presets, and Hugging Face `config.json` in both
//! directions (`LlamaForCausalLM`).

use crate::error::LlamaError;

mod gemma;
mod moe;
mod presets;
pub use gemma::GemmaBlock;
pub use moe::{LoadBalancing, MoeBlock, MoeNames};
pub use presets::PRESETS;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The shape of a Llama model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size V.
    pub vocab_size: usize,
    /// Residual width C.
    pub hidden_size: usize,
    /// Width F of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub n_layer: usize,
    /// Number of query heads.
    pub n_head: usize,
    /// Number of key/value heads (grouped-query attention: divides `n_head`).
    pub n_kv_head: usize,
    /// Width of one head (= hidden_size / n_head).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// Whether the LM head is the token embedding.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token, if the vocabulary has one.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (generation stops at any of them).
    #[serde(default)]
    pub eos_token_id: Vec<u32>,
    /// Biases on the q, k and v projections, as Qwen2's layers have them
    /// (config.json's `attention_bias`). o_proj has none: a checkpoint
    /// holding an `o_proj.bias` (transformers' Llama puts one there too) is
    /// refused on load as an unexpected tensor, never ignored.
    #[serde(default)]
    pub attention_bias: bool,
    /// RoPE frequency scaling (`rope_scaling`); `None`: plain RoPE.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm over each query and each key head (width `head_dim`, gains
    /// `self_attn.q_norm` and `self_attn.k_norm` shared by the heads) after
    /// the projections and before the rotation, as Qwen3's layers have it.
    #[serde(default)]
    pub qk_norm: bool,
    /// Sliding-window attention (Mistral's `sliding_window`): each query
    /// sees its `w` latest keys, itself included; `None`: every earlier key.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Which layers the window applies to (`true`: windowed), one entry
    /// per layer, as transformers' `layer_types` (`"sliding_attention"` /
    /// `"full_attention"`); `None`: every layer, when there is a window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_layers: Option<Vec<bool>>,
    /// Gemma 2's layer and head; `None`: Llama's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemma: Option<GemmaBlock>,
    /// Phi-3's modules: q|k|v one `self_attn.qkv_proj` and gate|up one
    /// `mlp.gate_up_proj` (the layout keeps each group as one matrix
    /// anyway), so LoRA adapts each group whole, with PEFT's names.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fused_modules: bool,
    /// A mixture of experts in place of the MLP (Mixtral, Qwen-MoE);
    /// `None`: the dense SwiGLU MLP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeBlock>,
}

/// Llama 3's RoPE frequency scaling (`rope_scaling` with
/// `rope_type = "llama3"`), as transformers' `_compute_llama3_parameters`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// `factor`: low frequencies are divided by it.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: usize,
}

impl RopeScaling {
    /// Reads a `rope_scaling` (or transformers 5 `rope_parameters`) object;
    /// `None` for plain RoPE (`rope_type` absent or `"default"` without
    /// scaling keys). Any other type is an error naming it.
    fn from_hf_json(v: &Value, key: &str) -> Result<Option<Self>, LlamaError> {
        let rope_type = v.get("rope_type").or_else(|| v.get("type")).filter(|x| !x.is_null());
        match rope_type.map(|t| t.as_str()) {
            None | Some(Some("default")) => return Ok(None),
            Some(Some("llama3")) => {}
            Some(_) => {
                let t = rope_type.map(Value::to_string).unwrap_or_default();
                return Err(LlamaError::unsupported(
                    format!("{key}.rope_type = {t}"),
                    "only \"default\" and \"llama3\" RoPE are supported",
                ));
            }
        }
        let num = |name: &str| -> Result<f64, LlamaError> {
            let x = v.get(name).ok_or_else(|| LlamaError::config(&format!("{key}.{name}"), "is missing"))?;
            x.as_f64().ok_or_else(|| LlamaError::config(&format!("{key}.{name}"), format!("must be a number, got {x}")))
        };
        let orig = "original_max_position_embeddings";
        let s = RopeScaling {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: v
                .get(orig)
                .and_then(Value::as_u64)
                .ok_or_else(|| LlamaError::config(&format!("{key}.{orig}"), "must be a positive integer"))?
                as usize,
        };
        s.validate()?;
        Ok(Some(s))
    }

    /// The scaling as the `nn` kernels take it.
    pub fn kernel(&self) -> nn::rope::Llama3Scaling {
        nn::rope::Llama3Scaling {
            factor: self.factor,
            low_freq_factor: self.low_freq_factor,
            high_freq_factor: self.high_freq_factor,
            original_max_position_embeddings: self.original_max_position_embeddings,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), LlamaError> {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if !(ok(self.factor) && ok(self.low_freq_factor) && ok(self.high_freq_factor)) {
            return Err(LlamaError::config("rope_scaling", format!("factors must be positive: {self:?}")));
        }
        if self.high_freq_factor <= self.low_freq_factor || self.original_max_position_embeddings == 0 {
            return Err(LlamaError::config(
                "rope_scaling",
                format!("needs high_freq_factor > low_freq_factor and original_max_position_embeddings > 0: {self:?}"),
            ));
        }
        Ok(())
    }

    /// The `rope_scaling` object transformers writes.
    fn to_hf_json(self, rope_theta: f64) -> Value {
        serde_json::json!({
            "rope_type": "llama3",
            "rope_theta": rope_theta,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        })
    }
}

/// `v[key]` as a non-negative integer; `None` where it is absent or null.
pub(crate) fn json_uint(v: &Value, key: &str) -> Result<Option<usize>, LlamaError> {
    v.get(key)
        .filter(|x| !x.is_null())
        .map(|x| {
            x.as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| LlamaError::config(key, format!("must be a non-negative integer, got {x}")))
        })
        .transpose()
}

/// `x` (the value of `key`) as a number; `default` where it is absent or null.
pub(crate) fn json_number(x: Option<&Value>, key: &str, default: f64) -> Result<f64, LlamaError> {
    x.filter(|x| !x.is_null()).map_or(Ok(default), |x| {
        x.as_f64().ok_or_else(|| LlamaError::config(key, format!("must be a number, got {x}")))
    })
}

impl LlamaConfig {
    /// Checks that every dimension is usable.
    pub fn validate(&self) -> Result<(), LlamaError> {
        let dims = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_kv_head", self.n_kv_head),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in dims {
            if v == 0 {
                return Err(LlamaError::config(name, "must be at least 1, got 0"));
            }
        }
        if self.sliding_window == Some(0) {
            return Err(LlamaError::config("sliding_window", "must be at least 1 (a query sees itself)"));
        }
        if let Some(layers) = &self.sliding_layers {
            if layers.len() != self.n_layer {
                return Err(LlamaError::config(
                    "layer_types",
                    format!("has {} entries for {} layers: give one per layer", layers.len(), self.n_layer),
                ));
            }
        }
        if let Some(g) = &self.gemma {
            g.validate()?;
        }
        if let Some(m) = &self.moe {
            m.validate()?;
            if self.gemma.is_some() || self.fused_modules {
                return Err(LlamaError::config(
                    "moe",
                    "a mixture of experts is not implemented with Gemma's or Phi-3's block",
                ));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(LlamaError::config(
                "head_dim",
                format!("({}) must be even for rotary embeddings", self.head_dim),
            ));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(LlamaError::config(
                "n_kv_head",
                format!("({}) must divide n_head ({})", self.n_kv_head, self.n_head),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(LlamaError::config("rms_norm_eps", format!("must be positive, got {}", self.rms_norm_eps)));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(LlamaError::config("rope_theta", format!("must be positive, got {}", self.rope_theta)));
        }
        if let Some(s) = &self.rope_scaling {
            s.validate()?;
        }
        if self.vocab_size > i32::MAX as usize {
            return Err(LlamaError::config("vocab_size", format!("({}) is too large", self.vocab_size)));
        }
        // Counted, not laid out: a hostile shape is refused before any
        // buffer of its size exists. Layout: embedding, final norm, head +
        // per layer 9 (and 3 biases).
        engine::check_shape_size(self.param_count(), self.n_layer, self.tensors_per_layer(), 3)
            .map_err(LlamaError::TooLarge)
    }

    /// Total parameters without adapters, in `u128` (no shape overflows
    /// it): what [`LlamaConfig::n_params`] returns for a validated shape.
    pub fn param_count(&self) -> u128 {
        let (v, c) = (self.vocab_size as u128, self.hidden_size as u128);
        let head = if self.tie_word_embeddings { 0 } else { v * c };
        v * c + self.n_layer as u128 * self.layer_param_count() + c + head
    }

    /// Parameters of one decoder layer (without LoRA adapters), in `u128`:
    /// the one count [`LlamaConfig::param_count`] and
    /// [`LlamaConfig::layer_params`] read.
    fn layer_param_count(&self) -> u128 {
        let (c, f) = (self.hidden_size as u128, self.intermediate_size as u128);
        let (qd, kvd) = (self.n_head as u128 * self.head_dim as u128, self.n_kv_head as u128 * self.head_dim as u128);
        let bias = if self.attention_bias { qd + 2 * kvd } else { 0 };
        let qk_norm = if self.qk_norm { 2 * self.head_dim as u128 } else { 0 };
        let post_norms = if self.gemma.is_some() { 2 * c } else { 0 };
        let mlp = self.moe.as_ref().map_or(3 * c * f, |m| m.param_count(c));
        2 * c + 2 * c * qd + 2 * c * kvd + mlp + bias + qk_norm + post_norms
    }

    /// Width of all query heads together (hidden_size, unless the file sets
    /// `head_dim` otherwise, as Qwen3's do).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// Parameters of one decoder layer (without LoRA adapters).
    pub fn layer_params(&self) -> usize {
        self.layer_param_count() as usize
    }

    /// Tensors of one decoder layer (without LoRA adapters).
    pub fn tensors_per_layer(&self) -> u128 {
        let mlp = self.moe.as_ref().map_or(3, MoeBlock::tensor_count);
        6 + mlp
            + if self.attention_bias { 3 } else { 0 }
            + if self.qk_norm { 2 } else { 0 }
            + if self.gemma.is_some() { 2 } else { 0 }
    }

    /// The sliding window of layer `i` (`None`: it sees every earlier key).
    pub fn window_of(&self, i: usize) -> Option<usize> {
        let windowed = self.sliding_layers.as_ref().is_none_or(|l| l.get(i).copied().unwrap_or(false));
        self.sliding_window.filter(|_| windowed)
    }

    /// The rotary frequency scaling as the `nn` kernels take it.
    pub fn llama3_scaling(&self) -> Option<nn::rope::Llama3Scaling> {
        self.rope_scaling.map(|s| s.kernel())
    }

    /// Total parameters (a tied head counted once).
    pub fn n_params(&self) -> usize {
        self.param_count() as usize
    }

    /// Forward+backward FLOPs per token at sequence length `t`: 6N over the
    /// parameters that multiply (the embedding lookup does not, unless it is
    /// also the head) plus causal attention's 12·L·C·t (the PaLM estimate).
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let lookup = if self.tie_word_embeddings { 0 } else { self.vocab_size * self.hidden_size };
        6.0 * (self.n_params() - lookup) as f64 + 12.0 * (self.n_layer * self.q_dim() * t) as f64
    }

    /// Reads a Hugging Face `LlamaConfig` (`config.json`, as transformers 4
    /// or 5 writes it). Anything that changes the math and is not
    /// implemented (a RoPE type other than llama3, MLP biases, another
    /// activation) is an error
    /// naming the key, never silently ignored.
    pub fn from_hf_json(v: &Value) -> Result<Self, LlamaError> {
        if !v.is_object() {
            return Err(LlamaError::config("config.json", "must be a JSON object"));
        }
        let get = |key: &str| v.get(key).filter(|x| !x.is_null());
        if let Some(mt) = get("model_type") {
            if mt.as_str() != Some("llama") {
                return Err(LlamaError::unsupported(format!("model_type = {mt}"), "only \"llama\" is supported"));
            }
        }
        if let Some(act) = get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(LlamaError::unsupported(format!("hidden_act = {act}"), "Llama's MLP uses \"silu\""));
            }
        }
        for key in ["mlp_bias", "rope_interleaved"] {
            if let Some(b) = get(key) {
                if b.as_bool() != Some(false) {
                    return Err(LlamaError::unsupported(format!("{key} = {b}"), "only false is supported"));
                }
            }
        }
        // transformers' Llama with attention_bias has an o_proj bias too,
        // which this block has not (q/k/v biases come with a family whose
        // config.json means only those, e.g. Qwen2's, which sets them).
        if let Some(b) = get("attention_bias") {
            if b.as_bool() != Some(false) {
                return Err(LlamaError::unsupported(
                    format!("attention_bias = {b}"),
                    "Llama's attention_bias puts a bias on o_proj too, which is not implemented; only false is supported",
                ));
            }
        }
        let rope_params = get("rope_parameters");
        let rope_scaling = match (get("rope_scaling"), rope_params) {
            (Some(s), _) => RopeScaling::from_hf_json(s, "rope_scaling")?,
            (None, Some(p)) => RopeScaling::from_hf_json(p, "rope_parameters")?,
            (None, None) => None,
        };
        let uint = |key: &str| json_uint(v, key);
        let need = |key: &str| uint(key)?.ok_or_else(|| LlamaError::config(key, "is missing"));
        let token = |x: &Value, key: &str| -> Result<u32, LlamaError> {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| LlamaError::config(key, format!("must hold token ids, got {x}")))
        };
        let hidden_size = need("hidden_size")?;
        let n_head = need("num_attention_heads")?;
        // transformers' default; a file may set another width (q and o
        // then are [H·d, C] and [C, H·d] with H·d ≠ C).
        let head_dim = uint("head_dim")?.unwrap_or_else(|| hidden_size.checked_div(n_head).unwrap_or(0));
        let theta = rope_params.and_then(|p| p.get("rope_theta")).or_else(|| get("rope_theta"));
        let eos_token_id = match get("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(ids)) => ids.iter().map(|x| token(x, "eos_token_id")).collect::<Result<_, _>>()?,
            Some(x) => vec![token(x, "eos_token_id")?],
        };
        let cfg = LlamaConfig {
            vocab_size: need("vocab_size")?,
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            n_layer: need("num_hidden_layers")?,
            n_head,
            n_kv_head: uint("num_key_value_heads")?.unwrap_or(n_head),
            head_dim,
            rms_norm_eps: json_number(get("rms_norm_eps"), "rms_norm_eps", 1e-6)?,
            rope_theta: json_number(theta, "rope_theta", 10000.0)?,
            max_position_embeddings: uint("max_position_embeddings")?.unwrap_or(2048),
            tie_word_embeddings: match get("tie_word_embeddings") {
                None => false,
                Some(b) => b.as_bool().ok_or_else(|| {
                    LlamaError::config("tie_word_embeddings", format!("must be true or false, got {b}"))
                })?,
            },
            bos_token_id: get("bos_token_id").map(|x| token(x, "bos_token_id")).transpose()?,
            eos_token_id,
            attention_bias: false,
            rope_scaling,
            qk_norm: false,
            sliding_window: None,
            sliding_layers: None,
            gemma: None,
            fused_modules: false,
            moe: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// `config.json` for transformers' `LlamaForCausalLM` (f32 weights).
    /// RoPE θ is written both the transformers 4 way (`rope_theta`) and the
    /// transformers 5 way (`rope_parameters`), so either version reads it.
    pub fn to_hf_json(&self) -> Value {
        let eos = match self.eos_token_id.as_slice() {
            [] => Value::Null,
            [one] => Value::from(*one),
            many => Value::from(many.to_vec()),
        };
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_kv_head,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.map(|s| s.to_hf_json(self.rope_theta)),
            "rope_parameters": match self.rope_scaling {
                Some(s) => s.to_hf_json(self.rope_theta),
                None => serde_json::json!({ "rope_type": "default", "rope_theta": self.rope_theta }),
            },
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "mlp_bias": false,
            "pretraining_tp": 1,
            "initializer_range": 0.02,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "use_cache": true,
            "torch_dtype": "float32",
            "dtype": "float32",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_json_round_trips_and_reads_both_rope_spellings() {
        for name in PRESETS {
            let cfg = LlamaConfig::preset(name).unwrap();
            assert_eq!(LlamaConfig::from_hf_json(&cfg.to_hf_json()).unwrap(), cfg);
        }
        // A head width other than hidden_size / n_head (q_proj [H·d, C], o_proj [C, H·d]).
        let wide = LlamaConfig { head_dim: 32, ..LlamaConfig::preset("tiny").unwrap() };
        wide.validate().unwrap();
        assert_eq!(LlamaConfig::from_hf_json(&wide.to_hf_json()).unwrap(), wide);
        assert_eq!((wide.q_dim(), wide.hidden_size), (128, 64));
        // transformers 4 (SmolLM2's file): rope_theta at top level, rope_scaling null.
        let v4 = serde_json::json!({
            "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
            "rope_theta": 100000, "rope_scaling": null, "rope_interleaved": false, "max_position_embeddings": 8192,
            "tie_word_embeddings": true, "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu",
            "torch_dtype": "bfloat16", "is_llama_config": true
        });
        assert_eq!(LlamaConfig::from_hf_json(&v4).unwrap(), LlamaConfig::preset("smollm2-135m").unwrap());
        // transformers 5: rope_parameters; defaults for absent keys; eos as a list.
        let v5 = serde_json::json!({
            "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"},
            "eos_token_id": [2, 7]
        });
        let c = LlamaConfig::from_hf_json(&v5).unwrap();
        assert_eq!((c.rope_theta, c.n_kv_head, c.rms_norm_eps, c.tie_word_embeddings), (500.0, 4, 1e-6, false));
        assert_eq!((c.max_position_embeddings, c.eos_token_id.clone(), c.bos_token_id), (2048, vec![2, 7], None));
    }

    #[test]
    fn unsupported_and_invalid_configs_are_named() {
        let base = LlamaConfig::preset("tiny").unwrap().to_hf_json();
        let with = |key: &str, val: Value| {
            let mut v = base.clone();
            v[key] = val;
            LlamaConfig::from_hf_json(&v).unwrap_err().to_string()
        };
        let e = with("rope_scaling", serde_json::json!({"rope_type": "llama3", "factor": 8.0}));
        assert!(e.contains("rope_scaling.low_freq_factor") && e.contains("missing"), "{e}");
        let e = with("rope_scaling", serde_json::json!({"rope_type": "dynamic", "factor": 2.0}));
        assert!(e.contains("rope_scaling.rope_type = \"dynamic\""), "{e}");
        assert!(with("attention_bias", 1.into()).contains("attention_bias"));
        assert!(with("mlp_bias", true.into()).contains("mlp_bias"));
        assert!(with("hidden_act", "gelu".into()).contains("hidden_act"));
        assert!(with("model_type", "mistral".into()).contains("mistral"));
        assert!(with("num_key_value_heads", 3.into()).contains("n_kv_head"));
        assert!(with("head_dim", 7.into()).contains("head_dim") && with("head_dim", 7.into()).contains("even"));
        assert!(with("vocab_size", (-1).into()).contains("vocab_size"));
        assert!(with("rope_parameters", serde_json::json!({"rope_type": "yarn"})).contains("yarn"));
        let mut v = base.clone();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(LlamaConfig::from_hf_json(&v).unwrap_err().to_string().contains("`hidden_size` is missing"));
        assert!(LlamaConfig::preset("huge").unwrap_err().to_string().contains("smollm2-135m"));
    }

    /// Llama 3 RoPE scaling is read from and written to config.json (both
    /// transformers spellings); q/k/v biases count as parameters, but a
    /// Llama config.json with attention_bias (o_proj's bias too) is refused.
    #[test]
    fn attention_bias_and_llama3_rope_scaling_round_trip() {
        let scaling = RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain_scaled = LlamaConfig { rope_scaling: Some(scaling), ..LlamaConfig::preset("tiny").unwrap() };
        let json = plain_scaled.to_hf_json();
        assert_eq!(json["attention_bias"], false);
        assert_eq!(json["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(json["rope_parameters"]["original_max_position_embeddings"], 8192);
        assert_eq!(LlamaConfig::from_hf_json(&json).unwrap(), plain_scaled);
        // transformers 5 writes the scaling into rope_parameters only.
        let mut v5 = json.clone();
        v5.as_object_mut().unwrap().remove("rope_scaling");
        assert_eq!(LlamaConfig::from_hf_json(&v5).unwrap(), plain_scaled);
        // transformers 4's older spelling: "type" instead of "rope_type".
        let mut v4 = json.clone();
        v4["rope_scaling"] = serde_json::json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        assert_eq!(LlamaConfig::from_hf_json(&v4).unwrap(), plain_scaled);
        let mut biased = json.clone();
        biased["attention_bias"] = true.into();
        assert!(LlamaConfig::from_hf_json(&biased).unwrap_err().to_string().contains("o_proj"));
        let cfg = LlamaConfig { attention_bias: true, ..plain_scaled };
        // The biases count: q (C) + k, v (kv_dim each) per layer.
        let plain = LlamaConfig::preset("tiny").unwrap();
        assert_eq!(cfg.n_params() - plain.n_params(), plain.n_layer * (plain.q_dim() + 2 * plain.kv_dim()));
        assert_eq!(cfg.param_count(), cfg.n_params() as u128);
        let bad = RopeScaling { high_freq_factor: 1.0, ..scaling };
        let e = LlamaConfig { rope_scaling: Some(bad), ..cfg }.validate().unwrap_err().to_string();
        assert!(e.contains("high_freq_factor"), "{e}");
    }

    #[test]
    fn absurd_shapes_are_refused_from_the_count() {
        for name in PRESETS {
            let cfg = LlamaConfig::preset(name).unwrap();
            assert_eq!(cfg.param_count(), cfg.n_params() as u128, "{name}");
        }
        let base = LlamaConfig::preset("tiny").unwrap();
        let e = LlamaConfig { n_layer: 1_000_000_000, ..base.clone() }.validate().unwrap_err().to_string();
        assert!(e.contains("model.n_layer = 1000000000") && e.contains("at most 7281"), "{e}");
        let huge = LlamaConfig { hidden_size: 1 << 40, head_dim: 1 << 38, intermediate_size: 1 << 40, ..base };
        let e = huge.validate().unwrap_err().to_string();
        assert!(e.contains("parameters") && e.contains("2^48"), "{e}");
    }
}
