//! Context parallelism through the CLI: `dist.context_parallel = C` splits
//! each sequence's positions over C ranks (two balanced chunks each) and
//! trains the same curve as one rank — GPT-2 and Llama (grouped-query
//! attention) at C = 2 and 4, attention around the ring and all-gathered,
//! with data parallelism, and the 4D layout
//! D 2 × C 2 × T 2 × P 2 on 16 thread ranks; what it does not compose
//! with is refused before any folder exists.
//!
//! Tolerance: as the tensor-parallel CLI suite's (`tests/tensor_cli.rs`).
//! Context parallelism changes the order of floating-point sums, never
//! what is summed: each parameter's gradient is the C ranks' parts added
//! by the data-parallel all-reduce (in f64 on thread ranks, rounded once)
//! where one rank adds every position in its GEMMs, and each key's
//! gradient adds the ranks' query sums; a chunk that does not start on a
//! multiple of the attention tile groups its rows' tile products
//! differently. [`TOL`] relative on every loss, [`TOL_WEIGHTS`] of the
//! largest weight on the final weights (AdamW moves a weight whose
//! gradient is small by the full step whatever its last bits).

mod common;

use common::*;
use std::path::Path;

/// Relative tolerance on losses between layouts in f32.
const TOL: f64 = 1e-6;
/// Tolerance on the final weights, relative to the largest weight.
const TOL_WEIGHTS: f64 = 1e-5;

const GPT: &[&str] = SPLIT_GPT;
const LLAMA: &[&str] = SPLIT_LLAMA;

fn sets<'a>(model: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    split_sets(model, extra)
}

/// `model` with `grid` (and `extra`) against one rank: losses, validation
/// losses and gradient norms within [`TOL`], final weights within
/// [`TOL_WEIGHTS`]; the header names the layout (`header`) and every
/// step's metrics count rank 0's `calls` context messages (per layer of
/// its stage and micro-batch: [`ring_calls`], or with the all-gather 3 —
/// the keys and values gathered in forward and again in backward, their
/// gradients reduce-scattered).
fn equals_one_rank(tag: &str, model: &[&str], grid: &[&str], (header, calls): (&str, u64)) {
    let base = tmp(&format!("cp-{tag}-base"));
    train_ok(&base, &sets(model, &[]));
    assert!(metrics(&base)[0].get("cp_bytes").is_none(), "no split, no cp metrics");
    let out = tmp(&format!("cp-{tag}"));
    let err = train_ok(&out, &sets(model, grid));
    assert!(err.contains(header), "{tag}: `{header}` missing in: {err}");
    assert_close_rel(&format!("{tag}: loss"), &losses(&out), &losses(&base), TOL);
    assert_close_rel(&format!("{tag}: val_loss"), &val_losses(&out), &val_losses(&base), TOL);
    let norms = |d: &Path| metrics(d).iter().map(|r| r["grad_norm"].as_f64().unwrap()).collect::<Vec<_>>();
    assert_close_rel(&format!("{tag}: grad_norm"), &norms(&out), &norms(&base), TOL);
    let tokens = |d: &Path| metrics(d).iter().map(|r| r["tokens"].as_u64().unwrap()).collect::<Vec<_>>();
    assert_eq!(tokens(&out), tokens(&base), "{tag}: the targets counted once, over the ranks' positions");
    assert_weights_close(tag, &out, &base, TOL_WEIGHTS);
    for r in metrics(&out) {
        assert_eq!(r["cp_calls"].as_u64(), Some(calls), "{tag}: {r}");
        assert!(r["cp_bytes"].as_u64().unwrap() > 0 && r["cp_s"].as_f64().is_some(), "{tag}: {r}");
    }
    let _ = (std::fs::remove_dir_all(&base), std::fs::remove_dir_all(&out));
}

/// The ring's sends per layer and micro-batch at C ranks: C − 1 blocks of
/// keys and values in forward, C − 1 again in backward and C of their
/// gradients (the last hop brings each to its owner).
fn ring_calls(c: u64) -> u64 {
    3 * c - 2
}

#[test]
fn gpt2_at_two_and_four_context_ranks_equals_one_rank() {
    for c in [2, 4] {
        let (w, cp) = (format!("dist.world_size={c}"), format!("dist.context_parallel={c}"));
        let header = format!(
            "context parallel: C={c} (two chunks of each sequence per rank, keys and values around a ring) × P=1 × T=1 × D=1"
        );
        // K 4 × 2 layers.
        equals_one_rank(&format!("gpt-c{c}"), GPT, &[&w, &cp], (&header, 8 * ring_calls(c as u64)));
    }
    let gather = ["dist.world_size=2", "dist.context_parallel=2", "dist.context_attention=\"all_gather\""];
    let header = "context parallel: C=2 (two chunks of each sequence per rank, keys and values all-gathered)";
    equals_one_rank("gpt-c2-gather", GPT, &gather, (header, 8 * 3));
}

#[test]
fn llama_with_data_parallel_context_ranks_equals_one_rank() {
    let header =
        "context parallel: C=2 (two chunks of each sequence per rank, keys and values around a ring) × P=1 × T=1 × D=2";
    // K 2 × 2 layers.
    equals_one_rank(
        "llama-d2c2",
        LLAMA,
        &["dist.world_size=4", "dist.context_parallel=2"],
        (header, 4 * ring_calls(2)),
    );
}

/// The 4D layout on 16 thread ranks: data × context × tensor (the sequence
/// split too) × pipeline, every tensor group's replicas checked each step.
#[test]
fn llama_in_four_dimensions_equals_one_rank() {
    let grid = [
        "dist.world_size=16",
        "dist.context_parallel=2",
        "dist.tensor_parallel=2",
        "dist.sequence_parallel=true",
        "dist.pipeline_parallel=2",
        "dist.check_every=1",
    ];
    let header = "context parallel: C=2 (two chunks of each sequence per rank, keys and values around a ring) × P=2 × T=2, the sequence split × D=2; rank r = stage·8 + data·4 + context·2 + tensor";
    // K 2 × 1 layer on stage 0.
    equals_one_rank("llama-4d", LLAMA, &grid, (header, 2 * ring_calls(2)));
}

#[test]
fn what_context_parallelism_does_not_compose_with_is_refused() {
    let c2 = ["dist.world_size=2", "dist.context_parallel=2"];
    let cases: [(&str, &str, &[&str]); 5] = [
        ("zero2", "dist.zero_stage=2", &["dist.context_parallel", "dist.zero_stage = 1"]),
        ("mean", "train.loss_normalization=\"micro_batch_mean\"", &["dist.context_parallel", "\"token\""]),
        ("selective", "train.activation_checkpointing=\"selective\"", &["dist.context_parallel", "\"blocks\""]),
        ("world", "dist.world_size=3", &["dist.context_parallel", "multiple of 2"]),
        ("zero", "dist.context_parallel=0", &["dist.context_parallel", "at least 1"]),
    ];
    for (tag, set, needles) in cases {
        refused_train(&format!("cp-{tag}"), None, &sets(GPT, &[&c2[..], &[set]].concat()), needles);
    }
}
