//! End-to-end: the `macrobatch` binary on the bundled corpus, its files, its
//! determinism, and its errors on bad input.

mod common;

use common::*;

#[test]
fn default_run_learns_and_writes_hugging_face_files() {
    let out = tmp("e2e");
    let o = train(&out, &["train.steps=30", "train.eval_every=10"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(&out);
    assert_eq!(m.len(), 30, "one line per optimizer step");
    for (i, r) in m.iter().enumerate() {
        assert_eq!(r["step"], i as u64 + 1);
        for key in ["loss", "lr", "grad_norm", "tokens", "tokens_per_s", "micro_steps"] {
            assert!(r.get(key).is_some(), "missing {key} in {r}");
        }
        assert_eq!(r["micro_steps"], 2, "default batch: global 16 = micro 8 × K 2");
        assert_eq!(r["comm_s"], 0.0, "one rank: no time in collectives");
    }
    let val: Vec<f64> = m.iter().filter_map(|r| r["val_loss"].as_f64()).collect();
    assert_eq!(val.len(), 3, "validation at steps 10, 20, 30");
    eprintln!("val_loss: {val:?}");
    assert!(val[2] < val[0] && val[0] < 5.0, "validation loss must fall: {val:?}");
    assert!(val[2] < 3.0, "byte-level loss after 30 steps should be well below ln(256) = 5.55: {val:?}");
    for f in ["model.safetensors", "config.json", "config.resolved.toml"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let resolved = std::fs::read_to_string(out.join("config.resolved.toml")).unwrap();
    assert!(resolved.contains("accumulation_steps = 2") && resolved.contains("steps = 30"), "{resolved}");

    let g = bin().arg("generate").arg(&out).args(["--prompt", "Call me", "--max-new-tokens", "20"]).output().unwrap();
    assert!(g.status.success(), "{}", stderr(&g));
    let text = String::from_utf8_lossy(&g.stdout);
    assert!(text.starts_with("Call me") && text.len() > "Call me".len(), "{text}");

    // An existing run is never overwritten.
    let again = train(&out, &["train.steps=1"]);
    assert!(!again.status.success());
    assert!(stderr(&again).contains("already holds a run"), "{}", stderr(&again));
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn same_seed_and_config_give_bit_identical_losses() {
    let runs: Vec<Vec<(String, String)>> = ["a", "b"]
        .iter()
        .map(|tag| {
            let out = tmp(&format!("det-{tag}"));
            let mut sets = SMALL.to_vec();
            sets.extend(["batch.micro=4", "train.steps=6", "train.eval_every=3", "batch.accumulation_steps=3"]);
            let o = train(&out, &sets);
            assert!(o.status.success(), "{}", stderr(&o));
            let losses = metrics(&out).iter().map(|r| (r["loss"].to_string(), r["val_loss"].to_string())).collect();
            std::fs::remove_dir_all(&out).unwrap();
            losses
        })
        .collect();
    assert_eq!(runs[0].len(), 6);
    assert_eq!(runs[0], runs[1], "loss values must match bit for bit");
}

/// Runs `train` with the given overrides and returns stderr, asserting a clean
/// non-zero exit (2) rather than a panic (101).
fn expect_error(tag: &str, sets: &[&str]) -> String {
    let out = tmp(tag);
    let o = train(&out, sets);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{tag}: {err}");
    assert!(!err.contains("panicked"), "{tag}: {err}");
    assert!(!out.join("metrics.jsonl").exists(), "{tag}: nothing runs before the whole plan is valid");
    let _ = std::fs::remove_dir_all(&out);
    err
}

#[test]
fn bad_input_gives_a_clear_error_and_no_panic() {
    let dir = tmp("inputs");
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "a short corpus").unwrap();
    let (empty_set, short_set) = (format!("data.path={}", empty.display()), format!("data.path={}", short.display()));
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        ("unknown-key", vec!["train.stepz=3"], "unknown field `stepz`"),
        ("unknown-section", vec!["trian.steps=3"], "unknown field `trian`"),
        ("inconsistent", vec!["batch.global=32", "batch.micro=4", "batch.accumulation_steps=3"], "4 × 3 × 1 = 12 ≠ 32"),
        ("indivisible", vec!["batch.global=30", "batch.micro=4"], "not divisible"),
        ("zero-micro", vec!["batch.micro=0"], "batch.micro must be at least 1"),
        ("negative", vec!["batch.micro=-4"], "micro = -4"),
        ("zero-steps", vec!["train.steps=0"], "train.steps = 0"),
        ("missing-file", vec!["data.path=/no/such/corpus.txt"], "/no/such/corpus.txt"),
        ("empty-corpus", vec![empty_set.as_str()], "is empty"),
        ("short-corpus", vec![short_set.as_str(), "data.seq_len=64"], "too few for one sequence of data.seq_len = 64"),
        ("seq-vs-block", vec!["data.seq_len=4096"], "longer than the model's context of 128 tokens"),
        ("bad-precision", vec!["train.precision=fp8"], "expected one of `f32`, `bf16`, `f16`"),
        ("bad-checkpointing", vec!["train.activation_checkpointing=every_0"], "every_N\" with N >= 2"),
        ("bad-family", vec!["model.family=bert"], "model.family = \"bert\" is not a family macrobatch knows"),
        ("family-key", vec!["model.n_kv_head=2"], "model.n_kv_head does not apply to model.family = \"gpt2\""),
        ("bad-heads", vec!["model.n_head=5"], "divisible by model.n_head (5)"),
        ("bad-preset", vec!["model.preset=huge"], "unknown preset `huge`"),
        ("huge-batch", vec!["batch.global=100000", "batch.micro=1000"], "one global batch needs 100000"),
    ];
    for (tag, sets, needle) in cases {
        let err = expect_error(tag, &sets);
        assert!(err.contains(needle), "{tag}: expected `{needle}` in: {err}");
    }
    // A config file that does not exist.
    let o = bin().args(["train", "/no/such/config.toml"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("/no/such/config.toml"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_from_a_missing_directory_is_a_clear_error() {
    let o = bin().args(["generate", "/no/such/run"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("/no/such/run") && !err.contains("panicked"), "{err}");
}

#[test]
fn bench_reports_speed_memory_and_the_k_sweep_as_json() {
    let mut c = bin();
    c.args(["bench", "--json", "--steps", "2", "--warmup", "1"]);
    let mut sets = SMALL.to_vec();
    sets.extend(["batch.global=8", "batch.micro=4"]);
    with_sets(&mut c, &sets);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    for key in ["ms_median", "ms_min", "ms_max", "tokens_per_s", "gflops", "overhead_pct", "saved_activation_bytes"] {
        assert!(r["step"][key].as_f64().is_some(), "step.{key} missing: {r}");
    }
    assert!(r["mfu_gemm_pct"].as_f64().unwrap() > 0.0);
    let ks: Vec<u64> = r["k_sweep"].as_array().unwrap().iter().map(|e| e[0].as_u64().unwrap()).collect();
    assert_eq!(ks, vec![1, 2, 4, 8]);
    assert_eq!(r["k_sweep"][0][1].as_f64(), Some(1.0));
    // Each K's rounds bracket its median ratio.
    for (k, spread) in r["k_sweep"].as_array().unwrap().iter().zip(r["k_sweep_spread"].as_array().unwrap()) {
        let (m, lo, hi) = (k[1].as_f64().unwrap(), spread[1].as_f64().unwrap(), spread[2].as_f64().unwrap());
        assert!(lo <= m && m <= hi, "K {k}: median {m} outside its rounds {lo}–{hi}");
    }
    // Where the step's time goes: the kernel families a GPT-2 step runs
    // (two blocks of 2 micro-steps: 2 × 2 attention forwards and
    // backwards), and the rest as `other`, adding up to the step.
    let rows = r["profile"].as_array().unwrap();
    let get = |kind: &str| rows.iter().find(|p| p["kind"] == kind).unwrap_or_else(|| panic!("no {kind} in {rows:?}"));
    for kind in ["linear", "attention", "norm", "activation", "cross-entropy", "embedding", "optimizer", "other"] {
        assert!(get(kind)["ms_per_step"].as_f64().unwrap() >= 0.0);
    }
    assert_eq!(get("attention")["calls_per_step"].as_f64(), Some(8.0), "{rows:?}");
    assert_eq!(get("optimizer")["calls_per_step"].as_f64(), Some(1.0));
    let total: f64 = rows.iter().map(|p| p["ms_per_step"].as_f64().unwrap()).sum();
    let step = r["step"]["ms_mean"].as_f64().unwrap();
    assert!(total >= step * (1.0 - 1e-9), "the families and `other` cover the step: {total} vs {step}");
    let pct: f64 = rows.iter().map(|p| p["step_pct"].as_f64().unwrap()).sum();
    assert!((pct - 100.0).abs() < 1e-6 || total > step, "shares of the mean step add to 100%: {pct}");
}
