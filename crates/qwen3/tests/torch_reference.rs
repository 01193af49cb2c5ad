//! Logits, loss and every gradient — the q/k norms' gains included —
//! against transformers' Qwen3ForCausalLM on the same weights and batch,
//! with heads of width 16 where hidden / heads is 8 (fixture made by
//! crates/llama/tests/fixtures/make_fixtures.py, which writes it here;
//! tolerances as for Llama: crates/llama/tests/torch_reference.rs).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::{compare, fixture};
use llama::{hf, Dialect, Llama};

#[test]
fn qwen3_head_norms_and_wide_heads_match_transformers() {
    let dir = fixture("qwen3");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg = qwen3::QWEN3.parse_hf_json(&serde_json::from_str(&text).unwrap()).unwrap();
    assert!(cfg.qk_norm && cfg.head_dim == 16 && cfg.q_dim() == 2 * cfg.hidden_size, "{cfg:?}");
    let params = hf::load_weights(&dir, &cfg).unwrap();
    compare("qwen3", &mut Llama::new(cfg).unwrap(), &params);
}
