//! Model shapes and the named presets.

use crate::error::GptError;
use serde::{Deserialize, Serialize};

/// The shape of a GPT-2 model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Number of attention heads.
    pub n_head: usize,
    /// Embedding width C.
    pub n_embd: usize,
    /// Maximum sequence length (number of learned positions).
    pub block_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
}

/// Preset names, smallest first.
pub const PRESETS: &[&str] = &["tiny", "mini", "small", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"];

impl GptConfig {
    /// A named preset. `tiny` (the default run) is the 4-layer, d=256 model the
    /// peers were measured on; `gpt2*` are OpenAI's published shapes.
    pub fn preset(name: &str) -> Result<Self, GptError> {
        let (n_layer, n_head, n_embd, block_size, vocab_size) = match name {
            "tiny" => (4, 4, 256, 128, 256),
            "mini" => (6, 6, 384, 256, 256),
            "small" => (8, 8, 512, 512, 256),
            "gpt2" => (12, 12, 768, 1024, 50257),
            "gpt2-medium" => (24, 16, 1024, 1024, 50257),
            "gpt2-large" => (36, 20, 1280, 1024, 50257),
            "gpt2-xl" => (48, 25, 1600, 1024, 50257),
            other => {
                return Err(GptError::InvalidConfig(format!(
                    "unknown preset `{other}`; choose one of {}",
                    PRESETS.join(", ")
                )))
            }
        };
        Ok(Self { n_layer, n_head, n_embd, block_size, vocab_size })
    }

    /// Checks that every dimension is usable.
    pub fn validate(&self) -> Result<(), GptError> {
        let dims = [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ];
        for (name, v) in dims {
            if v == 0 {
                return Err(GptError::InvalidConfig(format!("model.{name} must be at least 1, got 0")));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(GptError::InvalidConfig(format!(
                "model.n_embd ({}) must be divisible by model.n_head ({})",
                self.n_embd, self.n_head
            )));
        }
        if self.vocab_size > i32::MAX as usize {
            return Err(GptError::InvalidConfig(format!("model.vocab_size ({}) is too large", self.vocab_size)));
        }
        // Counted, not laid out: a hostile shape is refused before any
        // buffer of its size exists. Layout: wte, wpe, ln_f (2) + 12 per block.
        engine::check_shape_size(self.param_count(), self.n_layer, 12, 4).map_err(GptError::InvalidConfig)
    }

    /// Total parameters in `u128` (no shape overflows it): what
    /// [`GptConfig::n_params`] returns for a validated shape.
    pub fn param_count(&self) -> u128 {
        let (v, t, c, l) =
            (self.vocab_size as u128, self.block_size as u128, self.n_embd as u128, self.n_layer as u128);
        (v + t) * c + l * (12 * c * c + 13 * c) + 2 * c
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Parameters of one transformer block: 12C² + 13C.
    pub fn block_params(&self) -> usize {
        12 * self.n_embd * self.n_embd + 13 * self.n_embd
    }

    /// Total parameters (tied head counted once).
    pub fn n_params(&self) -> usize {
        (self.vocab_size + self.block_size) * self.n_embd + self.n_layer * self.block_params() + 2 * self.n_embd
    }

    /// Forward+backward FLOPs per token at sequence length `t` (the 6N + attention
    /// estimate of the PaLM paper, with N excluding the position table).
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let n = (self.n_params() - self.block_size * self.n_embd) as f64;
        6.0 * n + 12.0 * (self.n_layer * self.n_embd * t) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_preset_has_124m_parameters() {
        // Hugging Face gpt2: 124,439,808 parameters.
        assert_eq!(GptConfig::preset("gpt2").unwrap().n_params(), 124_439_808);
    }

    #[test]
    fn bad_shapes_are_named() {
        let mut c = GptConfig::preset("tiny").unwrap();
        c.n_head = 3;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("n_embd (256)") && e.contains("n_head (3)"), "{e}");
        // Absurd sizes are refused from the count alone (no layout is built).
        let base = GptConfig::preset("tiny").unwrap();
        let e = GptConfig { n_layer: 1_000_000_000, ..base }.validate().unwrap_err().to_string();
        assert!(e.contains("model.n_layer = 1000000000") && e.contains("at most 5461"), "{e}");
        let e = GptConfig { n_embd: 1 << 40, n_head: 1, ..base }.validate().unwrap_err().to_string();
        assert!(e.contains("parameters") && e.contains("2^48"), "{e}");
        GptConfig { n_layer: 5461, ..base }.validate().unwrap();
        assert!(GptConfig::preset("huge").unwrap_err().to_string().contains("tiny"));
    }
}
