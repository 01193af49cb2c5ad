//! The mixtures against transformers (a random small model made and
//! saved by transformers on the spot, see family::reference for the
//! procedure and the tolerance): logits at every position, greedy tokens,
//! and the folder we write loaded back by transformers — for Mixtral,
//! Qwen2-MoE (shared expert, no renormalisation) and Qwen3-MoE.

#[test]
fn mixtral_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&mixtral::FAMILY, "mixtral");
}

#[test]
fn qwen2_moe_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&qwen2::MOE_FAMILY, "qwen2_moe");
}

#[test]
fn qwen3_moe_matches_transformers_in_and_out() {
    family::reference::assert_agrees(&qwen3::MOE_FAMILY, "qwen3_moe");
}
