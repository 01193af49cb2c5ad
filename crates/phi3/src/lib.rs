//! Phi-3 (Phi-3-mini, Phi-3-medium and their fine-tunes): the Llama block —
//! RMSNorm, rotary embeddings, attention, SwiGLU, an untied head — with a
//! sliding window (2047 keys in the 4k-context models) and, in its files,
//! the q, k and v weights stored as one `self_attn.qkv_proj` and gate and
//! up as one `mlp.gate_up_proj` (gate first: transformers' `chunk(2)`).
//! The layout keeps q|k|v and gate|up back to back already, so a fused
//! tensor is one range of the parameters ([`llama::layout::Fused`]): this
//! crate declares the block's options (`fused_modules`: the files' fused
//! names, [`llama::LlamaConfig::fused_weights`]), the presets and the
//! `config.json` dialect (`model_type: "phi3"`, `Phi3ForCausalLM`), and
//! registers as [`FAMILY`]. The model, its files and the kernels are
//! the `llama` crate's and `nn`'s.
//!
//! Left out, each refused with a message: the 128k-context models' LongRoPE
//! (`rope_scaling.type = "longrope"`), partial rotary embeddings
//! (`partial_rotary_factor` < 1, Phi-4-mini), dropout, and LoRA under
//! tensor parallelism. LoRA adapts the fused modules whole, as PEFT does
//! (`fused_modules`: one adapter over q|k|v, one over gate|up). GGUF is written as
//! llama.cpp's `phi3` architecture (`attn_qkv`, `ffn_up` holding gate|up,
//! `phi3.attention.sliding_window`); llama.cpp reads the window key but,
//! at the time of writing, attends to every earlier key for `phi3` (its
//! own converter's files for Phi-3-mini-4k are the same).

use family::Result;
use llama::dialect::{object, read_as_llama, read_window, written_as};
use llama::export::GgufArch;
use llama::{Dialect, LlamaConfig, Names, Registered};
use serde_json::Value;

/// Phi-3's `config.json` dialect and presets.
#[derive(Debug)]
pub struct Phi3Dialect;

/// The dialect.
pub static PHI3: Phi3Dialect = Phi3Dialect;

/// Phi-3's registration: `model.family = "phi3"`, `model_type: "phi3"`.
pub static FAMILY: Registered = Registered(&PHI3);

/// The presets: `tiny` for tests and the released 4k-context shapes for planning.
pub const PRESETS: &[&str] = &["tiny", "phi3-mini-4k", "phi3-medium-4k"];

/// Phi3Config's keys that Llama's reader does not know.
const OWN: [&str; 6] = [
    "sliding_window",
    "resid_pdrop",
    "embd_pdrop",
    "attention_dropout",
    "partial_rotary_factor",
    "original_max_position_embeddings",
];

impl Dialect for Phi3Dialect {
    fn names(&self) -> Names {
        Names { family: "phi3", name: "Phi-3", presets: PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        // (vocab, hidden, intermediate, layers, heads, kv heads, context, window),
        // from the released models' config.json files
        // (microsoft/Phi-3-mini-4k-instruct, microsoft/Phi-3-medium-4k-instruct).
        let (vocab_size, hidden_size, intermediate_size, n_layer, n_head, n_kv_head, ctx, window) = match name {
            "tiny" => (256, 64, 176, 2, 4, 4, 256, 32),
            "phi3-mini-4k" => (32064, 3072, 8192, 32, 32, 32, 4096, 2047),
            "phi3-medium-4k" => (32064, 5120, 17920, 40, 40, 10, 4096, 2047),
            other => return Err(format!("`{other}` is not a phi3 preset; choose one of {}", PRESETS.join(", ")).into()),
        };
        // <s>, and <|endoftext|> of the released (post-trained) models.
        let (bos, eos) = if name == "tiny" { (None, Vec::new()) } else { (Some(1), vec![32000]) };
        let cfg = LlamaConfig {
            head_dim: hidden_size / n_head,
            vocab_size,
            hidden_size,
            intermediate_size,
            n_layer,
            n_head,
            n_kv_head,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            max_position_embeddings: ctx,
            tie_word_embeddings: false,
            bos_token_id: bos,
            eos_token_id: eos,
            sliding_window: Some(window),
            fused_modules: true,
            // The remaining options (no biases, no RoPE scaling) as plain Llama's.
            ..LlamaConfig::preset("tiny")?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads transformers' `Phi3Config`: the Llama keys and the window;
    /// dropout, partial rotary embeddings and LongRoPE refused (a model
    /// that uses them would compute something else).
    fn parse_hf_json(&self, v: &Value) -> Result<LlamaConfig> {
        let o = object(v)?;
        for key in ["resid_pdrop", "embd_pdrop", "attention_dropout"] {
            if let Some(p) = o.get(key).filter(|p| p.as_f64() != Some(0.0) && !p.is_null()) {
                return Err(format!("{key} = {p}: dropout is not implemented; set it to 0.0").into());
            }
        }
        // transformers 5 writes the factor inside `rope_parameters`, earlier versions beside it.
        let in_rope = o.get("rope_parameters").and_then(|r| r.get("partial_rotary_factor"));
        let mut factor = o.get("partial_rotary_factor").into_iter().chain(in_rope);
        if let Some(f) = factor.find(|f| f.as_f64() != Some(1.0) && !f.is_null()) {
            return Err(format!(
                "partial_rotary_factor = {f}: rotary embeddings over part of each head are not implemented; only 1.0 is supported"
            )
            .into());
        }
        let sliding_window = read_window(v)?;
        let what = "Phi-3 config.json (read as the Llama block with fused weights and a sliding window)";
        Ok(LlamaConfig { sliding_window, fused_modules: true, ..read_as_llama(v, "phi3", &OWN, what)? })
    }

    /// transformers' `Phi3Config` for `Phi3ForCausalLM`.
    fn hf_json(&self, cfg: &LlamaConfig) -> Value {
        let mut own = serde_json::Map::new();
        own.insert("sliding_window".into(), cfg.sliding_window.map_or(Value::Null, Value::from));
        for key in ["resid_pdrop", "embd_pdrop", "attention_dropout"] {
            own.insert(key.into(), Value::from(0.0));
        }
        own.insert("original_max_position_embeddings".into(), Value::from(cfg.max_position_embeddings));
        // Phi3Config's default pad id is 32000 (Phi-3's <|endoftext|>); a
        // narrower vocabulary cannot hold it, and transformers refuses to
        // build an embedding whose padding row is outside it.
        const PAD: usize = 32000;
        own.insert("pad_token_id".into(), if cfg.vocab_size > PAD { Value::from(PAD) } else { Value::Null });
        written_as(cfg, ("Phi3ForCausalLM", "phi3"), &["attention_bias", "mlp_bias", "pretraining_tp"], own)
    }

    fn gguf_arch(&self) -> Option<GgufArch> {
        // llama.cpp's converter writes Phi-3's rows as they are (its RoPE
        // for phi3 rotates halves, as Hugging Face's does), fused.
        Some(GgufArch { name: "phi3", permute_qk: false, sliding_window: true })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_released_parameter_counts() {
        // transformers 5.25, `Phi3ForCausalLM(Phi3Config(**shape))` on the
        // meta device, sum(p.numel()): 3,821,079,552 / 13,960,238,080 — the
        // model cards' 3.8B and 14B.
        for (name, want) in [("phi3-mini-4k", 3_821_079_552u64), ("phi3-medium-4k", 13_960_238_080)] {
            let cfg = PHI3.preset(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.n_params() as u64, want, "{name}");
            assert_eq!(cfg.param_count(), want as u128, "{name}");
        }
    }

    #[test]
    fn config_json_round_trips_and_refuses_what_is_not_implemented() {
        for name in PRESETS {
            let cfg = PHI3.preset(name).unwrap_or_else(|e| panic!("{e}"));
            let json = PHI3.hf_json(&cfg);
            let window = if *name == "tiny" { 32 } else { 2047 };
            assert_eq!((json["model_type"].as_str(), json["sliding_window"].as_u64()), (Some("phi3"), Some(window)));
            assert_eq!(PHI3.parse_hf_json(&json).unwrap_or_else(|e| panic!("{e}")), cfg, "{name}");
        }
        let json = PHI3.hf_json(&PHI3.preset("phi3-mini-4k").unwrap_or_else(|e| panic!("{e}")));
        let refused = |key: &str, val: Value| {
            let mut j = json.clone();
            j[key] = val;
            PHI3.parse_hf_json(&j).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(refused("resid_pdrop", Value::from(0.1)).contains("resid_pdrop"));
        assert!(refused("partial_rotary_factor", Value::from(0.75)).contains("partial_rotary_factor"));
        let rope = serde_json::json!({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75});
        assert!(refused("rope_parameters", rope).contains("partial_rotary_factor"));
        let longrope = serde_json::json!({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]});
        assert!(refused("rope_scaling", longrope).contains("longrope"));
        assert!(refused("sliding_window", Value::from(0)).contains("sliding_window"));
        assert!(refused("model_type", Value::from("phi")).contains("phi"));
        let mut no_window = json.clone();
        no_window["sliding_window"] = Value::Null;
        assert_eq!(PHI3.parse_hf_json(&no_window).map(|c| c.sliding_window).ok(), Some(None));
    }
}
