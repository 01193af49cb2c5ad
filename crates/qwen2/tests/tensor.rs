//! Qwen2 (the Llama block with q/k/v biases, split with their heads) over
//! T ∈ {2, 4} tensor-parallel ranks, in 3D and at ZeRO-1, trains the same
//! steps as uncut — Llama's shared tensor-parallel checks on Qwen2's
//! shape; the tolerances and why are those of Llama's `tests/tensor.rs`.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::pipeline::tensor_matrix;
use common::suite::tiny_gqa;
use llama::{Dialect, LlamaConfig};

#[test]
fn qwen2_split_over_tensor_ranks_matches_uncut() {
    let tiny = qwen2::QWEN2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    let cfg = LlamaConfig {
        n_layer: 4,
        attention_bias: tiny.attention_bias,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    };
    let worst = tensor_matrix(cfg, None, &[2, 4], (1e-6, 1e-5), (1e-3, 5e-3));
    println!("largest relative loss difference vs uncut: {worst:e}");
}
