//! Qwen2 runs the engine's Model conformance suite (engine::conformance):
//! the Llama block with q/k/v biases, grouped-query attention, untied head
//! — finite differences (the biases' gradients included), K/W/ZeRO
//! invariance with an empty micro-batch, several steps, frozen tensors and
//! bit-exact resume — plain, and with LoRA adapters on a frozen base.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::suite::{tiny_gqa, UnderTest};
use engine::conformance::{self, ModelUnderTest};
use engine::Model;
use llama::{Dialect, LlamaConfig, LoraConfig};

/// Qwen2's tiny preset cut down to the suite's tiny GQA shape: 2 layers, 4
/// query heads sharing 2 key/value heads, head width 4, untied head, with
/// Qwen2's q/k/v biases.
fn cfg() -> LlamaConfig {
    let tiny = qwen2::QWEN2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.attention_bias, "Qwen2's block has q/k/v biases");
    LlamaConfig {
        attention_bias: tiny.attention_bias,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    }
}

#[test]
fn qwen2_passes_the_conformance_suite() {
    let f = UnderTest::new(cfg(), None);
    let model = f.model();
    let biases = model.layout().tensors().iter().filter(|t| t.name.ends_with("_proj.bias")).count();
    assert_eq!(biases, 3 * 2, "q, k and v biases in each of 2 layers");
    conformance::run_all(&f).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn qwen2_with_lora_on_a_frozen_base_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&UnderTest::new(cfg(), Some(lora))).unwrap_or_else(|e| panic!("{e}"));
}
