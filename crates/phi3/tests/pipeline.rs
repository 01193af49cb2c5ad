//! Phi-3 (the Llama block with a key/value head per query head and a
//! sliding window of 3 keys over sequences of 8) cut into pipeline stages
//! trains the same steps as uncut, bit for bit: P ∈ {2, 4} × {1F1B, GPipe}
//! × data-parallel {1, 2} × f32/bf16 × checkpointing off/on, and ZeRO-1 —
//! Llama's shared pipeline checks on Phi-3's shape. Split over T ∈ {2, 4}
//! tensor-parallel ranks, in 3D and at ZeRO-1, it trains the same steps as
//! uncut within the tolerances of Llama's `tests/tensor.rs` (and for its
//! reasons).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::pipeline::{matrix, tensor_matrix};
use common::suite::tiny_gqa;
use llama::{Dialect, LlamaConfig, LoraConfig};

/// As Mistral's `tests/pipeline.rs` derives them (the same block, window
/// and AdamW steps): losses within 1e-5 relative, parameters after three
/// AdamW steps within 1e-4 of the largest (AdamW's `lr/(4ε)` = 25× growth
/// of a gradient's rounding where `|g|` is near ε, over three steps); a
/// real error moves a parameter by lr = 1e-2, 100× this bound.
const F32: (f64, f32) = (1e-5, 1e-4);

/// The suite's 4-layer shape with 4 key/value heads (one per query head),
/// Phi-3's norm ε and RoPE θ, and a window of 3.
fn shape() -> LlamaConfig {
    let tiny = phi3::PHI3.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    let base = tiny_gqa();
    LlamaConfig {
        n_layer: 4,
        n_kv_head: base.n_head,
        sliding_window: Some(3),
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        fused_modules: tiny.fused_modules,
        ..base
    }
}

#[test]
fn phi3_pipeline_is_bit_identical_to_uncut() {
    matrix(shape());
}

#[test]
fn phi3_split_over_tensor_ranks_matches_uncut() {
    let worst = tensor_matrix(shape(), None, &[2, 4], F32, engine::conformance::pipeline::FIRST_STEP_16BIT);
    println!("largest relative loss difference vs uncut: {worst:e}");
}

/// LoRA on o_proj and down_proj (plain modules in Phi-3 too) splits over
/// T = 2 as the Llama block's does (the fused qkv_proj and gate_up_proj
/// are refused under tensor parallelism: conformance.rs).
#[test]
fn phi3_lora_on_its_plain_modules_splits_over_tensor_ranks() {
    let lora = LoraConfig::new(2, 4.0, &["o_proj", "down_proj"]);
    let worst = tensor_matrix(shape(), Some(lora), &[2], F32, engine::conformance::pipeline::FIRST_STEP_16BIT);
    println!("largest relative loss difference vs uncut: {worst:e}");
}
