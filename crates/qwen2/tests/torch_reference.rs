//! Logits, loss and every gradient — the q/k/v biases' included — against
//! transformers' Qwen2ForCausalLM on the same weights and batch, with Llama
//! 3 RoPE scaling whose bands all hold a frequency (fixture made by
//! crates/llama/tests/fixtures/make_fixtures.py, which writes it here;
//! tolerances as for Llama: crates/llama/tests/torch_reference.rs).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::{compare, fixture};
use llama::{hf, Dialect, Llama};

#[test]
fn qwen2_biases_with_llama3_rope_scaling_match_transformers() {
    let dir = fixture("qwen2");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg = qwen2::QWEN2.parse_hf_json(&serde_json::from_str(&text).unwrap()).unwrap();
    let s = cfg.rope_scaling.expect("llama3 rope scaling");
    assert!(cfg.attention_bias && s.factor == 4.0 && s.original_max_position_embeddings == 64);
    let params = hf::load_weights(&dir, &cfg).unwrap();
    compare("qwen2", &mut Llama::new(cfg).unwrap(), &params);
}
