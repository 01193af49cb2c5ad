//! `macrobatch plan` and the memory check with tensor parallelism: Llama 2
//! 70B on 8 tensor ranks and a GPT-3 175B shape on 8 tensor × 8 pipeline
//! ranks planned from their shapes, the rank grid printed, each rank's
//! measured heap peak of a real run against its plan (T = 2 and 4, GPT-2
//! and Llama with grouped-query heads on thread ranks), and grids that
//! cannot be refused with the key that is wrong.

mod common;
mod plan_common;

use common::{stderr, tmp, train};
use plan_common::{plan, plan_json, u, LLAMA_70B};
#[path = "../src/planning/tensor_shapes.rs"]
mod tensor_shapes;
use tensor_shapes::{GPT, LLAMA};

/// GPT-3 175B (Brown et al. 2020; Megatron-LM's 175B configuration): 96
/// layers, d = 12288, 96 heads, 2048 positions, Megatron's padded
/// vocabulary of 51200, on 64 ranks as 8 tensor × 8 pipeline.
const GPT3_175B: &[&str] = &[
    "--memory",
    "80GiB",
    "--world-size",
    "64",
    "model.preset=gpt2",
    "model.n_layer=96",
    "model.n_embd=12288",
    "model.n_head=96",
    "model.block_size=2048",
    "model.vocab_size=51200",
    "data.seq_len=2048",
    "batch.micro=1",
    "batch.global=64",
    "train.precision=bf16",
    "dist.tensor_parallel=8",
    "dist.pipeline_parallel=8",
];

#[test]
fn llama_70b_on_8_tensor_ranks() {
    let tp8 = [LLAMA_70B, &["dist.tensor_parallel=8"]].concat();
    let r = plan_json(&tp8);
    let n = u(&r["n_params"]);
    let t = &r["tensor"];
    assert_eq!((u(&t["tensor_parallel"]), u(&t["stages"]), u(&t["data_parallel"])), (8, 1, 1), "{t}");
    let e = &r["configured"];
    let local = u(&e["stage_params"]);
    assert_eq!(local, u(&t["rank_params"]));
    // Every split matrix / 8, the embeddings and norms whole on each rank
    // (32000 × 8192 twice: input embedding and untied head).
    let replicated = 2 * 32000 * 8192;
    assert!(local > n / 8 && local < n / 8 + replicated, "{local} of {n}");
    // bf16: the 16-bit copy, f32 master weights and gradients, AdamW's two
    // f32 moments, all of the rank's parameters (D = 1: nothing to shard).
    assert_eq!(
        (u(&e["params"]), u(&e["master"]), u(&e["grads"]), u(&e["optimizer"])),
        (2 * local, 4 * local, 4 * local, 8 * local)
    );
    // The tensor group stages a micro-batch's residual stream (4096 × 8192
    // f32) under MPI, one rank per process.
    assert_eq!(u(&e["tp_staging"]), 4 * 4096 * 8192);
    // Against one rank holding everything: the model states shrink by
    // nearly T, the activations by less (the residual stream is whole).
    let whole = plan_json(LLAMA_70B);
    let w = &whole["configured"];
    let states = |e: &serde_json::Value| u(&e["params"]) + u(&e["master"]) + u(&e["grads"]) + u(&e["optimizer"]);
    let ratio = states(w) as f64 / states(e) as f64;
    assert!(ratio > 7.0 && ratio < 8.0, "model states whole / per tensor rank: {ratio}");
    let act = u(&w["activations"]) as f64 / u(&e["activations"]) as f64;
    assert!(act > 1.5 && act < 8.0, "activations whole / per tensor rank: {act}");
    let o = plan(&tp8);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(
            "grid: 1 pipeline stage(s) × 1 data rank(s) × 8 tensor ranks = 8 ranks (rank = stage · 8 + d · 8 + t"
        ),
        "{text}"
    );
    assert!(text.contains("tensor-parallel staging"), "{text}");
    assert!(text.contains("dist.vocab_parallel = true"), "the vocabulary split is offered: {text}");
    // Split by vocabulary too, the rank holds Megatron's count: the split
    // matrices / 8, the norms whole, the embedding and the head / 8.
    let v = plan_json(&[&tp8[..], &["dist.vocab_parallel=true"]].concat());
    assert_eq!(u(&v["configured"]["stage_params"]), local - replicated + replicated / 8);
    assert_eq!(u(&v["configured"]["stage_params"]), 8_623_235_072);
}

#[test]
fn gpt3_175b_on_8_tensor_by_8_pipeline_ranks() {
    let r = plan_json(GPT3_175B);
    let n = u(&r["n_params"]);
    // 96 × (12 d² + 13 d) + (51200 + 2048) × d + 2 d.
    let d = 12288u64;
    assert_eq!(n, 96 * (12 * d * d + 13 * d) + (51200 + 2048) * d + 2 * d);
    let p = &r["pipeline"];
    assert_eq!((u(&p["stages"]), u(&p["tensor_parallel"]), u(&p["data_parallel"])), (8, 8, 1), "{p}");
    assert_eq!(u(&p["micro_batches"]), 64);
    let stages = p["per_stage"].as_array().unwrap();
    // Per tensor rank of a middle stage: 12 layers of d²·12 / 8 split
    // weights, the split biases (q, k, v, MLP up: 7 d) / 8, the replicated
    // ones (two norms, two output biases: 6 d) whole.
    assert_eq!(u(&stages[3]["stage_params"]), 12 * (12 * d * d / 8 + 7 * d / 8 + 6 * d));
    // The first stage adds the embedding segment whole (no vocabulary
    // split), the last the final norm and the tied segment's copy.
    let embedding = u(&stages[0]["stage_params"]) - u(&stages[3]["stage_params"]);
    assert_eq!(embedding, (51200 + 2048) * d);
    // With the vocabulary split the first stage holds 51200 / 8 rows of it.
    let v = plan_json(&[GPT3_175B, &["dist.vocab_parallel=true"]].concat());
    let first = u(&v["pipeline"]["per_stage"][0]["stage_params"]);
    assert_eq!(first - u(&stages[3]["stage_params"]), (51200 / 8 + 2048) * d);
    assert_eq!(u(&stages[7]["stage_params"]) - u(&stages[3]["stage_params"]), embedding + 2 * d);
    // Ranks of stage s: s · 8 .. s · 8 + 7 (a tensor group each).
    assert_eq!(u(&p["peak_rank"]), 8 * u(&p["peak_stage"]));
    let text = String::from_utf8_lossy(&plan(GPT3_175B).stdout).to_string();
    assert!(
        text.contains("pipeline: 8 stages × 1 data ranks × 8 tensor ranks (rank = stage · 8 + d · 8 + t)"),
        "{text}"
    );
    assert!(text.contains("  0     0–11      0–7 "), "{text}");
}

#[test]
fn each_ranks_first_step_heap_matches_its_plan_at_t_2_and_4() {
    for (name, model) in [("GPT-2", GPT), ("Llama", LLAMA)] {
        for t in [2, 4] {
            let out = tmp(&format!("tp-mem-{name}-{t}"));
            let world = format!("dist.world_size={t}");
            let tp = format!("dist.tensor_parallel={t}");
            let run = [&["train.steps=1", "train.eval_every=0", "batch.global=2", "batch.micro=1"], model].concat();
            let o = train(&out, &[&run[..], &[world.as_str(), tp.as_str()]].concat());
            assert!(o.status.success(), "{name} T = {t}: {}", stderr(&o));
            let mem: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(out.join("memory.json")).unwrap()).unwrap();
            let ranks = mem["ranks"].as_array().expect("every rank's place in the grid");
            let tensor: Vec<u64> = ranks.iter().map(|r| u(&r["tensor_rank"])).collect();
            assert_eq!(tensor, (0..t as u64).collect::<Vec<_>>(), "{mem}");
            // Alone in its data-parallel group, a rank allocates the
            // group's collective result itself.
            let staging = u(&mem["predicted"]["comm_staging"]);
            for r in 0..t {
                let planned = u(&mem["planned_rank"][r]) + staging;
                let measured = u(&mem["first_step_rank_heap"][r]);
                let err = measured as f64 / planned as f64 - 1.0;
                eprintln!("{name} T = {t} rank {r}: planned {planned} B, measured {measured} B, {:+.1}%", 100.0 * err);
                assert!(err.abs() < 0.10, "{name} T = {t} rank {r}: measured {measured} vs planned {planned}");
            }
            let _ = std::fs::remove_dir_all(&out);
        }
    }
}

#[test]
fn bad_grids_are_refused_naming_the_key() {
    for (world, sets, want) in [
        // 6 heads cannot be split 4 ways.
        ("4", &["model.preset=mini", "dist.tensor_parallel=4"][..], &["4"][..]),
        // T × P does not divide the world.
        ("6", &["dist.tensor_parallel=2", "dist.pipeline_parallel=2"], &["dist.tensor_parallel", "6"]),
        // ZeRO-2 does not compose with a tensor split.
        ("2", &["dist.tensor_parallel=2", "dist.zero_stage=2"], &["dist.zero_stage", "tensor parallelism"]),
    ] {
        let base = ["--world-size", world, "--memory", "8GiB", "batch.global=24", "batch.micro=1"];
        let o = plan(&[&base[..], sets].concat());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{sets:?}: {err}");
        assert!(want.iter().all(|w| err.contains(w)), "{sets:?}: {err}");
    }
}

/// `plan --no-data` plans a shape at the set data.seq_len without opening
/// `[data]`: a data file that does not exist (and a chat format whose
/// template would be needed) is no error there, while `plan` without the
/// flag names the missing file; a DPO objective, which reads its pairs, is
/// refused with the reason.
#[test]
fn plan_without_data_plans_the_set_sequence_length() {
    let missing = ["data.path=/nonexistent/chat.jsonl", "data.format=\"jsonl\"", "data.seq_len=1024"];
    let shape = ["--memory", "80GiB", "model.family=llama", "model.preset=llama-7b", "batch.micro=1", "batch.global=8"];
    let o = plan(&[&shape[..], &missing].concat());
    assert!(!o.status.success() && stderr(&o).contains("/nonexistent/chat.jsonl"), "{}", stderr(&o));
    let r = plan_json(&[&["--no-data"], &shape[..], &missing].concat());
    assert_eq!(u(&r["seq_len"]), 1024, "the set data.seq_len, not a data file's rows");
    assert_eq!(u(&r["n_params"]), u(&r["n_trainable"]), "full fine-tuning: every parameter trains");
    // Unset, the model's context (llama-7b: 4096).
    let r = plan_json(&[&["--no-data"], &shape[..]].concat());
    assert_eq!(u(&r["seq_len"]), 4096);
    let o = plan(&[&["--no-data"], &shape[..], &["train.objective=\"dpo\""]].concat());
    assert!(!o.status.success() && stderr(&o).contains("preference pairs"), "{}", stderr(&o));
}
