//! Qwen2 (the Llama block with q/k/v biases) cut into pipeline stages
//! trains the same steps as uncut, bit for bit (the suite's untied tiny shape): P ∈ {2, 4} ×
//! {1F1B, GPipe} × data-parallel {1, 2} × f32/bf16 × checkpointing off/on,
//! and ZeRO-1 — Llama's shared pipeline checks on Qwen2's shape.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::pipeline::matrix;
use common::suite::tiny_gqa;
use llama::{Dialect, LlamaConfig};

#[test]
fn qwen2_pipeline_is_bit_identical_to_uncut() {
    let tiny = qwen2::QWEN2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.attention_bias, "Qwen2's block has q/k/v biases");
    let cfg = LlamaConfig {
        n_layer: 4,
        attention_bias: tiny.attention_bias,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    };
    matrix(cfg);
}
