//! Phi-3 against transformers' `Phi3ForCausalLM` (a random small model
//! with a sliding window of 8 keys and fused qkv_proj / gate_up_proj, made
//! and saved by transformers on the spot, see family::reference for the
//! procedure and the tolerance): logits at all 40 positions, greedy tokens
//! (generated with transformers' cache past the window), and the folder we
//! write — fused again — loaded back by transformers.

#[test]
fn phi3_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&phi3::FAMILY, "phi3");
}
