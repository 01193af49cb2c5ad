//! Qwen3 (Qwen3 0.6B–32B dense and their fine-tunes): the Llama block —
//! RMSNorm, rotary embeddings, grouped-query attention, SwiGLU — with an
//! RMSNorm over each query and each key head (`self_attn.q_norm` /
//! `k_norm`, gains of the head's width shared by the heads) between the
//! projections and the rotation, no biases, a head width set by the file
//! (128, so H·d ≠ C for the small shapes), θ = 10⁶, a tied head up to 4B.
//! transformers' `Qwen3Model` is Llama's with those norms, and so is this
//! crate: it declares the block's options, the presets and the
//! `config.json` dialect (`model_type: "qwen3"`, `Qwen3ForCausalLM`), and
//! registers as [`FAMILY`]. The model, its files, LoRA adapters and the
//! kernels (the head norm is `nn::norm::HeadNorm`) are the `llama` crate's
//! and `nn`'s.

use family::Result;
use llama::dialect::{read_as_llama, written_as, QwenWindows};
use llama::{Dialect, LlamaConfig, Names, Registered};
use serde_json::Value;

/// Qwen3's `config.json` dialect and presets.
#[derive(Debug)]
pub struct Qwen3Dialect;

/// The dialect.
pub static QWEN3: Qwen3Dialect = Qwen3Dialect;

/// Qwen3's registration: `model.family = "qwen3"`, `model_type: "qwen3"`.
pub static FAMILY: Registered = Registered(&QWEN3);

/// The presets: `tiny` for tests and the released dense shapes for planning.
pub const PRESETS: &[&str] = &["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"];

/// The Llama block as Qwen3 uses it: per-head q/k norms.
fn qwen3_block(cfg: LlamaConfig) -> LlamaConfig {
    LlamaConfig { qk_norm: true, ..cfg }
}

impl Dialect for Qwen3Dialect {
    fn names(&self) -> Names {
        Names { family: "qwen3", name: "Qwen3", presets: PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        // (vocab, hidden, intermediate, layers, heads, kv heads, head width, context, tied),
        // from the released models' config.json files (Qwen/Qwen3-*). `tiny`'s
        // heads are wider than hidden / heads, as the released shapes' are.
        let (vocab_size, hidden_size, intermediate_size, n_layer, n_head, n_kv_head, head_dim, ctx, tied) = match name {
            "tiny" => (256, 64, 176, 2, 4, 2, 32, 256, true),
            "qwen3-0.6b" => (151936, 1024, 3072, 28, 16, 8, 128, 40960, true),
            "qwen3-1.7b" => (151936, 2048, 6144, 28, 16, 8, 128, 40960, true),
            "qwen3-4b" => (151936, 2560, 9728, 36, 32, 8, 128, 40960, true),
            "qwen3-8b" => (151936, 4096, 12288, 36, 32, 8, 128, 40960, false),
            other => {
                return Err(format!("`{other}` is not a qwen3 preset; choose one of {}", PRESETS.join(", ")).into())
            }
        };
        // <|endoftext|> and <|im_end|> of the released (post-trained) models.
        let (bos, eos) = if name == "tiny" { (None, Vec::new()) } else { (Some(151643), vec![151645]) };
        let cfg = qwen3_block(LlamaConfig {
            head_dim,
            vocab_size,
            hidden_size,
            intermediate_size,
            n_layer,
            n_head,
            n_kv_head,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            max_position_embeddings: ctx,
            tie_word_embeddings: tied,
            bos_token_id: bos,
            eos_token_id: eos,
            // The remaining options (no biases, no RoPE scaling) as plain Llama's.
            ..LlamaConfig::preset("tiny")?
        });
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads transformers' `Qwen3Config`: the Llama keys (with `head_dim`),
    /// the q/k norms implied, the windows of [`QwenWindows::read`];
    /// `attention_bias` (which in Qwen3 also puts a bias on o_proj) refused
    /// — not implemented: a model that uses it would compute something else.
    fn parse_hf_json(&self, v: &Value) -> Result<LlamaConfig> {
        let what = "Qwen3 config.json (read as the Llama block with per-head q/k norms)";
        let base = qwen3_block(read_as_llama(v, "qwen3", &QwenWindows::KEYS, what)?);
        let (sliding_window, sliding_layers) = QwenWindows::read(v, base.n_layer)?;
        let cfg = LlamaConfig { sliding_window, sliding_layers, ..base };
        cfg.validate()?;
        Ok(cfg)
    }

    /// transformers' `Qwen3Config` for `Qwen3ForCausalLM`.
    fn hf_json(&self, cfg: &LlamaConfig) -> Value {
        written_as(cfg, ("Qwen3ForCausalLM", "qwen3"), &["mlp_bias", "pretraining_tp"], QwenWindows::written(cfg))
    }

    fn gguf_arch(&self) -> Option<llama::export::GgufArch> {
        // llama.cpp's converter writes Qwen3's Q and K rows as they are
        // (its RoPE for qwen3 rotates halves, as Hugging Face's does).
        Some(llama::export::GgufArch::plain("qwen3", false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_released_parameter_counts() {
        // transformers 5.25, `Qwen3ForCausalLM(Qwen3Config(vocab_size=151936,
        // head_dim=128, **shape))` on the meta device, sum(p.numel()):
        // 596,049,920 / 1,720,574,976 / 4,022,468,096 / 8,190,735,360 — the
        // model cards' 0.6B (0.44B non-embedding), 1.7B (1.4B), 4.0B (3.6B), 8.2B (6.95B).
        for (name, want) in [
            ("qwen3-0.6b", 596_049_920u64),
            ("qwen3-1.7b", 1_720_574_976),
            ("qwen3-4b", 4_022_468_096),
            ("qwen3-8b", 8_190_735_360),
        ] {
            let cfg = QWEN3.preset(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.n_params() as u64, want, "{name}");
            assert_eq!(cfg.param_count(), want as u128, "{name}");
        }
    }

    #[test]
    fn config_json_round_trips_and_refuses_what_is_not_implemented() {
        for name in PRESETS {
            let cfg = QWEN3.preset(name).unwrap_or_else(|e| panic!("{e}"));
            let json = QWEN3.hf_json(&cfg);
            assert_eq!(
                (json["model_type"].as_str(), json["head_dim"].as_u64()),
                (Some("qwen3"), Some(cfg.head_dim as u64))
            );
            assert_eq!(QWEN3.parse_hf_json(&json).unwrap_or_else(|e| panic!("{e}")), cfg, "{name}");
        }
        let json = QWEN3.hf_json(&QWEN3.preset("qwen3-0.6b").unwrap_or_else(|e| panic!("{e}")));
        let refused = |key: &str, val: Value| {
            let mut j = json.clone();
            j[key] = val;
            QWEN3.parse_hf_json(&j).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(refused("use_sliding_window", Value::from("yes")).contains("use_sliding_window"));
        assert!(refused("layer_types", serde_json::json!(["sliding_attention"])).contains("layer_types"));
        // Windows on the layers from max_window_layers on, read and written back.
        let mut windows = json.clone();
        windows["use_sliding_window"] = Value::Bool(true);
        windows["sliding_window"] = Value::from(4096);
        windows["max_window_layers"] = Value::from(20);
        windows.as_object_mut().map(|o| o.remove("layer_types"));
        let cfg = QWEN3.parse_hf_json(&windows).unwrap_or_else(|e| panic!("{e}"));
        let on: Vec<usize> = (0..cfg.n_layer).filter(|&i| cfg.window_of(i) == Some(4096)).collect();
        assert_eq!(on, (20..28).collect::<Vec<_>>());
        let back = QWEN3.hf_json(&cfg);
        assert_eq!(
            (back["max_window_layers"].as_u64(), back["layer_types"][20].as_str()),
            (Some(20), Some("sliding_attention"))
        );
        assert_eq!(QWEN3.parse_hf_json(&back).unwrap_or_else(|e| panic!("{e}")), cfg);
        assert!(refused("attention_bias", Value::Bool(true)).contains("attention_bias"));
        assert!(refused("model_type", Value::from("qwen2")).contains("qwen2"));
    }
}

mod moe;
pub use moe::{Qwen3MoeDialect, MOE_FAMILY, MOE_PRESETS, QWEN3_MOE};
