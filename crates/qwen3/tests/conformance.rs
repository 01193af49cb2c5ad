//! Qwen3 runs the engine's Model conformance suite (engine::conformance):
//! the Llama block with per-head q/k RMSNorm and heads wider than
//! hidden / heads (H·d = 2C), grouped-query attention, untied head —
//! finite differences (the norms' gains included), K/W/ZeRO invariance
//! with an empty micro-batch, several steps, frozen tensors and bit-exact
//! resume — plain, and with LoRA adapters on a frozen base.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::suite::{tiny_gqa, UnderTest};
use engine::conformance::{self, ModelUnderTest};
use engine::Model;
use llama::{Dialect, LlamaConfig, LoraConfig};

/// The suite's tiny GQA shape (2 layers, 4 query heads sharing 2
/// key/value heads, C = 16, untied head) with Qwen3's q/k norms, norm ε and
/// RoPE θ, and heads of width 8 (H·d = 32 = 2C), as Qwen3's released
/// shapes have them wider than C / H.
pub fn cfg() -> LlamaConfig {
    let tiny = qwen3::QWEN3.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.qk_norm && tiny.q_dim() > tiny.hidden_size, "Qwen3's block: q/k norms, wide heads");
    LlamaConfig {
        qk_norm: tiny.qk_norm,
        head_dim: 8,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    }
}

#[test]
fn qwen3_passes_the_conformance_suite() {
    let f = UnderTest::new(cfg(), None);
    let model = f.model();
    let gains = model
        .layout()
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with("_norm.weight") && t.name.contains("self_attn"))
        .count();
    assert_eq!(gains, 2 * 2, "q and k norms in each of 2 layers");
    conformance::run_all(&f).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn qwen3_with_lora_on_a_frozen_base_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&UnderTest::new(cfg(), Some(lora))).unwrap_or_else(|e| panic!("{e}"));
}
