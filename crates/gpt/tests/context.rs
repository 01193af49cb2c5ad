//! GPT-2 with each sequence split over C context-parallel ranks (each rank
//! runs its two balanced chunks of positions; attention reaches every
//! rank's keys and values around the ring or by an all-gather) trains the
//! same steps as uncut (engine's `conformance::pipeline::
//! check_context_layouts`): C ∈ {2, 4} × f32/bf16 × checkpointing off/on,
//! packed documents, both attentions, and C = 2 with data, tensor and
//! pipeline parallelism, ZeRO-1, clipping and the 4D layout.
//!
//! Tolerance: as the tensor-parallel suite's (`tests/tensor.rs`). With the
//! all-gather a row's forward is the uncut kernel's sums (its query tile
//! starts elsewhere when a chunk is not a multiple of the tile: the tile
//! GEMMs group the same products differently), and every parameter's
//! gradient is the C ranks' parts added by the data-parallel all-reduce
//! where uncut adds them in one GEMM, as a key's gradient adds the ranks'
//! query sums: sums reordered, so losses within 1e-6 relative and
//! parameters within 1e-5 of the largest after 3 AdamW steps at C alone;
//! the ring (whose fold of each row's softmax over the blocks rounds the
//! forward too) and C combined with T, P or D compare the first f32 step
//! (`FIRST_STEP_F32`), 16-bit runs the first step (`FIRST_STEP_16BIT`),
//! both derived in the engine.

use engine::conformance::pipeline::{check_context_layouts, PipelineCase, FIRST_STEP_16BIT};
use engine::conformance::TokenSamples;
use engine::rng::SplitMix64;
use engine::{Checkpointing, Precision, TpRank};
use gpt::{init_params, Gpt, GptConfig};

fn cfg(t: usize) -> GptConfig {
    GptConfig { n_layer: 4, n_head: 4, n_embd: 16, block_size: t, vocab_size: 32 }
}

/// The suite on sequences of `t` tokens.
fn context_matches_uncut_at(t: usize) {
    let model = |p: Precision, ck: Checkpointing, tp: TpRank| {
        Gpt::tensor_parallel(cfg(t), p, tp).expect("valid split").with_checkpointing(ck)
    };
    let mut init = init_params(&cfg(t), 3);
    let mut rng = SplitMix64::new(15);
    init.iter_mut().for_each(|x| *x += (rng.normal() * 0.3) as f32);
    let seqs = TokenSamples::new(48, t, 32, 9);
    let case = PipelineCase { model: &model, init, seqs: &seqs };
    let worst = check_context_layouts(&case, (1e-6, 1e-5), FIRST_STEP_16BIT, &[2, 4]).unwrap_or_else(|e| panic!("{e}"));
    println!("t {t}: largest relative loss and first-gradient differences vs uncut: {:e} and {:e}", worst.0, worst.1);
}

#[test]
fn gpt2_split_over_context_ranks_matches_uncut() {
    context_matches_uncut_at(16);
}

/// Sequences of 13 tokens: chunks of ⌈13/2C⌉, the last ranks' shorter or
/// empty, their gathers padded.
#[test]
fn gpt2_with_uneven_chunks_matches_uncut() {
    context_matches_uncut_at(13);
}
