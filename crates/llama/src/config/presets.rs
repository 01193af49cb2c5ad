//! The named shapes: `tiny` for tests, SmolLM2, and Llama 2 and 3.x for
//! planning, with their published parameter counts checked.

use super::{LlamaConfig, RopeScaling};
use crate::error::LlamaError;

/// Preset names, smallest first.
pub const PRESETS: &[&str] =
    &["tiny", "smollm2-135m", "llama3.2-1b", "llama3.2-3b", "llama-7b", "llama3.1-8b", "llama-13b", "llama-70b"];

impl LlamaConfig {
    /// A named preset: `tiny` (byte vocabulary, for tests and the bundled
    /// corpus) or `smollm2-135m` (HuggingFaceTB/SmolLM2-135M's shape).
    pub fn preset(name: &str) -> Result<Self, LlamaError> {
        let cfg = match name {
            "tiny" => LlamaConfig {
                vocab_size: 256,
                hidden_size: 64,
                intermediate_size: 176,
                n_layer: 2,
                n_head: 4,
                n_kv_head: 2,
                head_dim: 16,
                rms_norm_eps: 1e-5,
                rope_theta: 10000.0,
                max_position_embeddings: 256,
                tie_word_embeddings: true,
                bos_token_id: None,
                eos_token_id: Vec::new(),
                attention_bias: false,
                rope_scaling: None,
                qk_norm: false,
                sliding_window: None,
                sliding_layers: None,
                gemma: None,
                fused_modules: false,
                moe: None,
            },
            "smollm2-135m" => LlamaConfig {
                vocab_size: 49152,
                hidden_size: 576,
                intermediate_size: 1536,
                n_layer: 30,
                n_head: 9,
                n_kv_head: 3,
                head_dim: 64,
                rms_norm_eps: 1e-5,
                rope_theta: 100000.0,
                max_position_embeddings: 8192,
                tie_word_embeddings: true,
                bos_token_id: Some(0),
                eos_token_id: vec![0],
                attention_bias: false,
                rope_scaling: None,
                qk_norm: false,
                sliding_window: None,
                sliding_layers: None,
                gemma: None,
                fused_modules: false,
                moe: None,
            },
            // Llama 2's shapes, for planning (`macrobatch plan`): too large
            // to train here, never allocated by a plan.
            "llama-7b" => Self::llama2(4096, 11008, 32, 32, 32),
            "llama-13b" => Self::llama2(5120, 13824, 40, 40, 40),
            "llama-70b" => Self::llama2(8192, 28672, 80, 64, 8),
            // Llama 3.x (meta-llama/Llama-3.2-1B, -3B, Llama-3.1-8B): 128K
            // context by Llama 3 RoPE scaling (factor 32 for 3.2, 8 for 3.1).
            "llama3.2-1b" => Self::llama3((2048, 8192, 16, 32, 64), true, 32.0),
            "llama3.2-3b" => Self::llama3((3072, 8192, 28, 24, 128), true, 32.0),
            "llama3.1-8b" => Self::llama3((4096, 14336, 32, 32, 128), false, 8.0),
            other => {
                return Err(LlamaError::config(
                    "preset",
                    format!("`{other}` is not a preset; choose one of {}", PRESETS.join(", ")),
                ))
            }
        };
        Ok(cfg)
    }

    /// A Llama 3.x shape `(hidden, ffn, layers, heads, head width)`: 8 key/value
    /// heads, vocabulary 128256, θ = 5·10⁵ scaled by `factor` from 8192
    /// positions to 131072, `<|begin_of_text|>` and `<|end_of_text|>`.
    fn llama3(
        (hidden, ffn, n_layer, n_head, head_dim): (usize, usize, usize, usize, usize),
        tied: bool,
        factor: f64,
    ) -> Self {
        LlamaConfig {
            vocab_size: 128256,
            head_dim,
            n_kv_head: 8,
            rope_theta: 500000.0,
            max_position_embeddings: 131072,
            tie_word_embeddings: tied,
            bos_token_id: Some(128000),
            eos_token_id: vec![128001],
            rope_scaling: Some(RopeScaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            ..Self::llama2(hidden, ffn, n_layer, n_head, 8)
        }
    }

    /// A Llama 2 shape: vocabulary 32000, 4096 positions, untied head.
    fn llama2(hidden: usize, ffn: usize, n_layer: usize, n_head: usize, n_kv_head: usize) -> Self {
        LlamaConfig {
            vocab_size: 32000,
            hidden_size: hidden,
            intermediate_size: ffn,
            n_layer,
            n_head,
            n_kv_head,
            head_dim: hidden / n_head,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            bos_token_id: Some(1),
            eos_token_id: vec![2],
            attention_bias: false,
            rope_scaling: None,
            qk_norm: false,
            sliding_window: None,
            sliding_layers: None,
            gemma: None,
            fused_modules: false,
            moe: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_preset_has_its_published_parameter_count() {
        // HuggingFaceTB/SmolLM2-135M: sum(p.numel() for p in model.parameters()) = 134,515,008.
        let cfg = LlamaConfig::preset("smollm2-135m").unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.n_params(), 134_515_008);
        LlamaConfig::preset("tiny").unwrap().validate().unwrap();
        // Llama 2's published sizes (meta-llama/Llama-2-*-hf, numel of all parameters).
        for (name, n) in
            [("llama-7b", 6_738_415_616usize), ("llama-13b", 13_015_864_320), ("llama-70b", 68_976_648_192)]
        {
            let cfg = LlamaConfig::preset(name).unwrap();
            cfg.validate().unwrap();
            assert_eq!(cfg.n_params(), n, "{name}");
        }
        // Llama 3.x: transformers 5.25, `LlamaForCausalLM(LlamaConfig(**shape))` on the
        // meta device, sum(p.numel()) — the model cards' 1.24B, 3.21B, 8.03B.
        for (name, n) in
            [("llama3.2-1b", 1_235_814_400usize), ("llama3.2-3b", 3_212_749_824), ("llama3.1-8b", 8_030_261_248)]
        {
            let cfg = LlamaConfig::preset(name).unwrap();
            cfg.validate().unwrap();
            assert_eq!((cfg.n_params(), cfg.rope_scaling.is_some()), (n, true), "{name}");
        }
    }
}
