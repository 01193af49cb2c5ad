//! Qwen2 (Qwen2, Qwen2.5 and their fine-tunes): the Llama block — RMSNorm,
//! rotary embeddings, grouped-query attention, SwiGLU — with biases on the
//! q, k and v projections (none on o_proj or the MLP), θ = 10⁶, a tied head
//! for the small shapes and an untied one for 7B. transformers' `Qwen2Model`
//! is Llama's with those biases, and so is this crate: it declares the
//! block's options, the presets and the `config.json` dialect
//! (`model_type: "qwen2"`, `Qwen2ForCausalLM`), and registers as
//! [`FAMILY`]. The model, its files, LoRA adapters and the kernels are the
//! `llama` crate's and `nn`'s.

use family::Result;
use llama::dialect::{read_as_llama, written_as, QwenWindows};
use llama::{Dialect, LlamaConfig, Names, Registered};
use serde_json::Value;

/// Qwen2's `config.json` dialect and presets.
#[derive(Debug)]
pub struct Qwen2Dialect;

/// The dialect.
pub static QWEN2: Qwen2Dialect = Qwen2Dialect;

/// Qwen2's registration: `model.family = "qwen2"`, `model_type: "qwen2"`.
pub static FAMILY: Registered = Registered(&QWEN2);

/// The presets: `tiny` for tests and the released shapes for planning.
pub const PRESETS: &[&str] = &["tiny", "qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"];

/// The Llama block as Qwen2 uses it: q/k/v biases.
fn qwen2_block(cfg: LlamaConfig) -> LlamaConfig {
    LlamaConfig { attention_bias: true, ..cfg }
}

impl Dialect for Qwen2Dialect {
    fn names(&self) -> Names {
        Names { family: "qwen2", name: "Qwen2", presets: PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        // (vocab, hidden, intermediate, layers, heads, kv heads, context, tied, bos/eos),
        // from the released models' config.json files.
        let (vocab_size, hidden_size, intermediate_size, n_layer, n_head, n_kv_head, ctx, tied, special) = match name {
            "tiny" => (256, 64, 176, 2, 4, 2, 256, true, None),
            "qwen2-0.5b" => (151936, 896, 4864, 24, 14, 2, 32768, true, Some(151643)),
            "qwen2-1.5b" => (151936, 1536, 8960, 28, 12, 2, 32768, true, Some(151643)),
            "qwen2-7b" => (152064, 3584, 18944, 28, 28, 4, 131072, false, Some(151643)),
            other => {
                return Err(format!("`{other}` is not a qwen2 preset; choose one of {}", PRESETS.join(", ")).into())
            }
        };
        let cfg = qwen2_block(LlamaConfig {
            head_dim: hidden_size / n_head,
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
            bos_token_id: special,
            eos_token_id: special.into_iter().collect(),
            // The remaining options (RoPE scaling) as plain Llama's.
            ..LlamaConfig::preset("tiny")?
        });
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads transformers' `Qwen2Config`: the Llama keys, with the q/k/v
    /// biases implied and the windows of [`QwenWindows::read`].
    fn parse_hf_json(&self, v: &Value) -> Result<LlamaConfig> {
        let what = "Qwen2 config.json (read as the Llama block with q/k/v biases)";
        let base = qwen2_block(read_as_llama(v, "qwen2", &QwenWindows::KEYS, what)?);
        let (sliding_window, sliding_layers) = QwenWindows::read(v, base.n_layer)?;
        let cfg = LlamaConfig { sliding_window, sliding_layers, ..base };
        cfg.validate()?;
        Ok(cfg)
    }

    /// transformers' `Qwen2Config` for `Qwen2ForCausalLM`.
    fn hf_json(&self, cfg: &LlamaConfig) -> Value {
        let drop = ["attention_bias", "mlp_bias", "pretraining_tp", "head_dim"];
        written_as(cfg, ("Qwen2ForCausalLM", "qwen2"), &drop, QwenWindows::written(cfg))
    }

    fn gguf_arch(&self) -> Option<llama::export::GgufArch> {
        // llama.cpp's converter writes Qwen2's Q and K rows as they are.
        Some(llama::export::GgufArch::plain("qwen2", false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_released_parameter_counts() {
        // Qwen2's model cards: 0.49B, 1.54B, 7.62B parameters (biases included).
        for (name, want) in [("qwen2-0.5b", 494_032_768u64), ("qwen2-1.5b", 1_543_714_304), ("qwen2-7b", 7_615_616_512)]
        {
            let cfg = QWEN2.preset(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.n_params() as u64, want, "{name}");
        }
    }

    #[test]
    fn config_json_round_trips_with_and_without_windows() {
        let cfg = QWEN2.preset("qwen2-7b").unwrap_or_else(|e| panic!("{e}"));
        let json = QWEN2.hf_json(&cfg);
        assert_eq!(json["model_type"], "qwen2");
        assert_eq!(QWEN2.parse_hf_json(&json).unwrap_or_else(|e| panic!("{e}")), cfg);
        // Qwen2-7B's own file: a window that use_sliding_window leaves off.
        let mut off = json.clone();
        off["sliding_window"] = Value::from(131072);
        assert_eq!(QWEN2.parse_hf_json(&off).unwrap_or_else(|e| panic!("{e}")), cfg);
        let mut sliding = off;
        sliding["use_sliding_window"] = Value::Bool(true);
        sliding["layer_types"] = Value::from([vec!["full_attention"; 27], vec!["sliding_attention"]].concat());
        let windowed = QWEN2.parse_hf_json(&sliding).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((windowed.window_of(26), windowed.window_of(27)), (None, Some(131072)));
        assert_eq!(QWEN2.parse_hf_json(&QWEN2.hf_json(&windowed)).unwrap_or_else(|e| panic!("{e}")), windowed);
        sliding["use_sliding_window"] = Value::from(1);
        let e = QWEN2.parse_hf_json(&sliding).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("use_sliding_window"), "{e}");
        let mut llama = json;
        llama["model_type"] = Value::from("llama");
        assert!(QWEN2.parse_hf_json(&llama).is_err());
    }
}

mod moe;
pub use moe::{Qwen2MoeDialect, MOE_FAMILY, MOE_PRESETS, QWEN2_MOE};
