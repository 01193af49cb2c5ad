//! Gemma 2 against transformers' `Gemma2ForCausalLM` (a random small model
//! made and saved by transformers on the spot with eager attention: GeGLU,
//! `1 + w` norms and post norms, the √C embedding scale, a window of 8 keys
//! on layer 0 and none on layer 1, scores scaled by 24^-½ with heads of 16,
//! attention and final soft caps of 2 and 5, tied head; see
//! family::reference for the procedure and the tolerance): logits at all
//! 40 positions, greedy tokens (with transformers' cache past the
//! window), and the folder we write loaded back by transformers.

#[test]
fn gemma2_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&gemma2::FAMILY, "gemma2");
}
