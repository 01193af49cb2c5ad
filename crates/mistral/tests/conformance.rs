//! Mistral runs the engine's Model conformance suite (engine::conformance):
//! the Llama block with a sliding window of 3 keys over sequences of 8
//! (so most queries see only part of their past), grouped-query attention,
//! untied head — finite differences, K/W/ZeRO invariance with an empty
//! micro-batch, several steps, frozen tensors and bit-exact resume — plain,
//! and with LoRA adapters on a frozen base.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::suite::{tiny_gqa, UnderTest, T};
use engine::conformance;
use llama::{Dialect, Llama, LlamaConfig, LoraConfig};

/// The suite's tiny GQA shape with Mistral's norm ε and RoPE θ and a
/// window of 3 keys (Mistral's tiny preset has one shorter than its context too).
pub fn cfg() -> LlamaConfig {
    let tiny = mistral::MISTRAL.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.sliding_window.is_some_and(|w| w < tiny.max_position_embeddings), "a window in the preset");
    const { assert!(3 < T, "the window is shorter than the suite's sequences") };
    LlamaConfig { sliding_window: Some(3), rms_norm_eps: tiny.rms_norm_eps, rope_theta: tiny.rope_theta, ..tiny_gqa() }
}

#[test]
fn mistral_passes_the_conformance_suite() {
    conformance::run_all(&UnderTest::new(cfg(), None)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn mistral_with_lora_on_a_frozen_base_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&UnderTest::new(cfg(), Some(lora))).unwrap_or_else(|e| panic!("{e}"));
}

/// The window is seen: the same weights without it give other logits at
/// the last of 8 positions (by O(1), against rounding of ~1e-6).
#[test]
fn the_window_changes_what_the_last_position_sees() {
    let ids: Vec<u32> = (0..T as u32).map(|i| i * 5 % 32).collect();
    let logits = |window: Option<usize>| {
        let mut m = Llama::new(LlamaConfig { sliding_window: window, ..cfg() }).unwrap_or_else(|e| panic!("{e}"));
        let p: Vec<f32> = m.init_params(3).into_iter().map(|x| x * 20.0).collect();
        m.next_token_logits(&p, &ids).unwrap_or_else(|e| panic!("{e}"))
    };
    let (a, b, c) = (logits(Some(3)), logits(None), logits(Some(T)));
    let gap = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(gap > 1e-2, "a window of 3 moves the last logits by only {gap}");
    assert_eq!(b, c, "a window as long as the sequence is no window, bit for bit");
}
