//! Gemma 2 runs the engine's Model conformance suite (engine::conformance):
//! the Llama block with Gemma's pieces — GeGLU, `1 + w` norms and post
//! norms, the √C embedding scale, a window of 3 keys over sequences of 8
//! on layer 0 and none on layer 1, scores scaled by 24^-½ and soft-capped
//! at 1, logits soft-capped at 1.5 (both tight enough to bite), tied head
//! — finite differences, K/W/ZeRO invariance with an empty micro-batch,
//! several steps, frozen tensors and bit-exact resume — plain, and with
//! LoRA adapters on a frozen base.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::suite::{tiny_gqa, UnderTest, T};
use engine::conformance;
use llama::{Dialect, GemmaBlock, Llama, LlamaConfig, LoraConfig};

/// The suite's tiny GQA shape with Gemma 2's pieces and tight caps.
pub fn cfg() -> LlamaConfig {
    let tiny = gemma2::GEMMA2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    const { assert!(3 < T, "the window is shorter than the suite's sequences") };
    let gemma = GemmaBlock { query_pre_attn_scalar: 24.0, attn_softcap: Some(1.0), final_softcap: Some(1.5) };
    LlamaConfig {
        sliding_window: Some(3),
        sliding_layers: tiny.sliding_layers.clone(),
        gemma: Some(gemma),
        tie_word_embeddings: true,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    }
}

#[test]
fn gemma2_passes_the_conformance_suite() {
    conformance::run_all(&UnderTest::new(cfg(), None)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn gemma2_with_lora_on_a_frozen_base_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&UnderTest::new(cfg(), Some(lora))).unwrap_or_else(|e| panic!("{e}"));
}

/// Each of Gemma's pieces is seen: turning one off (the window of layer 0,
/// a cap, the scale) moves the last position's logits by O(1e-2) or more,
/// against rounding of ~1e-6; and the capped logits stay inside the cap.
#[test]
fn each_piece_changes_the_logits() {
    let ids: Vec<u32> = (0..T as u32).map(|i| i * 5 % 32).collect();
    let logits = |cfg: LlamaConfig| {
        let mut m = Llama::new(cfg).unwrap_or_else(|e| panic!("{e}"));
        let p: Vec<f32> = m.init_params(3).into_iter().map(|x| x * 4.0).collect();
        m.next_token_logits(&p, &ids).unwrap_or_else(|e| panic!("{e}"))
    };
    let base = logits(cfg());
    assert!(base.iter().all(|x| x.abs() <= 1.5), "logits past the final cap");
    let g = cfg().gemma.unwrap_or_else(|| panic!("gemma"));
    let variants = [
        ("no window", LlamaConfig { sliding_window: None, ..cfg() }),
        ("window on layer 1 too", LlamaConfig { sliding_layers: None, ..cfg() }),
        ("no attention cap", LlamaConfig { gemma: Some(GemmaBlock { attn_softcap: None, ..g }), ..cfg() }),
        ("no final cap", LlamaConfig { gemma: Some(GemmaBlock { final_softcap: None, ..g }), ..cfg() }),
        ("scale 1", LlamaConfig { gemma: Some(GemmaBlock { query_pre_attn_scalar: 1.0, ..g }), ..cfg() }),
    ];
    for (what, c) in variants {
        let other = logits(c);
        let gap = base.iter().zip(&other).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        println!("{what}: {gap:.2e}");
        assert!(gap > 1e-2, "{what}: the last logits move by only {gap}");
    }
}
