//! Gemma 2 (Gemma 2 2B, 9B, 27B and their fine-tunes): the Llama block —
//! RMSNorm, rotary embeddings, grouped-query attention, a gated MLP — with
//! Gemma's departures, each a switch of the `llama` crate
//! ([`llama::GemmaBlock`]): a GeGLU MLP (`gelu_pytorch_tanh` gate), norm
//! gains applied as `1 + w`, a norm on the attention's and on the MLP's
//! output before each joins the residual, the embedding times
//! `√hidden_size`, attention scores scaled by `query_pre_attn_scalar^-½`
//! and soft-capped (`c·tanh(s/c)`, in the tiled kernel and the key/value
//! cache: `nn::flash::Scores`), the logits soft-capped, a tied head, and a
//! sliding window on every other layer (transformers' `layer_types`:
//! layer 0 windowed). This crate declares the presets and the
//! `config.json` dialect (`model_type: "gemma2"`, `Gemma2ForCausalLM`) and
//! registers as [`FAMILY`]. GGUF export writes llama.cpp's `gemma2`
//! architecture (gains stored as `1 + w`, the post norms by its names, the
//! caps and window as its keys) where llama.cpp assumes what the model
//! has: scores scaled by `1/√head_dim`, windows on the even layers.

use family::Result;
use llama::dialect::{layer_types, object, read_as_llama, read_layer_types, read_window, written_as};
use llama::{Dialect, GemmaBlock, LlamaConfig, Names, Registered};
use serde_json::Value;

/// Gemma 2's `config.json` dialect and presets.
#[derive(Debug)]
pub struct Gemma2Dialect;

/// The dialect.
pub static GEMMA2: Gemma2Dialect = Gemma2Dialect;

/// Gemma 2's registration: `model.family = "gemma2"`, `model_type: "gemma2"`.
pub static FAMILY: Registered = Registered(&GEMMA2);

/// The presets: `tiny` for tests and the released shapes for planning.
pub const PRESETS: &[&str] = &["tiny", "gemma2-2b", "gemma2-9b", "gemma2-27b"];

/// Gemma2Config's keys that Llama's reader does not know.
const OWN: [&str; 10] = [
    "hidden_activation",
    "hidden_act",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
    "layer_types",
    "use_bidirectional_attention",
    "attention_dropout",
    "pad_token_id",
];

/// The activation Gemma 2's MLP gates with.
const ACT: &str = "gelu_pytorch_tanh";

impl Dialect for Gemma2Dialect {
    fn names(&self) -> Names {
        Names { family: "gemma2", name: "Gemma 2", presets: PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        // (hidden, intermediate, layers, heads, kv heads, head width,
        // query_pre_attn_scalar), from the released models' config.json
        // files (google/gemma-2-2b, -9b, -27b): vocabulary 256000, context
        // 8192, window 4096, caps 50 and 30, θ 1e4, tied head.
        let (hidden_size, intermediate_size, n_layer, n_head, n_kv_head, head_dim, scalar) = match name {
            "tiny" => (64, 176, 2, 4, 2, 16, 24.0),
            "gemma2-2b" => (2304, 9216, 26, 8, 4, 256, 256.0),
            "gemma2-9b" => (3584, 14336, 42, 16, 8, 256, 256.0),
            "gemma2-27b" => (4608, 36864, 46, 32, 16, 128, 144.0),
            other => {
                return Err(format!("`{other}` is not a gemma2 preset; choose one of {}", PRESETS.join(", ")).into())
            }
        };
        let tiny = name == "tiny";
        let (vocab_size, ctx, window) = if tiny { (256, 256, 32) } else { (256000, 8192, 4096) };
        let (bos, eos) = if tiny { (None, Vec::new()) } else { (Some(2), vec![1]) };
        let cfg = LlamaConfig {
            vocab_size,
            hidden_size,
            intermediate_size,
            n_layer,
            n_head,
            n_kv_head,
            head_dim,
            rms_norm_eps: 1e-6,
            rope_theta: 1e4,
            max_position_embeddings: ctx,
            tie_word_embeddings: true,
            bos_token_id: bos,
            eos_token_id: eos,
            sliding_window: Some(window),
            sliding_layers: Some(alternating(n_layer)),
            gemma: Some(GemmaBlock {
                query_pre_attn_scalar: scalar,
                attn_softcap: Some(50.0),
                final_softcap: Some(30.0),
            }),
            // The remaining options (no biases, no q/k norms, no RoPE scaling) as plain Llama's.
            ..LlamaConfig::preset("tiny")?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads transformers' `Gemma2Config`: the Llama keys (with `head_dim`)
    /// and Gemma's own; an activation other than `gelu_pytorch_tanh`,
    /// bidirectional attention and attention dropout are refused (a model
    /// that uses them would compute something else).
    fn parse_hf_json(&self, v: &Value) -> Result<LlamaConfig> {
        let o = object(v)?;
        for key in ["hidden_activation", "hidden_act"] {
            if let Some(a) = o.get(key).filter(|a| !a.is_null() && a.as_str() != Some(ACT)) {
                return Err(format!("{key} = {a}: Gemma 2's MLP gates with \"{ACT}\", the only one implemented").into());
            }
        }
        if let Some(b) = o.get("use_bidirectional_attention").filter(|b| !b.is_null() && b.as_bool() != Some(false)) {
            return Err(format!("use_bidirectional_attention = {b}: only causal attention is implemented").into());
        }
        if let Some(p) = o.get("attention_dropout").filter(|p| !p.is_null() && p.as_f64() != Some(0.0)) {
            return Err(format!("attention_dropout = {p}: dropout is not implemented; set it to 0.0").into());
        }
        let positive = |key: &str| -> Result<Option<f64>> {
            match o.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => match x.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
                    _ => Err(format!("{key} = {x}: must be a positive number or null").into()),
                },
            }
        };
        let what = "Gemma 2 config.json (read as the Llama block with Gemma's norms, caps and windows)";
        let mut llama = serde_json::Map::clone(o);
        // Gemma2Config's default is a tied head; Llama's reader defaults to untied.
        llama.entry("tie_word_embeddings").or_insert(Value::Bool(true));
        let base = read_as_llama(&Value::Object(llama), "gemma2", &OWN, what)?;
        let sliding_window = read_window(v)?;
        let sliding_layers = read_layer_types(v, base.n_layer)?.unwrap_or_else(|| alternating(base.n_layer));
        let cfg = LlamaConfig {
            sliding_window,
            sliding_layers: Some(sliding_layers),
            gemma: Some(GemmaBlock {
                // Gemma2Config's default: 256.
                query_pre_attn_scalar: positive("query_pre_attn_scalar")?.unwrap_or(256.0),
                attn_softcap: positive("attn_logit_softcapping")?,
                final_softcap: positive("final_logit_softcapping")?,
            }),
            ..base
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn gguf_arch(&self) -> Option<llama::export::GgufArch> {
        // llama.cpp's converter writes Gemma 2's Q and K rows as they are.
        Some(llama::export::GgufArch { name: "gemma2", permute_qk: false, sliding_window: true })
    }

    /// transformers' `Gemma2Config` for `Gemma2ForCausalLM`.
    fn hf_json(&self, cfg: &LlamaConfig) -> Value {
        let mut own = serde_json::Map::new();
        let g =
            cfg.gemma.unwrap_or(GemmaBlock { query_pre_attn_scalar: 256.0, attn_softcap: None, final_softcap: None });
        own.insert("hidden_activation".into(), Value::from(ACT));
        // transformers 5 validates it as an integer (every released one is).
        let scalar = g.query_pre_attn_scalar;
        let scalar =
            if scalar.fract() == 0.0 && scalar < 1e15 { Value::from(scalar as u64) } else { Value::from(scalar) };
        own.insert("query_pre_attn_scalar".into(), scalar);
        own.insert("attn_logit_softcapping".into(), g.attn_softcap.map_or(Value::Null, Value::from));
        own.insert("final_logit_softcapping".into(), g.final_softcap.map_or(Value::Null, Value::from));
        own.insert("sliding_window".into(), cfg.sliding_window.map_or(Value::Null, Value::from));
        own.insert("layer_types".into(), layer_types(cfg));
        own.insert("attention_dropout".into(), Value::from(0.0));
        // Gemma2Config's pad id is 0, in every vocabulary.
        own.insert("pad_token_id".into(), Value::from(0));
        written_as(cfg, ("Gemma2ForCausalLM", "gemma2"), &["hidden_act", "mlp_bias", "pretraining_tp"], own)
    }
}

/// transformers' default `layer_types` for `n` layers: windowed at even
/// indices (`bool((i + 1) % 2)`), full attention at odd ones.
fn alternating(n: usize) -> Vec<bool> {
    (0..n).map(|i| i % 2 == 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_released_parameter_counts() {
        // transformers 5.25, `Gemma2ForCausalLM(Gemma2Config(**shape))` on
        // the meta device, sum(p.numel()): 2,614,341,888 / 9,241,705,984 /
        // 27,227,128,320 (the tied embedding counted once).
        for (name, want) in
            [("gemma2-2b", 2_614_341_888u64), ("gemma2-9b", 9_241_705_984), ("gemma2-27b", 27_227_128_320)]
        {
            let cfg = GEMMA2.preset(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.n_params() as u64, want, "{name}");
        }
    }

    #[test]
    fn config_json_round_trips_and_refuses_what_it_cannot_run() {
        for name in PRESETS {
            let cfg = GEMMA2.preset(name).unwrap_or_else(|e| panic!("{e}"));
            let json = GEMMA2.hf_json(&cfg);
            assert_eq!(json["model_type"], "gemma2");
            assert_eq!(json["layer_types"][0], "sliding_attention", "{name}");
            assert_eq!(json["layer_types"][1], "full_attention", "{name}");
            assert_eq!(GEMMA2.parse_hf_json(&json).unwrap_or_else(|e| panic!("{e}")), cfg, "{name}");
        }
        let json = GEMMA2.hf_json(&GEMMA2.preset("tiny").unwrap_or_else(|e| panic!("{e}")));
        let refused = |key: &str, val: Value| {
            let mut j = json.clone();
            j[key] = val;
            GEMMA2.parse_hf_json(&j).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(refused("hidden_activation", Value::from("gelu")).contains("hidden_activation"));
        assert!(refused("use_bidirectional_attention", Value::Bool(true)).contains("bidirectional"));
        assert!(refused("attn_logit_softcapping", Value::from(-1.0)).contains("attn_logit_softcapping"));
        assert!(refused("layer_types", serde_json::json!(["full_attention"])).contains("layer_types"));
        assert!(refused("layer_types", serde_json::json!(["chunked", "full_attention"])).contains("chunked"));
        assert!(refused("model_type", Value::from("gemma")).contains("gemma"));
        // Without the keys transformers always writes: a tied head, alternating windows.
        let mut bare = json.clone();
        for key in ["tie_word_embeddings", "layer_types"] {
            bare.as_object_mut().map(|o| o.remove(key));
        }
        let cfg = GEMMA2.parse_hf_json(&bare).unwrap_or_else(|e| panic!("{e}"));
        assert!(cfg.tie_word_embeddings);
        assert_eq!(cfg.sliding_layers, Some(vec![true, false]));
    }
}
