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

mod shapes;

use common::suite::UnderTest;
use engine::conformance;
use llama::LoraConfig;
use shapes::cfg;

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
