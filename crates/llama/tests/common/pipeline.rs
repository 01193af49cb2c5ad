//! The pipeline checks of a model on the Llama block (engine's
//! `conformance::pipeline`), shared by Llama's and Qwen2's tests: the
//! layouts P ∈ {2, 4} × {1F1B, GPipe} × data-parallel {1, 2} × f32/bf16 ×
//! checkpointing off/on, and ZeRO-1, each against the model uncut.

use super::suite;
use engine::conformance::pipeline::{check_pipeline, run_layout, Layout, PipelineCase};
use engine::conformance::TokenSamples;
use engine::rng::SplitMix64;
use engine::{Checkpointing, Precision, ScheduleKind};
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
    for precision in [Precision::F32, Precision::Bf16] {
        for checkpointing in [Checkpointing::None, Checkpointing::Blocks] {
            for d in [1, 2] {
                let base = Layout { p: 1, d, kind: ScheduleKind::OneFOneB, precision, checkpointing, zero: 0 };
                let reference = run_layout(&case, base).unwrap();
                for p in [2, 4] {
                    for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
                        let l = Layout { p, kind, ..base };
                        let bit_identical = check_pipeline(&case, l, &reference, 1e-6, 1e-5).unwrap();
                        assert!(bit_identical || tied, "{l:?}: an untied model must match uncut bit for bit");
                    }
                }
            }
        }
    }
    let base = Layout {
        p: 1,
        d: 2,
        kind: ScheduleKind::OneFOneB,
        precision: Precision::F32,
        checkpointing: Checkpointing::None,
        zero: 1,
    };
    let reference = run_layout(&case, base).unwrap();
    let bit_identical = check_pipeline(&case, Layout { p: 2, ..base }, &reference, 1e-6, 1e-5).unwrap();
    assert!(bit_identical || tied, "ZeRO-1: an untied model must match uncut bit for bit");
}
