//! Pipeline parallelism through the CLI: a P × D run equals the D-rank
//! data-parallel run (losses to 1e-6 relative — the stages sum the same
//! gradients, the tied embedding's two halves added between the first and
//! the last stage instead of in one buffer, so last bits may differ), its
//! checkpoints resume at another pipeline width, its metrics carry the
//! schedule's bubble and each stage's idle time, and bad settings are
//! refused before any folder exists.

mod common;

use common::*;
use std::path::Path;

/// Relative tolerance on losses and weights between layouts.
const TOL: f64 = 1e-6;

/// GPT-2 with 4 layers (tied head), K = 4 micro-batches of 2.
fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = vec![
        "model.n_layer=4",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "batch.micro=2",
        "batch.accumulation_steps=4",
        "train.steps=4",
        "train.eval_every=2",
        "train.threads=1",
    ];
    s.extend_from_slice(extra);
    s
}

fn assert_close(what: &str, a: &[f64], b: &[f64]) {
    assert_close_rel(what, a, b, TOL);
}

fn assert_weights_close(what: &str, a: &Path, b: &Path) {
    let (wa, wb) = (weights(a), weights(b));
    let d = max_diff(&wa, &wb);
    assert!(f64::from(d) <= TOL * f64::from(max_abs(&wb)), "{what}: weights differ by {d}");
}

#[test]
fn two_stages_by_two_data_ranks_equal_two_data_ranks_under_both_schedules() {
    let base = tmp("pipe-base");
    train_ok(&base, &sets(&["dist.world_size=2"]));
    for schedule in ["1f1b", "gpipe"] {
        let out = tmp(&format!("pipe-{schedule}"));
        let kind = format!("dist.pipeline_schedule=\"{schedule}\"");
        let err = train_ok(&out, &sets(&["dist.world_size=4", "dist.pipeline_parallel=2", &kind]));
        assert!(
            err.contains(&format!(
                "pipeline: P=2 ({schedule}, layers 0-1 | 2-3), data parallel D=2; rank r = stage·2 + data"
            )),
            "{err}"
        );
        assert!(err.contains("stage 1 (slots") && err.contains("× D 2"), "the schedule's timeline and D: {err}");
        assert_close(&format!("{schedule}: loss"), &losses(&out), &losses(&base));
        assert_close(&format!("{schedule}: val_loss"), &val_losses(&out), &val_losses(&base));
        assert_eq!(val_losses(&out).len(), 2);
        assert_weights_close(schedule, &out, &base);
        for r in metrics(&out) {
            // (P − 1) / (K + P − 1) with P = 2, K = 4.
            assert!((r["pipeline_bubble"].as_f64().unwrap() - 0.2).abs() < 1e-12, "{r}");
            let idle = r["pipeline_idle_s"].as_array().expect("idle per stage");
            assert_eq!(idle.len(), 2, "{r}");
            assert!(idle.iter().all(|t| t.as_f64().is_some_and(|t| t >= 0.0)), "{r}");
            assert!(r["p2p_bytes"].as_u64().unwrap() > 0, "stage 0 sends activations: {r}");
        }
        let mem: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("memory.json")).unwrap()).unwrap();
        let stages: Vec<u64> =
            mem["ranks"].as_array().unwrap().iter().map(|r| r["pipeline_stage"].as_u64().unwrap()).collect();
        assert_eq!(stages, [0, 0, 1, 1], "rank = stage · D + data: {mem}");
        let _ = std::fs::remove_dir_all(&out);
    }
    // Without a pipeline the metrics and memory.json say nothing about one.
    let m = &metrics(&base)[0];
    assert!(m.get("pipeline_bubble").is_none() && m.get("p2p_bytes").is_none(), "{m}");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn zero_1_and_disk_offload_compose_with_a_pipeline() {
    let base = tmp("pipe-z1-base");
    train_ok(&base, &sets(&["dist.world_size=2", "dist.zero_stage=1"]));
    let out = tmp("pipe-z1");
    let stages =
        ["dist.world_size=4", "dist.pipeline_parallel=2", "dist.zero_stage=1", "dist.offload_optimizer=\"disk\""];
    train_ok(&out, &sets(&stages));
    assert_close("ZeRO-1 + offload: loss", &losses(&out), &losses(&base));
    assert_weights_close("ZeRO-1 + offload", &out, &base);
    assert!(!out.join("offload").exists(), "the offload folder is removed at the end");
    let _ = (std::fs::remove_dir_all(&base), std::fs::remove_dir_all(&out));
}

/// Saved at step 3 under `before`, resumed to step 6 under `after`: steps
/// 4–6 equal an uninterrupted run without a pipeline (within [`TOL`]); all
/// three runs add `common` (the uninterrupted one after `dist.world_size=1`).
fn resume_across(tag: &str, common: &[&str], before: &[&str], after: &[&str]) {
    let six = [&["train.steps=6", "train.eval_every=0"][..], common].concat();
    let straight = tmp(&format!("pipe-straight-{tag}"));
    train_ok(&straight, &sets(&[&["dist.world_size=1"][..], &six[..]].concat()));
    let out = tmp(&format!("pipe-resumed-{tag}"));
    let mut c = train_cmd(&out, &sets(&[&six[..], before].concat()));
    let o = c.args(["--stop-after", "3"]).output().unwrap();
    assert!(o.status.success() && stderr(&o).contains("stopped after step 3"), "{}", stderr(&o));
    let err = resume_ok(&out, after);
    assert!(err.contains("step-00000003"), "{err}");
    let (got, want) = (losses(&out), losses(&straight));
    assert_eq!(got.len(), 6);
    assert_close(&format!("{tag}: steps 4-6"), &got[3..], &want[3..]);
    assert_weights_close(tag, &out, &straight);
    let _ = (std::fs::remove_dir_all(&straight), std::fs::remove_dir_all(&out));
}

#[test]
fn a_checkpoint_resumes_at_another_pipeline_width() {
    // Saved by 2 stages, continued by one rank; saved by one, continued by 4 stages.
    resume_across(
        "p2-to-p1",
        &[],
        &["dist.world_size=2", "dist.pipeline_parallel=2"],
        &["dist.world_size=1", "dist.pipeline_parallel=1"],
    );
    resume_across(
        "p1-to-p4",
        &[],
        &["dist.world_size=1"],
        &["dist.world_size=4", "dist.pipeline_parallel=4", "dist.pipeline_schedule=\"gpipe\""],
    );
}

/// Adafactor's checkpoint holds each tensor's statistics inside the
/// tensor's own range, so a pipeline cut, a ZeRO shard and an offloaded
/// first moment all save and restore the same buffer: saved by 2 stages ×
/// 2 data ranks at ZeRO-1 with the first moment on disk, continued by 2
/// data ranks at ZeRO-0; and back (the same global batch throughout). The
/// attention's query/key/value biases stay frozen: the key bias's gradient
/// is zero but for rounding (softmax ignores a constant per query), and
/// Adafactor's `g/√(g² + eps1)` turns that noise into steps of the full
/// learning rate whose signs differ between layouts (0.004 after 6 steps).
#[test]
fn adafactor_state_resumes_across_pipeline_widths_and_zero_stages() {
    let ada = [
        "optim.name=\"adafactor\"",
        "optim.adafactor.beta1=0.9",
        "optim.lr=0.01",
        "dist.world_size=2",
        "train.trainable=[\"*weight\", \"*c_proj.bias\", \"*c_fc.bias\"]",
    ];
    let sharded =
        ["dist.world_size=4", "dist.pipeline_parallel=2", "dist.zero_stage=1", "dist.offload_optimizer=\"disk\""];
    let plain =
        ["dist.world_size=2", "dist.pipeline_parallel=1", "dist.zero_stage=0", "dist.offload_optimizer=\"none\""];
    resume_across("ada-p2z1-to-p1", &ada, &sharded, &plain);
    resume_across("ada-p1-to-p2z1", &ada, &plain, &sharded);
}

/// A refused run: non-zero exit, `needles` in the message, no folder.
fn refused(tag: &str, config: Option<&Path>, s: &[&str], needles: &[&str]) {
    refused_train(&format!("pipe-{tag}"), config, s, needles);
}

#[test]
fn bad_pipeline_settings_are_named_before_anything_is_created() {
    refused(
        "divide",
        None,
        &sets(&["dist.world_size=3", "dist.pipeline_parallel=2"]),
        &["dist.pipeline_parallel = 2", "world size 3 (dist.world_size)"],
    );
    refused(
        "stages",
        None,
        &sets(&["model.n_layer=2", "dist.world_size=4", "dist.pipeline_parallel=4"]),
        &["dist.pipeline_parallel = 4 stages for a model of 2 layers", "use at most 2 stages"],
    );
    refused(
        "zero3",
        None,
        &sets(&["dist.world_size=2", "dist.pipeline_parallel=2", "dist.zero_stage=3"]),
        &["dist.zero_stage = 3", "set dist.zero_stage = 1 or dist.pipeline_parallel = 1"],
    );
    refused(
        "layers-sum",
        None,
        &sets(&["dist.world_size=2", "dist.pipeline_parallel=2", "dist.pipeline_layers=[1, 2]"]),
        &["dist.pipeline_layers = [1, 2]", "the model's 4 layers"],
    );
    refused(
        "layers-len",
        None,
        &sets(&["dist.world_size=2", "dist.pipeline_parallel=2", "dist.pipeline_layers=[4]"]),
        &["dist.pipeline_layers", "2 of them (dist.pipeline_parallel)"],
    );
    // DeepSpeed counts the data-parallel ranks: 16 = 2 × 4 × D needs D = 2,
    // but 2 ranks in 2 stages leave D = 1.
    let dir = tmp("pipe-ds");
    std::fs::create_dir_all(&dir).unwrap();
    let ds = dir.join("ds.json");
    std::fs::write(
        &ds,
        r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}"#,
    )
    .unwrap();
    refused(
        "deepspeed",
        Some(&ds),
        &["dist.world_size=2", "dist.pipeline_parallel=2"],
        &[
            "train_batch_size 16 = 2 × 4 × world needs world 2, but world is 1",
            "dist.pipeline_parallel 2 stages: the data-parallel ranks",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}
