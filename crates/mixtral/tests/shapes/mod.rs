//! The mixtures' test shapes, shared by the crate's integration tests.

use crate::common::suite::tiny_gqa;
use llama::{Dialect, LlamaConfig, MoeBlock};

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
