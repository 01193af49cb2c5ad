//! Qwen2 against transformers' `Qwen2ForCausalLM` (a random small model
//! made and saved by transformers on the spot, see family::reference for
//! the procedure and the tolerance): logits at every position, greedy
//! tokens, and the folder we write loaded back by transformers.

#[test]
fn qwen2_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&qwen2::FAMILY, "qwen2");
}
