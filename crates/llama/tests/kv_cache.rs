//! Generation with a key/value cache gives the greedy tokens of
//! generation without one, and each step's logits within rounding, for
//! Llama-block models: grouped-query and multi-query heads, Llama 3's
//! rotary scaling, tied and untied heads, and the real SmolLM2. The cached
//! pass runs the same layer code on the new row only, rotated by its own
//! position, with its attention over the cache (the GEMMs see one row
//! instead of the whole window, so they may block their sums differently
//! in the last bits).

use engine::rng::SplitMix64;
use family::generation::check_kv_cache;
use family::{Erased, LanguageModel};
use llama::{hf, Llama, LlamaConfig, RopeScaling};

/// Logit differences relative to each step's largest logit, measured:
/// 1.2e-5 on the tiny models (f32 rounding, ~6e-8 per operation, grown by
/// parameters scaled ×8 through three layers), 2.8e-6 on SmolLM2. A real
/// error (a row rotated by the wrong position, a key missing from the
/// cache) moves logits by whole percents; the bound leaves 4× room for
/// another CPU's GEMM blocking.
const TOLERANCE: f32 = 5e-5;

/// 3 layers, 4 query heads sharing 2 key/value heads, head width 8, an
/// untied head and a context (24) that a 40-token run crosses.
fn tiny_gqa() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 48,
        n_layer: 3,
        n_head: 4,
        n_kv_head: 2,
        head_dim: 8,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position_embeddings: 24,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_id: Vec::new(),
        attention_bias: false,
        rope_scaling: None,
        qk_norm: false,
        sliding_window: None,
        sliding_layers: None,
        gemma: None,
        fused_modules: false,
        moe: None,
    }
}

fn prompt(len: usize) -> Vec<u32> {
    let mut rng = SplitMix64::new(len as u64);
    (0..len).map(|_| rng.below(64) as u32).collect()
}

/// Greedy runs with and without the cache agree on `cfg` (random
/// parameters scaled up from the initialisation, so the logits are far
/// apart): within the context, crossing it, and from a prompt longer than it.
fn check(cfg: &LlamaConfig) {
    let params: Vec<f32> = Llama::new(cfg.clone()).unwrap().init_params(5).into_iter().map(|x| x * 8.0).collect();
    let make = || -> family::Result<Box<dyn LanguageModel>> { Ok(Box::new(Erased(Llama::new(cfg.clone())?))) };
    let runs = [(prompt(5), 15), (prompt(6), 42), (prompt(30), 12)];
    let seen = check_kv_cache(&make, &params, &runs, cfg.max_position_embeddings, TOLERANCE).unwrap();
    println!("largest relative logit difference {:e}", seen.rel);
    assert!(seen.distinct >= 6, "only {} distinct tokens generated: the check would see little", seen.distinct);
}

#[test]
fn cached_generation_matches_on_a_tiny_gqa_llama() {
    check(&tiny_gqa());
}

/// One key/value head for all query heads, Llama 3's frequency scaling
/// (the rotary rows of later positions), a tied head.
#[test]
fn cached_generation_matches_with_multi_query_heads_and_llama3_rope() {
    let scaling =
        RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8 };
    check(&LlamaConfig { n_kv_head: 1, tie_word_embeddings: true, rope_scaling: Some(scaling), ..tiny_gqa() });
}

/// SmolLM2-135M-Instruct from its GGUF: 40 greedy tokens after a
/// 30-token chat prompt, with and without the cache.
#[test]
fn cached_generation_matches_on_smollm2() {
    let Some(path) = gguf::testing::smollm2_or_skip("cached_generation_matches_on_smollm2") else {
        return;
    };
    let (config, tensors) = gguf::llama::load(&path).unwrap();
    let cfg = LlamaConfig::from_hf_json(&config).unwrap();
    let params = hf::from_named_tensors(&cfg, tensors).unwrap();
    let make = || -> family::Result<Box<dyn LanguageModel>> { Ok(Box::new(Erased(Llama::new(cfg.clone())?))) };
    // The first 30 tokens of the chat the transformers reference uses.
    let reference: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/smollm_reference.json")).expect("reference JSON");
    let ids = reference["inputs"].as_array().expect("inputs");
    let text: Vec<u32> = ids.iter().take(30).map(|v| v.as_u64().expect("a token id") as u32).collect();
    let seen = check_kv_cache(&make, &params, &[(text, 40)], cfg.max_position_embeddings, 1e-4).unwrap();
    println!("SmolLM2: largest relative logit difference {:e}, {} distinct tokens", seen.rel, seen.distinct);
    assert!(seen.distinct >= 3, "only {} distinct tokens generated", seen.distinct);
}
