//! Logits, loss and every gradient against transformers'
//! MistralForCausalLM on the same weights and batch, with a sliding window
//! of 5 keys over sequences of 12 (fixture made by
//! crates/llama/tests/fixtures/make_fixtures.py, which writes it here;
//! tolerances as for Llama: crates/llama/tests/torch_reference.rs).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::{compare, fixture};
use llama::{hf, Dialect, Llama};

#[test]
fn mistral_sliding_window_matches_transformers() {
    let dir = fixture("mistral");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg = mistral::MISTRAL.parse_hf_json(&serde_json::from_str(&text).unwrap()).unwrap();
    assert_eq!(cfg.sliding_window, Some(5), "{cfg:?}");
    let params = hf::load_weights(&dir, &cfg).unwrap();
    compare("mistral", &mut Llama::new(cfg).unwrap(), &params);
}
