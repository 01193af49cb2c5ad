//! Llama 3's RoPE scaling (`rope_type = "llama3"`) against transformers'
//! `LlamaForCausalLM` (a random small model made and saved by transformers
//! on the spot, its head's frequencies in all three bands of the scaling;
//! see family::reference for the procedure and the tolerance).

#[test]
fn llama3_rope_scaling_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&llama::FAMILY, "llama3");
}
