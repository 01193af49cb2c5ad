//! Generation with a key/value cache on Gemma 2's tiny preset, its window
//! cut to 7 keys on layer 0 (layer 1 sees every key) and its caps tight
//! (attention 2, logits 10), so that runs of up to 42 tokens cross the
//! window many times, its head untied (with the tied head this random
//! model repeats 4 tokens: the check would see little): the greedy tokens
//! of generation without a cache,
//! and each step's logits within rounding — the cache windows and caps
//! each layer as the tiled kernel does.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use llama::{Dialect, GemmaBlock, Llama, LlamaConfig};

/// Mistral's bound (f32 rounding grown by parameters scaled ×8); a cache
/// that sees one key past the window, or skips a cap, moves logits by
/// whole percents.
const TOLERANCE: f32 = 1e-4;

#[test]
fn cached_generation_matches_on_gemma2_tiny_across_its_window() {
    let tiny = gemma2::GEMMA2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    let gemma = GemmaBlock {
        attn_softcap: Some(2.0),
        final_softcap: Some(10.0),
        ..tiny.gemma.unwrap_or_else(|| panic!("gemma"))
    };
    let cfg = LlamaConfig {
        max_position_embeddings: 48,
        sliding_window: Some(7),
        gemma: Some(gemma),
        tie_word_embeddings: false,
        ..tiny
    };
    let model = Llama::new(cfg.clone()).unwrap();
    let params: Vec<f32> = model.init_params(5).into_iter().map(|x| x * 8.0).collect();
    common::cached_generation_matches(&cfg, &params, TOLERANCE);
}
