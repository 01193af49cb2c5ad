//! Llama cut into pipeline stages trains the same steps as uncut (engine's
//! `conformance::pipeline` checks): P ∈ {2, 4} × {1F1B, GPipe} ×
//! data-parallel {1, 2}, f32 and bf16 storage, with and without activation
//! checkpointing; ZeRO-1; windows with a micro-batch without targets, an
//! uneven last window and empty micro-batches.
//!
//! Untied head: every tensor lives on exactly one stage and accumulates
//! its micro-batches' gradients in the same order as uncut (both schedules
//! run backward passes in ascending micro-batch order), the statistics sum
//! exact zeros from the other stages, and without clipping the norm's
//! summation order (per stage, then over stages) reaches only the
//! reported norm — so losses and parameters are bit-identical, asserted.
//! Tied head (SmolLM2): the embedding's two shares are summed between the
//! first and last stage, a different order: within 1e-6 (losses) and 1e-5
//! of the largest parameter (the suite's tolerance for reordered sums).
//! The untied one also with the loss over chunks of rows.

mod common;

use common::pipeline::{matrix, matrix_with_loss_chunk};
use common::suite;
use llama::LlamaConfig;

fn cfg(tied: bool) -> LlamaConfig {
    LlamaConfig { n_layer: 4, tie_word_embeddings: tied, ..suite::tiny_gqa() }
}

#[test]
fn untied_llama_pipeline_is_bit_identical_to_uncut() {
    matrix(cfg(false));
}

#[test]
fn tied_llama_pipeline_matches_uncut() {
    matrix(cfg(true));
}

/// The loss over chunks of at most 5 rows on the last stage (its
/// micro-batches of 0 to 16 rows: one empty chunk, several, their logits
/// buffer carried between the slots in flight) equals the uncut model's
/// chunked loss to the bit with an untied head, in f32 and bf16.
#[test]
fn untied_llama_pipeline_with_a_chunked_loss_is_bit_identical_to_uncut() {
    matrix_with_loss_chunk(cfg(false), Some(5));
}
