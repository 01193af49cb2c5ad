//! Mistral (Mistral 7B v0.1–v0.3, Mistral NeMo and their fine-tunes): the
//! Llama block — RMSNorm, rotary embeddings, grouped-query attention,
//! SwiGLU, untied head — with sliding-window attention where the file sets
//! `sliding_window` (each query sees its `w` latest keys: 4096 in v0.1;
//! none from v0.2 on) and a head width the file may set apart from
//! hidden / heads (NeMo: 128 where 5120 / 32 = 160). transformers'
//! `MistralModel` is Llama's with that window, and so is this crate: it
//! declares the block's options, the presets and the `config.json`
//! dialect (`model_type: "mistral"`, `MistralForCausalLM`), and registers
//! as [`FAMILY`]. The model, its files, LoRA adapters and the kernels (the
//! window is `nn::flash::Visible::window` in the tiled kernel, whose key
//! tiles left of a window are skipped, and in the key/value cache) are the
//! `llama` crate's and `nn`'s.

use family::Result;
use llama::dialect::{read_as_llama, read_window, written_as};
use llama::{Dialect, LlamaConfig, Names, Registered};
use serde_json::Value;

/// Mistral's `config.json` dialect and presets.
#[derive(Debug)]
pub struct MistralDialect;

/// The dialect.
pub static MISTRAL: MistralDialect = MistralDialect;

/// Mistral's registration: `model.family = "mistral"`, `model_type: "mistral"`.
pub static FAMILY: Registered = Registered(&MISTRAL);

/// The presets: `tiny` for tests and the released shapes for planning.
pub const PRESETS: &[&str] = &["tiny", "mistral-7b-v0.1", "mistral-7b-v0.3", "mistral-nemo-12b"];

impl Dialect for MistralDialect {
    fn names(&self) -> Names {
        Names { family: "mistral", name: "Mistral", presets: PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        // (vocab, hidden, intermediate, layers, heads, kv heads, head width,
        // context, θ, window), from the released models' config.json files
        // (mistralai/Mistral-7B-v0.1, -v0.3, Mistral-Nemo-Base-2407). `tiny`
        // has a window shorter than its context, as v0.1 has.
        let (vocab_size, hidden_size, intermediate_size, n_layer, n_head, n_kv_head, head_dim, ctx, theta, window) =
            match name {
                "tiny" => (256, 64, 176, 2, 4, 2, 16, 256, 1e4, Some(32)),
                "mistral-7b-v0.1" => (32000, 4096, 14336, 32, 32, 8, 128, 32768, 1e4, Some(4096)),
                "mistral-7b-v0.3" => (32768, 4096, 14336, 32, 32, 8, 128, 32768, 1e6, None),
                "mistral-nemo-12b" => (131072, 5120, 14336, 40, 32, 8, 128, 1024000, 1e6, None),
                other => {
                    return Err(
                        format!("`{other}` is not a mistral preset; choose one of {}", PRESETS.join(", ")).into()
                    )
                }
            };
        let (bos, eos) = if name == "tiny" { (None, Vec::new()) } else { (Some(1), vec![2]) };
        let cfg = LlamaConfig {
            head_dim,
            vocab_size,
            hidden_size,
            intermediate_size,
            n_layer,
            n_head,
            n_kv_head,
            rms_norm_eps: 1e-5,
            rope_theta: theta,
            max_position_embeddings: ctx,
            tie_word_embeddings: false,
            bos_token_id: bos,
            eos_token_id: eos,
            sliding_window: window,
            // The remaining options (no biases, no q/k norms, no RoPE scaling) as plain Llama's.
            ..LlamaConfig::preset("tiny")?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads transformers' `MistralConfig`: the Llama keys (with
    /// `head_dim`) and `sliding_window` (null: none).
    fn parse_hf_json(&self, v: &Value) -> Result<LlamaConfig> {
        let sliding_window = read_window(v)?;
        let what = "Mistral config.json (read as the Llama block with a sliding window)";
        Ok(LlamaConfig { sliding_window, ..read_as_llama(v, "mistral", &["sliding_window"], what)? })
    }

    /// transformers' `MistralConfig` for `MistralForCausalLM`.
    fn hf_json(&self, cfg: &LlamaConfig) -> Value {
        let mut own = serde_json::Map::new();
        own.insert("sliding_window".into(), cfg.sliding_window.map_or(Value::Null, Value::from));
        written_as(cfg, ("MistralForCausalLM", "mistral"), &["attention_bias", "mlp_bias", "pretraining_tp"], own)
    }

    fn gguf_arch(&self) -> Option<llama::export::GgufArch> {
        // llama.cpp's converter writes Mistral as `llama`, Q and K rows
        // permuted; a window shorter than the context is refused there.
        Some(llama::export::GgufArch::plain("llama", true))
    }

    fn gguf_architecture(&self) -> Option<&'static str> {
        // A `llama` file is Llama's to load (its window is not in the file).
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_released_parameter_counts() {
        // transformers 5.25, `MistralForCausalLM(MistralConfig(**shape))` on
        // the meta device, sum(p.numel()): 7,241,732,096 (v0.1: 7.24B),
        // 7,248,023,552 (v0.3, its vocabulary of 32768), 12,247,782,400 (NeMo: 12.2B).
        for (name, want) in [
            ("mistral-7b-v0.1", 7_241_732_096u64),
            ("mistral-7b-v0.3", 7_248_023_552),
            ("mistral-nemo-12b", 12_247_782_400),
        ] {
            let cfg = MISTRAL.preset(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.n_params() as u64, want, "{name}");
            assert_eq!(cfg.param_count(), want as u128, "{name}");
        }
    }

    #[test]
    fn config_json_round_trips_with_and_without_a_window() {
        for name in PRESETS {
            let cfg = MISTRAL.preset(name).unwrap_or_else(|e| panic!("{e}"));
            let json = MISTRAL.hf_json(&cfg);
            assert_eq!(json["model_type"], "mistral");
            assert_eq!(json["sliding_window"].as_u64().map(|w| w as usize), cfg.sliding_window, "{name}");
            assert_eq!(MISTRAL.parse_hf_json(&json).unwrap_or_else(|e| panic!("{e}")), cfg, "{name}");
        }
        let json = MISTRAL.hf_json(&MISTRAL.preset("mistral-7b-v0.1").unwrap_or_else(|e| panic!("{e}")));
        let refused = |key: &str, val: Value| {
            let mut j = json.clone();
            j[key] = val;
            MISTRAL.parse_hf_json(&j).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(refused("sliding_window", Value::from(0)).contains("sliding_window"));
        assert!(refused("sliding_window", Value::from(-4)).contains("sliding_window"));
        assert!(refused("model_type", Value::from("llama")).contains("llama"));
    }
}
