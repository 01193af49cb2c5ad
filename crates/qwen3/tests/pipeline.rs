//! Qwen3 (the Llama block with per-head q/k norms, heads wider than
//! C / H) cut into pipeline stages trains the same steps as uncut, bit for
//! bit: P ∈ {2, 4} × {1F1B, GPipe} × data-parallel {1, 2} × f32/bf16 ×
//! checkpointing off/on, and ZeRO-1 — Llama's shared pipeline checks on
//! Qwen3's shape. Split over T ∈ {2, 4} tensor-parallel ranks (each rank
//! normalises its own heads with the whole gains, whose gradients are
//! parts summed over the group), in 3D and at ZeRO-1, it trains the same
//! steps as uncut within the tolerances of Llama's `tests/tensor.rs` (and
//! for its reasons).

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::pipeline::{matrix, tensor_matrix};
use common::suite::tiny_gqa;
use llama::{Dialect, LlamaConfig};

/// Losses within 1e-5 relative, as Llama's `tests/tensor.rs` derives it
/// (the split reorders sums; later losses are those of parameters AdamW
/// moved). Parameters after three AdamW steps within 1e-4 of the largest:
/// AdamW's update `lr·ĝ/(|ĝ| + ε)` changes by up to `lr/(4ε)` = 25 per
/// unit of gradient where `|g|` is near ε = 1e-4 (lr 1e-2), so a rounding
/// difference of the gradient can come out 25× larger in a parameter, and
/// compound over three steps: measured up to 2.4e-5 of the largest (AMD
/// EPYC Zen 4: one embedding element, Mistral with a window of 3; windows
/// of 2, 4, 5, 6 stayed under 1e-5). A real error — a piece updated twice,
/// or not at all — moves a parameter by lr = 1e-2, 100× this bound.
const F32: (f64, f32) = (1e-5, 1e-4);

/// The suite's 4-layer GQA shape with Qwen3's q/k norms, norm ε, RoPE θ
/// and heads of width 8 (H·d = 2C).
fn shape() -> LlamaConfig {
    let tiny = qwen3::QWEN3.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.qk_norm, "Qwen3's block has per-head q/k norms");
    LlamaConfig {
        n_layer: 4,
        qk_norm: tiny.qk_norm,
        head_dim: 8,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    }
}

#[test]
fn qwen3_pipeline_is_bit_identical_to_uncut() {
    matrix(shape());
}

#[test]
fn qwen3_split_over_tensor_ranks_matches_uncut() {
    let worst = tensor_matrix(shape(), None, &[2, 4], F32, engine::conformance::pipeline::FIRST_STEP_16BIT);
    println!("largest relative loss difference vs uncut: {worst:e}");
}
