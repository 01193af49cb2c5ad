//! Logits, loss and every gradient against transformers'
//! Gemma2ForCausalLM on the same weights and batch: GeGLU, `1 + w` norms
//! with post norms, the √C embedding scale, a window of 5 keys over
//! sequences of 12 on layer 0 and none on layer 1, scores scaled by
//! 12^-½, attention and final soft caps of 1 and 2, tied head (fixture
//! made by crates/llama/tests/fixtures/make_fixtures.py, which writes it
//! here; tolerances as for Llama: crates/llama/tests/torch_reference.rs).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::{compare, fixture};
use llama::{hf, Dialect, Llama};

#[test]
fn gemma2_matches_transformers_logits_loss_and_gradients() {
    let dir = fixture("gemma2");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg = gemma2::GEMMA2.parse_hf_json(&serde_json::from_str(&text).unwrap()).unwrap();
    assert_eq!((cfg.sliding_window, cfg.sliding_layers.clone()), (Some(5), Some(vec![true, false])), "{cfg:?}");
    let g = cfg.gemma.unwrap();
    assert_eq!((g.attn_softcap, g.final_softcap, g.query_pre_attn_scalar), (Some(1.0), Some(2.0), 12.0));
    let params = hf::load_weights(&dir, &cfg).unwrap();
    compare("gemma2", &mut Llama::new(cfg).unwrap(), &params);
}
