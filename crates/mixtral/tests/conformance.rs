//! The mixtures of experts run the engine's Model conformance suite
//! (engine::conformance): finite differences through the router, the
//! experts, the shared expert's gate and the router losses; K/W/ZeRO
//! invariance with an empty micro-batch (the global-batch load-balancing
//! loss makes K micro-steps on W ranks the one big batch's step); several
//! steps; frozen tensors; bit-exact resume; overlap — for Mixtral's
//! block, Qwen2-MoE's (shared expert, q/k/v biases, no renormalisation)
//! and Qwen3-MoE's (q/k norms), and Mixtral with LoRA on the attention.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::suite::{tiny_gqa, UnderTest};
use engine::conformance;
use llama::{Dialect, LlamaConfig, LoraConfig, MoeBlock};

/// The suite's tiny GQA shape with `family`'s mixture: 4 experts of width
/// 12, top 2, router losses large enough to show in every gradient
/// (α = 0.1, z = 0.01).
pub fn cfg(family: &dyn Dialect) -> LlamaConfig {
    let tiny = family.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    let moe = tiny.moe.clone().map(|m| MoeBlock {
        expert_size: 12,
        shared_expert_size: m.shared_expert_size.map(|_| 20),
        router_aux_loss_coef: 0.1,
        router_z_loss_coef: 0.01,
        ..m
    });
    LlamaConfig { moe, qk_norm: tiny.qk_norm, attention_bias: tiny.attention_bias, ..tiny_gqa() }
}

#[test]
fn mixtral_passes_the_conformance_suite() {
    conformance::run_all(&UnderTest::new(cfg(&mixtral::MIXTRAL), None)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn qwen2_moe_passes_the_conformance_suite() {
    conformance::run_all(&UnderTest::new(cfg(&qwen2::QWEN2_MOE), None)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn qwen3_moe_passes_the_conformance_suite() {
    conformance::run_all(&UnderTest::new(cfg(&qwen3::QWEN3_MOE), None)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn mixtral_with_lora_on_the_attention_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["q_proj", "k_proj", "v_proj", "o_proj"]);
    conformance::run_all(&UnderTest::new(cfg(&mixtral::MIXTRAL), Some(lora))).unwrap_or_else(|e| panic!("{e}"));
}
