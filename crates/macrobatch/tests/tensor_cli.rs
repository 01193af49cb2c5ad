//! Tensor parallelism through the CLI: `dist.tensor_parallel = T` trains
//! the same curve as one rank (GPT-2; Llama with grouped-query attention
//! whose key/value heads T divides and does not), alone and as 3D
//! parallelism (data × tensor × pipeline); checkpoints resume at another
//! (T, P, D) layout; `bench` reports the all-reduces; bad settings are
//! refused before any folder exists.
//!
//! Tolerance: a split changes the order of floating-point sums, never what
//! is summed. Each row-parallel product (attention output, MLP down) sums
//! its inner dimension in T partial products whose results the group adds
//! (in f64 on thread ranks, rounded once to f32), and the column-parallel
//! input gradients are summed the same way; everything else runs the same
//! kernels on the same values. In f32 a reordered sum of n terms moves by at
//! most ~n·2⁻²⁴ of the sum of magnitudes, a few 1e-7 of any one value in
//! these tiny layers, and the mean loss over thousands of targets averages
//! that down further: [`TOL`] relative on every loss (measured: at most
//! 5e-9, GPT-2, Llama, Qwen2, LoRA, T = 2 and 4, 3D). AdamW divides each
//! gradient by its own running magnitude, so a weight whose gradient is
//! small moves by the full step whatever the gradient's last bits:
//! [`TOL_WEIGHTS`] of the largest weight on the final weights (measured:
//! at most 4.4e-7). Under bf16 storage an activation rounded to 8 bits of
//! mantissa after the reduction can round the other way when its f32 value
//! moved (2⁻⁸ of that value) and carry that into the next layers, and a
//! CPU with AVX512-BF16 rounds GEMM operands too: [`TOL_BF16`] on losses
//! and weights (measured on an AVX2 CPU: 1.6e-7 of the loss, 2.4e-5 of the
//! largest weight), also for f16 storage (11 bits: measured 4.3e-7 of the
//! loss, 7.3e-6 of the largest weight).

mod common;

use common::*;
use std::path::Path;

/// Relative tolerance on losses between layouts in f32 (see the module's comment).
const TOL: f64 = 1e-6;
/// Tolerance on the final weights in f32, relative to the largest weight.
const TOL_WEIGHTS: f64 = 1e-5;
/// Relative tolerance between layouts under bf16 storage.
const TOL_BF16: f64 = 1e-3;

/// The split suites' models and run (`common::SPLIT_GPT`, `SPLIT_LLAMA`, `split_sets`).
const GPT: &[&str] = SPLIT_GPT;
const LLAMA: &[&str] = SPLIT_LLAMA;

fn sets<'a>(model: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    split_sets(model, extra)
}

/// `model` at T ∈ `ts` (world = T, one data rank) against T = 1: losses
/// and validation losses within `tol`, final weights within `weight_tol`;
/// the header names the layout and every step's metrics carry the all-reduces.
fn equals_one_rank(tag: &str, model: &[&str], extra: &[&str], ts: &[usize], (tol, weight_tol): (f64, f64)) {
    let base = tmp(&format!("tp-{tag}-t1"));
    train_ok(&base, &sets(model, extra));
    let m = &metrics(&base)[0];
    assert!(m.get("tp_bytes").is_none() && m.get("tp_allreduce_s").is_none(), "no split, no tp metrics: {m}");
    for &t in ts {
        let out = tmp(&format!("tp-{tag}-t{t}"));
        let (w, tp) = (format!("dist.world_size={t}"), format!("dist.tensor_parallel={t}"));
        let err = train_ok(&out, &sets(model, &[extra, &[w.as_str(), tp.as_str()]].concat()));
        let vocab = match (extra.contains(&"dist.vocab_parallel=true"), extra.contains(&"dist.sequence_parallel=true"))
        {
            (true, true) => " (the vocabulary and the sequence split too)",
            (true, false) => " (the vocabulary split too)",
            (false, true) => " (the sequence split too)",
            (false, false) => "",
        };
        assert!(err.contains(&format!("tensor parallel: T={t}{vocab} × D=1; rank r = tensor")), "{err}");
        assert!(err.contains("× D 1"), "the batch counts data-parallel ranks: {err}");
        let what = format!("{tag} T={t}");
        assert_close_rel(&format!("{what}: loss"), &losses(&out), &losses(&base), tol);
        assert_close_rel(&format!("{what}: val_loss"), &val_losses(&out), &val_losses(&base), tol);
        // The clip factor comes from the global norm, each replicated tensor
        // counted once and each split one's slices once (train.grad_clip = 1:
        // the full models' norms are above it every step, LoRA's below).
        let norms = |d: &Path| metrics(d).iter().map(|r| r["grad_norm"].as_f64().unwrap()).collect::<Vec<_>>();
        assert_close_rel(&format!("{what}: grad_norm"), &norms(&out), &norms(&base), tol);
        let clipped = |d: &Path| metrics(d).iter().map(|r| r["clipped"] == true).collect::<Vec<_>>();
        assert_eq!(clipped(&out), clipped(&base), "{what}: the same steps clipped");
        assert_eq!(val_losses(&out).len(), 2, "{what}");
        assert_weights_close(&what, &out, &base, weight_tol);
        for r in metrics(&out) {
            // Forward: two row-parallel reductions per layer and micro-batch.
            assert!(r["tp_calls"].as_u64().unwrap() >= 2 * 2 * 4, "{what}: {r}");
            assert!(r["tp_bytes"].as_u64().unwrap() > 0, "{what}: {r}");
            assert!(r["tp_allreduce_s"].as_f64().is_some_and(|s| s >= 0.0), "{what}: {r}");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn gpt2_at_two_and_four_tensor_ranks_equals_one_rank() {
    equals_one_rank("gpt", GPT, &[], &[2, 4], (TOL, TOL_WEIGHTS));
}

#[test]
fn gpt2_lora_split_equals_one_rank() {
    // Adapters on every Conv1D (the base frozen): A and B cut with their layers.
    let lora = ["lora.r=2", "lora.alpha=4.0", "lora.target_modules=[\"all-linear\"]"];
    equals_one_rank("gpt-lora", GPT, &lora, &[2], (TOL, TOL_WEIGHTS));
}

#[test]
fn split_with_bf16_and_checkpointing_equals_one_rank() {
    let extra = ["train.precision=\"bf16\"", "train.activation_checkpointing=\"blocks\""];
    equals_one_rank("gpt-bf16", GPT, &extra, &[2], (TOL_BF16, TOL_BF16));
    equals_one_rank("llama-bf16", LLAMA, &extra, &[2, 4], (TOL_BF16, TOL_BF16));
    // f16: the loss scaler's skips and back-offs are decided on the global
    // gradient, identically on every rank.
    equals_one_rank("gpt-f16", GPT, &["train.precision=\"f16\""], &[2], (TOL_BF16, TOL_BF16));
}

/// The embedding and head split by vocabulary rows too (each token's
/// embedding from the rank holding it, the softmax's statistics summed over
/// the group; Llama untied, with label smoothing and z-loss): the same
/// tolerances, which the head's input gradient (T partial products summed,
/// as a row-parallel product's) and the log-sum-exp combined from T f64
/// sums (a few f32 ulps) stay within.
#[test]
fn the_vocabulary_split_too_equals_one_rank() {
    let vocab = "dist.vocab_parallel=true";
    equals_one_rank("gpt-vocab", GPT, &[vocab], &[2, 4], (TOL, TOL_WEIGHTS));
    let terms = [vocab, "model.tie_word_embeddings=false", "train.label_smoothing=0.1", "train.z_loss=1e-3"];
    equals_one_rank("llama-vocab", LLAMA, &terms, &[2, 4], (TOL, TOL_WEIGHTS));
}

/// Sequence parallelism (`dist.sequence_parallel`): each rank holds its
/// rows of the residual stream; the reduce-scatter's sums are the
/// all-reduce's and the norms' gains sum their per-rank parts at the step
/// boundary, so the same tolerances hold (GPT-2 with the vocabulary
/// split too, Llama's GQA with it whole and every replicated tensor
/// checked across the group each step).
#[test]
fn the_sequence_split_too_equals_one_rank() {
    let seq = "dist.sequence_parallel=true";
    equals_one_rank("gpt-seq", GPT, &[seq, "dist.vocab_parallel=true"], &[2, 4], (TOL, TOL_WEIGHTS));
    equals_one_rank("llama-seq", LLAMA, &[seq, "dist.check_every=1"], &[2, 4], (TOL, TOL_WEIGHTS));
}

#[test]
fn llama_gqa_at_two_and_four_tensor_ranks_equals_one_rank() {
    // T = 2 divides the 2 key/value heads; at T = 4 each is shared by two
    // ranks. Every step checks that each tensor group's copies of its
    // replicated tensors agree bit for bit (dist.check_every = 1).
    equals_one_rank("llama", LLAMA, &["dist.check_every=1"], &[2, 4], (TOL, TOL_WEIGHTS));
}

/// `model` on 8 thread ranks (D 2 × T 2 × P 2; with `extra`) against one rank.
fn three_d_equals_one_rank(tag: &str, model: &[&str], extra: &[&str]) {
    let base = tmp(&format!("tp-3d-{tag}-base"));
    train_ok(&base, &sets(model, &[]));
    let out = tmp(&format!("tp-3d-{tag}"));
    let grid = ["dist.world_size=8", "dist.tensor_parallel=2", "dist.pipeline_parallel=2"];
    let err = train_ok(&out, &sets(model, &[&grid[..], extra].concat()));
    assert!(err.contains("3D: P=2 × T=2 × D=2; rank r = stage·4 + data·2 + tensor"), "{tag}: {err}");
    assert!(err.contains("× D 2"), "{tag}: the batch counts the D = 2 data ranks: {err}");
    assert_close_rel(&format!("3D {tag}: loss"), &losses(&out), &losses(&base), TOL);
    assert_close_rel(&format!("3D {tag}: val_loss"), &val_losses(&out), &val_losses(&base), TOL);
    assert_weights_close(&format!("3D {tag}"), &out, &base, TOL_WEIGHTS);
    for r in metrics(&out) {
        assert!(r["tp_bytes"].as_u64().unwrap() > 0 && r["p2p_bytes"].as_u64().unwrap() > 0, "{tag}: {r}");
    }
    let _ = (std::fs::remove_dir_all(&base), std::fs::remove_dir_all(&out));
}

#[test]
fn llama_lora_split_equals_one_rank() {
    // Adapters on every projection, the base frozen: A and B train beside
    // split and row-parallel weights alike.
    let lora = ["lora.r=2", "lora.alpha=4.0", "lora.target_modules=[\"all-linear\"]"];
    equals_one_rank("llama-lora", LLAMA, &lora, &[2, 4], (TOL, TOL_WEIGHTS));
}

#[test]
fn qwen2_with_qkv_biases_at_two_tensor_ranks_equals_one_rank() {
    let qwen2: Vec<&str> = [&["model.family=qwen2"], &LLAMA[1..]].concat();
    equals_one_rank("qwen2", &qwen2, &[], &[2], (TOL, TOL_WEIGHTS));
}

#[test]
fn qwen3_with_head_norms_at_two_tensor_ranks_equals_one_rank() {
    // Each rank normalises its own heads with the whole gains; their
    // gradients are parts, summed over the tensor group. Heads of width 16
    // (H·d = 2C), as Qwen3's are wider than C / H.
    let qwen3: Vec<&str> = [&["model.family=qwen3", "model.head_dim=16"], &LLAMA[1..]].concat();
    equals_one_rank("qwen3", &qwen3, &[], &[2], (TOL, TOL_WEIGHTS));
}

#[test]
fn mistral_with_a_sliding_window_at_two_tensor_ranks_equals_one_rank() {
    // A window of 5 keys over sequences of 32: each rank's heads windowed alike.
    let mistral: Vec<&str> = [&["model.family=mistral", "model.sliding_window=5"], &LLAMA[1..]].concat();
    equals_one_rank("mistral", &mistral, &[], &[2], (TOL, TOL_WEIGHTS));
}

#[test]
fn gemma2_with_post_norms_caps_and_alternating_windows_at_two_tensor_ranks_equals_one_rank() {
    // Three layers: the preset's pattern repeated, windows of 5 on layers 0
    // and 2. The post norms run on the summed row-parallel outputs, their
    // gains whole on every rank; scores and logits soft-capped.
    let gemma2: Vec<&str> =
        [&["model.family=gemma2", "model.sliding_window=5"], &LLAMA[1..], &["model.n_layer=3"]].concat();
    equals_one_rank("gemma2", &gemma2, &[], &[2], (TOL, TOL_WEIGHTS));
}

#[test]
fn data_by_tensor_by_pipeline_on_eight_thread_ranks_equals_one_rank() {
    three_d_equals_one_rank("gpt", GPT, &[]);
    // ZeRO-1 over the data group composes with both splits.
    three_d_equals_one_rank("gpt-zero1", GPT, &["dist.zero_stage=1"]);
    three_d_equals_one_rank("llama", LLAMA, &[]);
}

#[test]
fn a_checkpoint_resumes_at_another_tensor_pipeline_and_data_layout() {
    let six = ["train.steps=6", "train.eval_every=0"];
    let straight = tmp("tp-straight");
    train_ok(&straight, &sets(GPT, &six));
    // The checkpoint's config pins the batch's factorization: a resume at
    // another D names its K (global 8 = micro 2 × K × D).
    let one: &[&str] =
        &["dist.world_size=1", "dist.tensor_parallel=1", "dist.pipeline_parallel=1", "batch.accumulation_steps=4"];
    let t2: &[&str] =
        &["dist.world_size=2", "dist.tensor_parallel=2", "dist.pipeline_parallel=1", "batch.accumulation_steps=4"];
    let d2: &[&str] =
        &["dist.world_size=2", "dist.tensor_parallel=1", "dist.pipeline_parallel=1", "batch.accumulation_steps=2"];
    let t2p2: &[&str] =
        &["dist.world_size=4", "dist.tensor_parallel=2", "dist.pipeline_parallel=2", "batch.accumulation_steps=4"];
    let t2d2_zero1: &[&str] = &["dist.world_size=4", "dist.tensor_parallel=2", "dist.zero_stage=1"];
    let t2_vocab = &[t2, &["dist.vocab_parallel=true"]].concat();
    let one_zero0 = &[one, &["dist.zero_stage=0"]].concat();
    // Saved at T = 2, continued by one rank and by two data ranks; saved by
    // one rank and by two data ranks, continued at T = 2 and at T = 2 × P =
    // 2; saved by T = 2 × D = 2 with ZeRO-1 (optimizer state sharded over
    // the data group), continued by one rank.
    for (tag, before, after) in [
        ("t2-t1", t2, one),
        ("t2-d2", t2, d2),
        ("t1-t2", one, t2),
        ("d2-t2p2", d2, t2p2),
        ("t2d2z1-t1", t2d2_zero1, &one_zero0[..]),
        // The vocabulary split: saved as slices, resumed whole and back.
        ("t2v-d2", t2_vocab, d2),
        ("t1-t2v", one, t2_vocab),
    ] {
        let out = tmp(&format!("tp-resumed-{tag}"));
        let mut c = train_cmd(&out, &sets(GPT, &[&six[..], before].concat()));
        let o = c.args(["--stop-after", "3"]).output().unwrap();
        assert!(o.status.success() && stderr(&o).contains("stopped after step 3"), "{tag}: {}", stderr(&o));
        let err = resume_ok(&out, after);
        assert!(err.contains("step-00000003"), "{tag}: {err}");
        let (got, want) = (losses(&out), losses(&straight));
        assert_eq!(got.len(), 6, "{tag}");
        assert_close_rel(&format!("{tag}: steps 1-6"), &got, &want, TOL);
        assert_weights_close(tag, &out, &straight, TOL_WEIGHTS);
        let _ = std::fs::remove_dir_all(&out);
    }
    let _ = std::fs::remove_dir_all(&straight);
}

/// A refused run: non-zero exit, `needles` in the message, no folder.
fn refused(tag: &str, s: &[&str], needles: &[&str]) {
    refused_train(&format!("tp-{tag}"), None, s, needles);
}

#[test]
fn bad_tensor_parallel_settings_are_named_before_anything_is_created() {
    let gpt_2_heads = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32"];
    refused(
        "heads",
        &sets(&gpt_2_heads, &["dist.world_size=4", "dist.tensor_parallel=4"]),
        &["dist.tensor_parallel = 4", "n_head"],
    );
    refused(
        "world",
        &sets(GPT, &["dist.world_size=6", "dist.tensor_parallel=2", "dist.pipeline_parallel=2"]),
        &["dist.pipeline_parallel = 2 × dist.tensor_parallel = 2", "world size 6 (dist.world_size)"],
    );
    refused(
        "zero3",
        &sets(GPT, &["dist.world_size=2", "dist.tensor_parallel=2", "dist.zero_stage=3"]),
        &["dist.zero_stage = 3", "set dist.zero_stage = 1 or dist.tensor_parallel = 1"],
    );
    refused("zero", &sets(GPT, &["dist.tensor_parallel=0"]), &["dist.tensor_parallel = 0", "at least 1"]);
}

#[test]
fn verify_refuses_a_tensor_split() {
    let mut c = bin();
    c.arg("verify");
    with_sets(&mut c, &sets(GPT, &["dist.world_size=2", "dist.tensor_parallel=2"]));
    let o = c.output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("--set dist.tensor_parallel=1"), "{}", stderr(&o));
}

#[test]
fn bench_reports_the_tensor_parallel_all_reduces() {
    let mut c = bin();
    c.args(["bench", "--json", "--steps", "2", "--warmup", "1", "--no-k-sweep"]);
    with_sets(&mut c, &sets(GPT, &["dist.world_size=2", "dist.tensor_parallel=2"]));
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON report");
    let tp = &r["step"]["tensor_parallel"];
    assert!(tp["bytes"].as_u64().unwrap() > 0 && tp["calls"].as_u64().unwrap() >= 16, "{r}");
    assert!(tp["ms_median"].as_f64().is_some_and(|m| m >= 0.0), "{r}");
    // One rank reports none; a world that is not the tensor group is refused.
    let mut c = bin();
    c.args(["bench", "--json", "--steps", "1", "--warmup", "0", "--no-k-sweep"]);
    with_sets(&mut c, &sets(GPT, &[]));
    let o = c.output().unwrap();
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON report");
    assert!(r["step"].get("tensor_parallel").is_none(), "{r}");
    let mut c = bin();
    c.args(["bench", "--steps", "1"]);
    with_sets(&mut c, &sets(GPT, &["dist.world_size=4", "dist.tensor_parallel=2"]));
    let o = c.output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("set dist.world_size = 2"), "{}", stderr(&o));
}
