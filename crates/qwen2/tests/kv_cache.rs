//! Generation with a key/value cache on Qwen2's tiny preset (the Llama
//! block with q/k/v biases, grouped-query heads, θ = 10⁶) gives the greedy
//! tokens of generation without one, and each step's logits within
//! rounding: the biases are added to the new rows before their keys and
//! values are cached.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use engine::rng::SplitMix64;
use engine::Model;
use llama::{Dialect, Llama, LlamaConfig};

/// Logit differences relative to each step's largest logit, measured:
/// 1.1e-5 (f32 rounding grown by parameters scaled ×8); a real error (a
/// bias missing from a cached key) moves logits by whole percents.
const TOLERANCE: f32 = 1e-4;

#[test]
fn cached_generation_matches_on_qwen2_tiny() {
    let tiny = qwen2::QWEN2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.attention_bias, "Qwen2's block has q/k/v biases");
    // The preset with a context of 24, so that a 42-token run crosses it.
    let cfg = LlamaConfig { max_position_embeddings: 24, ..tiny };
    let model = Llama::new(cfg.clone()).unwrap();
    let mut params: Vec<f32> = model.init_params(5).into_iter().map(|x| x * 8.0).collect();
    // Biases start at zero: random ones, so the check sees them.
    let mut rng = SplitMix64::new(3);
    let mut biases = 0;
    for t in model.layout().tensors().iter().filter(|t| t.name.ends_with("_proj.bias")) {
        let n: usize = t.shape.iter().product();
        params[t.offset..t.offset + n].iter_mut().for_each(|x| *x = rng.normal() as f32);
        biases += 1;
    }
    assert_eq!(biases, 3 * cfg.n_layer, "q, k and v biases in each layer");
    common::cached_generation_matches(&cfg, &params, TOLERANCE);
}
