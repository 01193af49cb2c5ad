//! Llama with each sequence split over C context-parallel ranks (two
//! balanced chunks of positions per rank, rotated by their own positions;
//! attention over every rank's keys and values, passed around the ring or
//! gathered per layer) trains the same steps as uncut (engine's
//! `conformance::pipeline::check_context_layouts`): C ∈ {2, 4} ×
//! f32/bf16 × checkpointing off/on, packed documents, both attentions,
//! C = 2 with data, tensor and pipeline parallelism, ZeRO-1, clipping and
//! the 4D layout D 2 × T 2 × P 2 × C 2 on 16 thread ranks — the tiny GQA
//! shape (4 query heads on 2 key/value heads), with LoRA, and with a
//! sliding window shorter than a sequence.
//!
//! Tolerance: as `tests/tensor.rs` (the same reordered sums: each
//! parameter's gradient is the C ranks' parts added by the data-parallel
//! all-reduce, each key's gradient the ranks' query sums added by the
//! reduce-scatter or along the ring; a chunk not on a tile boundary groups
//! its rows' tile products differently), f32 within 1e-5 after three AdamW
//! steps at C alone with the all-gather; the ring (whose fold of each
//! row's softmax rounds the forward too) and C combined with T, P or D
//! compare the first f32 step (`FIRST_STEP_F32`, derived in the engine:
//! AdamW near ε amplifies each further reordering), 16-bit runs the first
//! step (`FIRST_STEP_16BIT`).

mod common;

use common::{pipeline::context_matrix, suite};
use engine::conformance::pipeline::FIRST_STEP_16BIT as LOW;
use llama::{LlamaConfig, LoraConfig};

const F32: (f64, f32) = (1e-5, 1e-5);

fn cfg() -> LlamaConfig {
    LlamaConfig { n_layer: 4, ..suite::tiny_gqa() }
}

#[test]
fn llama_split_over_context_ranks_matches_uncut() {
    for t in [16, 13] {
        let worst = context_matrix(cfg(), None, (t, &[2, 4]), F32, LOW);
        println!(
            "t {t}: largest relative loss and first-gradient differences vs uncut: {:e} and {:e}",
            worst.0, worst.1
        );
    }
}

#[test]
fn llama_context_parallel_with_lora_and_a_window_matches_uncut() {
    let lora = LoraConfig::new(2, 4.0, &["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]);
    let worst = context_matrix(cfg(), Some(lora), (16, &[2]), F32, LOW);
    println!("LoRA: largest relative loss and first-gradient differences vs uncut: {:e} and {:e}", worst.0, worst.1);
    let windowed = LlamaConfig { sliding_window: Some(5), ..cfg() };
    let worst = context_matrix(windowed, None, (16, &[2, 4]), F32, LOW);
    println!(
        "window 5: largest relative loss and first-gradient differences vs uncut: {:e} and {:e}",
        worst.0, worst.1
    );
}
