//! Mistral against transformers' `MistralForCausalLM` (a random small model
//! with a sliding window of 8 keys, made and saved by transformers on the
//! spot, see family::reference for the procedure and the tolerance):
//! logits at all 40 positions, greedy tokens (generated with transformers'
//! cache past the window), and the folder we write loaded back by transformers.

#[test]
fn mistral_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&mistral::FAMILY, "mistral");
}
