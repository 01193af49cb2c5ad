//! Generation with a key/value cache on Qwen3's tiny preset (per-head q/k
//! norms, heads wider than C / H, grouped-query heads, θ = 10⁶) gives the
//! greedy tokens of generation without one, and each step's logits within
//! rounding: the new rows' keys are normalised before they are cached.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use engine::rng::SplitMix64;
use engine::Model;
use llama::{Dialect, Llama, LlamaConfig};

/// Logit differences relative to each step's largest logit: f32 rounding
/// grown by parameters scaled ×8, as Qwen2's check (1.1e-5 measured there);
/// a real error (a key cached before its norm) moves logits by whole percents.
const TOLERANCE: f32 = 1e-4;

#[test]
fn cached_generation_matches_on_qwen3_tiny() {
    let tiny = qwen3::QWEN3.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.qk_norm, "Qwen3's block has per-head q/k norms");
    // The preset with a context of 24, so that a 42-token run crosses it.
    let cfg = LlamaConfig { max_position_embeddings: 24, ..tiny };
    let model = Llama::new(cfg.clone()).unwrap();
    let mut params: Vec<f32> = model.init_params(5).into_iter().map(|x| x * 8.0).collect();
    // The gains start at one: random ones, so the check sees them.
    let mut rng = SplitMix64::new(3);
    let mut gains = 0;
    for t in model
        .layout()
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with("q_norm.weight") || t.name.ends_with("k_norm.weight"))
    {
        let n: usize = t.shape.iter().product();
        params[t.offset..t.offset + n].iter_mut().for_each(|x| *x = 1.0 + 0.5 * rng.normal() as f32);
        gains += 1;
    }
    assert_eq!(gains, 2 * cfg.n_layer, "q and k norms in each layer");
    common::cached_generation_matches(&cfg, &params, TOLERANCE);
}
