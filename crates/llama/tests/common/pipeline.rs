//! The pipeline checks of a model on the Llama block (engine's
//! `conformance::pipeline`), shared by Llama's and Qwen2's tests: the
//! layouts P ∈ {2, 4} × {1F1B, GPipe} × data-parallel {1, 2} × f32/bf16 ×
//! checkpointing off/on, and ZeRO-1, each against the model uncut.

use super::suite;
use engine::conformance::pipeline::{check_all_layouts, PipelineCase};
use engine::conformance::TokenSamples;
use engine::rng::SplitMix64;
use engine::{Checkpointing, Precision};
use llama::{Llama, LlamaConfig};

fn init(cfg: &LlamaConfig) -> Vec<f32> {
    let mut p = Llama::new(cfg.clone()).expect("valid config").init_params(3);
    let mut rng = SplitMix64::new(15);
    p.iter_mut().for_each(|x| *x += (rng.normal() * 0.3) as f32);
    p
}

/// Every layout of `cfg` (at least 4 layers) against uncut; with an
/// untied head each must be bit-identical.
pub fn matrix(cfg: LlamaConfig) {
    let tied = cfg.tie_word_embeddings;
    let c = cfg.clone();
    let build = move |p: Precision, ck: Checkpointing| {
        Llama::with_precision(c.clone(), p).expect("valid config").with_checkpointing(ck)
    };
    let seqs = TokenSamples::new(48, suite::T, suite::V as u64, 9);
    let case = PipelineCase { model: &build, init: init(&cfg), seqs: &seqs };
    check_all_layouts(&case, 1e-6, 1e-5, !tied).unwrap_or_else(|e| panic!("{e}"));
}
