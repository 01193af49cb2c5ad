//! Gemma 2 (its pieces as in `conformance.rs`, on 4 layers: windows on
//! layers 0 and 2) cut into pipeline stages trains the same steps as
//! uncut, bit for bit: P ∈ {2, 4} × {1F1B, GPipe} × data-parallel {1, 2}
//! × f32/bf16 × checkpointing off/on, and ZeRO-1 — Llama's shared pipeline
//! checks on Gemma's shape. Split over T ∈ {2, 4} tensor-parallel ranks
//! (the post norms run on the summed branch outputs, their gains whole on
//! every rank), in 3D and at ZeRO-1, it trains the same steps as uncut
//! within the tolerances of Mistral's `tests/pipeline.rs` (and for its reasons).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::pipeline::{matrix, seq_matrix, tensor_matrix};
use common::suite::tiny_gqa;
use llama::{Dialect, GemmaBlock, LlamaConfig};

/// Losses within 1e-5 relative, parameters after three AdamW steps within
/// 1e-4 of the largest: Mistral's bounds, derived there.
const F32: (f64, f32) = (1e-5, 1e-4);

/// The suite's 4-layer GQA shape with Gemma 2's pieces, a window of 3 on
/// every other layer.
fn shape() -> LlamaConfig {
    let tiny = gemma2::GEMMA2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    LlamaConfig {
        n_layer: 4,
        sliding_window: Some(3),
        sliding_layers: Some(vec![true, false, true, false]),
        gemma: Some(GemmaBlock { query_pre_attn_scalar: 24.0, attn_softcap: Some(1.0), final_softcap: Some(1.5) }),
        tie_word_embeddings: true,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    }
}

#[test]
fn gemma2_pipeline_is_bit_identical_to_uncut() {
    matrix(shape());
}

#[test]
fn gemma2_split_over_tensor_ranks_matches_uncut() {
    let worst = tensor_matrix(shape(), None, &[2, 4], F32, engine::conformance::pipeline::FIRST_STEP_16BIT);
    println!("largest relative loss difference vs uncut: {worst:e}");
}

/// With sequence parallelism the post norms run on each rank's rows of
/// the reduce-scattered branch outputs (their gains' gradients summed
/// over the group), on sequences of 7 tokens (uneven blocks): the same
/// steps as uncut within the same bounds.
#[test]
fn gemma2_with_sequence_parallelism_matches_uncut() {
    let low = engine::conformance::pipeline::FIRST_STEP_16BIT;
    let worst = seq_matrix(shape(), None, (Some(false), common::suite::T - 1), &[2, 4], F32, low);
    println!("largest relative loss difference vs uncut: {worst:e}");
}
