//! Qwen2 (the Llama block with q/k/v biases) cut into pipeline stages
//! trains the same steps as uncut, bit for bit (the suite's untied tiny shape): P ∈ {2, 4} ×
//! {1F1B, GPipe} × data-parallel {1, 2} × f32/bf16 × checkpointing off/on,
//! and ZeRO-1 — Llama's shared pipeline checks on Qwen2's shape. Split
//! over T ∈ {2, 4} tensor-parallel ranks (its biases with their heads), in
//! 3D and at ZeRO-1, it trains the same steps as uncut within the
//! tolerances of Llama's `tests/tensor.rs` (and for its reasons).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::pipeline::{matrix, tensor_matrix};
use common::suite::tiny_gqa;
use llama::{Dialect, LlamaConfig};

/// The suite's 4-layer GQA shape with Qwen2's q/k/v biases, norm ε and RoPE θ.
fn shape() -> LlamaConfig {
    let tiny = qwen2::QWEN2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.attention_bias, "Qwen2's block has q/k/v biases");
    LlamaConfig {
        n_layer: 4,
        attention_bias: tiny.attention_bias,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    }
}

#[test]
fn qwen2_pipeline_is_bit_identical_to_uncut() {
    matrix(shape());
}

#[test]
fn qwen2_split_over_tensor_ranks_matches_uncut() {
    let worst = tensor_matrix(shape(), None, &[2, 4], (1e-6, 1e-5), engine::conformance::pipeline::FIRST_STEP_16BIT);
    println!("largest relative loss difference vs uncut: {worst:e}");
}
