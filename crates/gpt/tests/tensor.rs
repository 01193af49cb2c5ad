//! GPT-2 split over T tensor-parallel ranks (Megatron-LM: each rank holds
//! n_head / T heads of every block and 4C / T MLP columns) trains the same
//! steps as uncut (engine's `conformance::pipeline::check_tensor_layouts`):
//! T ∈ {2, 4} × f32/bf16 × checkpointing off/on, 3D (P 2 × T 2 × D 2)
//! and T 2 × D 2 at ZeRO-1.
//!
//! Tolerance: as Llama's (`crates/llama/tests/tensor.rs`) — a row-parallel
//! product is T partial products summed by the all-reduce, so sums are
//! reordered: losses within 1e-6 relative, parameters within 1e-5 of the
//! largest after 3 AdamW steps; 16-bit runs (bf16 operands, f16 storage
//! with its dynamic loss scale) compare the first step's loss and each
//! tensor's gradient (`FIRST_STEP_16BIT`, derived in the engine), as
//! Llama's. (The 3D layout also cuts the tied embedding across stages: the
//! pipeline suite's own reordering.)

use engine::conformance::pipeline::{check_tensor_layouts, PipelineCase};
use engine::conformance::TokenSamples;
use engine::rng::SplitMix64;
use engine::{Checkpointing, Precision, TpRank};
use family::Family;
use gpt::{init_params, Gpt, Gpt2, GptConfig};

const T: usize = 8;

fn cfg() -> GptConfig {
    GptConfig { n_layer: 4, n_head: 4, n_embd: 16, block_size: T, vocab_size: 32 }
}

fn model(p: Precision, ck: Checkpointing, tp: TpRank) -> Gpt {
    Gpt::tensor_parallel(cfg(), p, tp).expect("valid split").with_checkpointing(ck)
}

#[test]
fn gpt2_split_over_tensor_ranks_matches_uncut() {
    let mut init = init_params(&cfg(), 3);
    let mut rng = SplitMix64::new(15);
    init.iter_mut().for_each(|x| *x += (rng.normal() * 0.3) as f32);
    let seqs = TokenSamples::new(48, T, 32, 9);
    let case = PipelineCase { model: &model, init, seqs: &seqs };
    let worst = check_tensor_layouts(&case, (1e-6, 1e-5), engine::conformance::pipeline::FIRST_STEP_16BIT, &[2, 4])
        .unwrap_or_else(|e| panic!("{e}"));
    println!("largest relative loss difference vs uncut: {worst:e}");
}

#[test]
fn gpt2_refuses_a_split_that_does_not_divide_its_heads_and_sizes_a_rank() {
    let e = Gpt::tensor_parallel(cfg(), Precision::F32, TpRank { rank: 0, size: 3 }).unwrap_err().to_string();
    assert!(e.contains("n_head (4)") && e.contains("dist.tensor_parallel (3)"), "{e}");
    // A rank's shape: per block 12C² + 13C parameters whole; split, the
    // matrices (12C²) and the c_attn and c_fc biases (3C + 4C) are /T, the
    // rest (LayerNorms 4C, c_proj biases 2C) whole.
    let (whole, c) = (Gpt2(cfg()), 16u128);
    let rank = whole.tensor_parallel(TpRank { rank: 1, size: 2 }).unwrap_or_else(|e| panic!("{e}"));
    let per_block_saved = (12 * c * c + 7 * c) / 2;
    assert_eq!(whole.n_params() - rank.n_params(), 4 * per_block_saved);
    // Its initial values are its slices of the whole model's.
    let seg1 = rank.init_segment(7, 1);
    let local = model(Precision::F32, Checkpointing::None, TpRank { rank: 1, size: 2 });
    assert_eq!(seg1.len(), engine::Model::segments(&local)[1].len());
}
