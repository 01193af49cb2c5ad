//! Phi-3 runs the engine's Model conformance suite (engine::conformance):
//! the Llama block with as many key/value heads as query heads (as
//! Phi-3-mini has) and a sliding window of 3 keys over sequences of 8,
//! untied head — finite differences, K/W/ZeRO invariance with an empty
//! micro-batch, several steps, frozen tensors and bit-exact resume. LoRA
//! is refused, with the reason (PEFT targets the fused modules).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::suite::{tiny_gqa, UnderTest, T};
use engine::conformance;
use llama::{Dialect, LlamaConfig, LlamaFamily, LoraConfig};

/// The suite's tiny shape with Phi-3's attention (4 query heads, 4
/// key/value heads), norm ε and RoPE θ, and a window of 3 keys (Phi-3's
/// tiny preset has one shorter than its context too).
pub fn cfg() -> LlamaConfig {
    let tiny = phi3::PHI3.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.sliding_window.is_some_and(|w| w < tiny.max_position_embeddings), "a window in the preset");
    assert_eq!(tiny.n_kv_head, tiny.n_head, "Phi-3-mini's attention: a key/value head per query head");
    const { assert!(3 < T, "the window is shorter than the suite's sequences") };
    let base = tiny_gqa();
    LlamaConfig {
        n_kv_head: base.n_head,
        sliding_window: Some(3),
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..base
    }
}

#[test]
fn phi3_passes_the_conformance_suite() {
    conformance::run_all(&UnderTest::new(cfg(), None)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn lora_on_the_fused_projections_is_refused_with_the_reason() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    let e = LlamaFamily::new(&phi3::PHI3, cfg(), Some(lora)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("self_attn.qkv_proj") && e.contains("not implemented"), "{e}");
    assert!(LlamaFamily::new(&phi3::PHI3, cfg(), None).is_ok());
}
