//! Generation with a key/value cache on Phi-3's tiny preset, its window
//! cut to 7 keys so that runs of up to 42 tokens cross it many times,
//! gives the greedy tokens of generation without one, and each step's
//! logits within rounding.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use llama::{Dialect, Llama, LlamaConfig};

/// Logit differences relative to each step's largest logit: f32 rounding
/// grown by parameters scaled ×8, as Qwen2's check (1.1e-5 measured there);
/// a cache that sees one key past the window moves logits by whole percents.
const TOLERANCE: f32 = 1e-4;

#[test]
fn cached_generation_matches_on_phi3_tiny_across_its_window() {
    let tiny = phi3::PHI3.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    let cfg = LlamaConfig { max_position_embeddings: 48, sliding_window: Some(7), ..tiny };
    let model = Llama::new(cfg.clone()).unwrap();
    let params: Vec<f32> = model.init_params(5).into_iter().map(|x| x * 8.0).collect();
    common::cached_generation_matches(&cfg, &params, TOLERANCE);
}
