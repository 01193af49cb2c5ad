//! Qwen3 against transformers' `Qwen3ForCausalLM` (a random small model
//! made and saved by transformers on the spot, see family::reference for
//! the procedure and the tolerance): logits at every position, greedy
//! tokens, and the folder we write loaded back by transformers.

#[test]
fn qwen3_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&qwen3::FAMILY, "qwen3");
}
