//! `macrobatch plan` with pipeline parallelism: every stage of Llama 2 70B
//! planned from its shape (nothing of its size allocated), the rank layout
//! and the bubble, ZeRO-1 over the data ranks of a stage, and bad pipelines
//! refused with the key that is wrong.

mod common;
mod plan_common;

use common::stderr;
use plan_common::{plan, plan_json, u, LLAMA_70B};

#[test]
fn llama_70b_on_8_stages_and_on_4_stages_by_2_data_ranks() {
    let r = plan_json(&[LLAMA_70B, &["dist.pipeline_parallel=8"]].concat());
    let n = u(&r["n_params"]);
    let p = &r["pipeline"];
    assert_eq!((u(&p["stages"]), u(&p["data_parallel"]), u(&p["micro_batches"])), (8, 1, 128), "{p}");
    assert_eq!(p["schedule"], "1f1b");
    assert!((p["bubble"].as_f64().unwrap() - 7.0 / 135.0).abs() < 1e-9, "{p}");
    let stages = p["per_stage"].as_array().unwrap();
    assert_eq!(stages.len(), 8);
    // Untied: every parameter on exactly one stage; 10 layers each.
    assert_eq!(stages.iter().map(|e| u(&e["stage_params"])).sum::<u64>(), n);
    for (s, e) in stages.iter().enumerate() {
        assert_eq!((u(&e["blocks"][0]), u(&e["blocks"][1])), (10 * s as u64, 10 * s as u64 + 10));
        assert_eq!(u(&e["in_flight"]), 8 - s as u64, "1F1B: P − s micro-batches on stage {s}");
    }
    // The configured estimate is the peak stage's (1F1B: stage 0, the most
    // micro-batches in flight); its first rank is stage · D.
    assert_eq!(u(&p["peak_stage"]), 0);
    assert_eq!(r["configured"], stages[0]);
    assert_eq!(u(&p["peak_rank"]), u(&p["peak_stage"]));

    let r2 = plan_json(&[LLAMA_70B, &["dist.pipeline_parallel=4", "dist.zero_stage=1"]].concat());
    let p2 = &r2["pipeline"];
    assert_eq!((u(&p2["stages"]), u(&p2["data_parallel"]), u(&p2["micro_batches"])), (4, 2, 64), "{p2}");
    assert_eq!(u(&p2["peak_rank"]), 2 * u(&p2["peak_stage"]));
    let s8 = &stages[0];
    let s4 = &p2["per_stage"][0];
    // Twice the layers per stage; ZeRO-1 shards the stage's AdamW state
    // (8 bytes a parameter) over its 2 data ranks (up to the segments' padding).
    assert_eq!(u(&s4["stage_params"]) - u(&s8["stage_params"]), u(&stages[1]["stage_params"]));
    let ratio = u(&s4["optimizer"]) as f64 / (4 * u(&s4["stage_params"])) as f64;
    assert!((ratio - 1.0).abs() < 1e-6, "ZeRO-1 optimizer state per rank: {ratio}");
    assert_eq!(u(&s8["optimizer"]), 8 * u(&s8["stage_params"]));
    // The text names the rank layout and every stage.
    let o = plan(&[LLAMA_70B, &["dist.pipeline_parallel=4", "dist.zero_stage=1"]].concat());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("pipeline: 4 stages × 2 data ranks (rank = stage · 2 + d)"), "{text}");
    assert!(text.contains("bubble (P−1)/(K+P−1) = 0.045"), "{text}");
    assert!(text.contains("peak: stage"), "{text}");
}

#[test]
fn gpipe_keeps_every_micro_batch_on_every_stage() {
    let sets = ["model.preset=mini", "batch.micro=1", "batch.global=8", "--world-size", "4", "--memory", "8GiB"];
    let f = plan_json(&[&sets[..], &["dist.pipeline_parallel=4"]].concat());
    let g = plan_json(&[&sets[..], &["dist.pipeline_parallel=4", "dist.pipeline_schedule=\"gpipe\""]].concat());
    let act = |r: &serde_json::Value, s: usize| u(&r["pipeline"]["per_stage"][s]["activations"]) as f64;
    for s in 0..4 {
        assert_eq!(u(&g["pipeline"]["per_stage"][s]["in_flight"]), 8);
        assert!(act(&g, s) > act(&f, s), "stage {s}");
    }
    // Stage 0: 1F1B keeps P = 4 of GPipe's K = 8 micro-batches.
    let ratio = act(&f, 0) / act(&g, 0);
    assert!((ratio - 0.5).abs() < 0.1, "1F1B / GPipe activations on stage 0: {ratio}");
}

#[test]
fn bad_pipelines_are_refused_naming_the_key() {
    for (world, sets, want) in [
        // P does not divide the world.
        ("6", &["dist.pipeline_parallel=4"][..], &["dist.pipeline_parallel", "world size 6"][..]),
        // More stages than layers: partition_layers' error.
        ("8", &["model.n_layer=4", "dist.pipeline_parallel=8"], &["8 stages", "4 layers"]),
        // A cut that does not sum to the model's layers.
        (
            "2",
            &["model.n_layer=4", "dist.pipeline_parallel=2", "dist.pipeline_layers=[1, 1]"],
            &["pipeline_layers", "4 layers"],
        ),
    ] {
        let base = ["--world-size", world, "--memory", "8GiB", "batch.global=24", "batch.micro=1"];
        let o = plan(&[&base[..], sets].concat());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{sets:?}: {err}");
        assert!(want.iter().all(|w| err.contains(w)), "{sets:?}: {err}");
    }
}
