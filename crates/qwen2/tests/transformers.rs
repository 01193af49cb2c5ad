//! Qwen2 against transformers' `Qwen2ForCausalLM` (a random small model
//! made and saved by transformers on the spot, see family::reference for
//! the procedure and the tolerance): logits at every position, greedy
//! tokens, and the folder we write loaded back by transformers.

#[test]
fn qwen2_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&qwen2::FAMILY, "qwen2");
}

/// The same with `use_sliding_window`: a window of 8 keys over the 40
/// positions on layer 1 and none on layer 0 (`max_window_layers = 1`),
/// so the logits and the cached greedy decoding each see both kinds.
#[test]
fn qwen2_with_a_window_on_its_upper_layer_matches_transformers() {
    family::reference::assert_agrees(&qwen2::FAMILY, "qwen2_windows");
}
