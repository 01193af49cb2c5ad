//! The memory plan at its limits: absurd shapes are refused from their
//! counts (nothing of their size is ever allocated, `plan` stays small),
//! a run near its memory limit is refused before it starts or ends with a
//! clear out-of-memory error — never the allocator's abort (SIGABRT, exit
//! 134) —, and a checkpoint survives a resume that does not fit.

mod common;

use common::{bin, stderr, tmp};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

const BIN: &str = env!("CARGO_BIN_EXE_macrobatch");

/// `macrobatch ARGS` under `ulimit -v KIB` (address space, KiB).
fn under_limit(kib: u64, args: &[&str]) -> Output {
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {kib} && exec '{BIN}' {}", quoted.join(" ")))
        .output()
        .expect("sh runs")
}

fn sets(list: &[&str]) -> Vec<String> {
    list.iter().flat_map(|s| ["--set".to_string(), s.to_string()]).collect()
}

/// Exit code of a process that ran out of memory (`heap::EXIT_OUT_OF_MEMORY`).
const EXIT_OUT_OF_MEMORY: i32 = 3;

/// A failure that says what happened: exit 2 (refused by the plan) or 3
/// (out of memory, reported), never a signal (SIGABRT is 134 from a shell).
fn assert_clean_failure(o: &Output, what: &str) {
    let err = stderr(o);
    let code = o.status.code();
    assert!(matches!(code, Some(2) | Some(EXIT_OUT_OF_MEMORY)), "{what}: exit {:?} (not 2 or 3): {err}", o.status);
    assert!(!err.contains("memory allocation of"), "{what}: the allocator's abort message: {err}");
    assert!(
        err.contains("needs at least") || err.contains("out of memory while") || err.contains("cannot allocate"),
        "{what}: no clear memory error: {err}"
    );
}

#[test]
fn absurd_shapes_are_refused_fast_without_allocating() {
    let out = tmp("absurd");
    let out_s = out.display().to_string();
    for shape in [
        &["model.n_layer=10000000"][..],
        &["model.n_layer=1000000000"],
        &["model.n_embd=1000000000000", "model.n_head=1"],
        &["model.n_embd=1048576", "model.n_head=1048576", "model.vocab_size=2000000000"],
        &["model.family=llama", "model.n_layer=1000000000"],
        &["model.family=llama", "model.preset=llama-70b", "model.n_embd=8388608", "model.n_head=64"],
    ] {
        for cmd in [&["plan", "--memory", "80GiB"][..], &["train", "--out", &out_s]] {
            let mut args: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
            args.extend(sets(shape));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let t0 = Instant::now();
            // 1 GB of address space: any buffer of the shape's size would abort.
            let o = under_limit(1_000_000, &args);
            let secs = t0.elapsed().as_secs_f64();
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{args:?}: {:?} {err}", o.status);
            assert!(err.contains("more layers than macrobatch lays out") || err.contains("2^48"), "{args:?}: {err}");
            assert!(secs < 20.0, "{args:?} took {secs:.1}s");
            assert!(!out.exists(), "{args:?}: nothing created");
        }
    }
}

/// Peak resident set (KiB) of `macrobatch ARGS`, from the kernel's
/// accounting of the waited-for child (wait4's rusage; it also holds what
/// the spawning test process had resident, which stays small here).
fn peak_rss_kib(args: &[&str]) -> (i32, i64) {
    let child = bin().args(args).stdout(std::process::Stdio::null()).spawn().expect("binary runs");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain wait4 on our own child, with out-parameters we own.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4");
    std::mem::forget(child); // already reaped
    (libc::WEXITSTATUS(status), usage.ru_maxrss)
}

#[test]
fn plan_stays_small_for_the_largest_shapes() {
    for shape in [
        &["model.n_layer=5461", "batch.global=64"][..],
        &["model.family=llama", "model.n_layer=7281", "batch.global=64"],
        &["model.family=llama", "model.preset=llama-70b", "data.seq_len=4096", "batch.micro=1", "batch.global=128"],
        &[
            "model.family=llama",
            "model.preset=llama-70b",
            "batch.micro=1",
            "batch.global=128",
            "dist.pipeline_parallel=8",
        ],
        &["model.n_embd=1048576", "model.n_head=1", "batch.global=64"],
    ] {
        let mut args = vec!["plan".to_string(), "--memory".into(), "80GiB".into(), "--world-size".into(), "8".into()];
        args.extend(sets(shape));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, kib) = peak_rss_kib(&args);
        assert_eq!(code, 0, "{args:?}");
        assert!(kib < 100 * 1024, "{args:?}: plan peaked at {kib} KiB");
    }
}

/// A run that needs ~0.3 GB (12.8 M parameters, tiny activations) and
/// takes a second: its step and its save phase both sit inside the sweep.
const NEAR: &[&str] = &[
    "model.n_layer=4",
    "model.n_embd=512",
    "model.n_head=8",
    "model.block_size=64",
    "data.seq_len=64",
    "batch.micro=1",
    "batch.global=1",
    "schedule.warmup_steps=0",
];

#[test]
fn near_the_memory_limit_a_run_is_refused_or_reports_out_of_memory() {
    let out = tmp("near-limit");
    let (mut refused, mut finished) = (0, 0);
    // From well below the need to well above it (KiB of address space).
    for kib in (300_000..=1_300_000).step_by(50_000) {
        let _ = std::fs::remove_dir_all(&out);
        let mut args = vec!["train".to_string(), "--out".into(), out.display().to_string()];
        args.extend(sets(&[NEAR, &["train.steps=1"]].concat()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = under_limit(kib, &args);
        if o.status.success() {
            finished += 1;
            assert!(out.join("model.safetensors").exists(), "ulimit -v {kib}: finished without the model");
        } else {
            refused += 1;
            assert_clean_failure(&o, &format!("ulimit -v {kib}"));
        }
    }
    assert!(refused > 0 && finished > 0, "the sweep spans the need: {refused} refused, {finished} finished");
    let _ = std::fs::remove_dir_all(&out);
}

/// Every file below `dir` with a hash of its bytes (read in pieces: the
/// test process stays small, and its children's peak RSS with it).
fn snapshot(dir: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("readable") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.display().to_string(), hash_file(&p)));
            }
        }
    }
    out.sort();
    out
}

fn hash_file(path: &Path) -> u64 {
    use std::hash::Hasher;
    use std::io::Read;
    let mut f = std::fs::File::open(path).expect("readable");
    let (mut h, mut buf) = (std::hash::DefaultHasher::new(), vec![0u8; 1 << 16]);
    loop {
        let n = f.read(&mut buf).expect("readable");
        if n == 0 {
            return h.finish();
        }
        h.write(&buf[..n]);
    }
}

#[test]
fn a_resume_that_does_not_fit_keeps_the_checkpoint() {
    let out = tmp("resume-limit");
    let out_s = out.display().to_string();
    let mut args = vec!["train".to_string(), "--out".into(), out_s.clone(), "--stop-after".into(), "1".into()];
    args.extend(sets(&[NEAR, &["train.steps=2"]].concat()));
    let o = bin().args(&args).output().expect("binary runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let checkpoints = out.join("checkpoints");
    let before = snapshot(&checkpoints);
    assert!(!before.is_empty());
    // Tight limits: each resume is refused or reports out of memory, and
    // leaves the checkpoint as it was.
    for kib in (100_000..=450_000).step_by(50_000) {
        let o = under_limit(kib, &["train", "--resume", &out_s]);
        assert!(!o.status.success(), "ulimit -v {kib}: a resume this tight cannot fit");
        assert_clean_failure(&o, &format!("resume under ulimit -v {kib}"));
        assert!(snapshot(&checkpoints) == before, "ulimit -v {kib}: the checkpoint changed");
    }
    // With room, the same checkpoint resumes and the run finishes.
    let o = bin().args(["train", "--resume", &out_s]).output().expect("binary runs");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("model.safetensors").exists());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn running_out_of_memory_mid_run_is_reported_and_keeps_the_checkpoint() {
    let out = tmp("oom-report");
    let out_s = out.display().to_string();
    let mut args = vec!["train".to_string(), "--out".into(), out_s.clone(), "--stop-after".into(), "1".into()];
    args.extend(sets(&[common::SMALL, &["train.steps=3"]].concat()));
    let o = bin().args(&args).output().expect("binary runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let checkpoints = out.join("checkpoints");
    let before = snapshot(&checkpoints);
    // Step 2 asks for 64 TiB more, infallibly (as a kernel's buffer would).
    let o = bin()
        .args(["train", "--resume", &out_s])
        .env("MACROBATCH_FAULT", format!("kind=oom,step=2,bytes={}", 1u64 << 46))
        .output()
        .expect("binary runs");
    assert_eq!(o.status.code(), Some(EXIT_OUT_OF_MEMORY), "{:?}: {}", o.status, stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("out of memory while an optimizer step") && err.contains("70368744177664 more bytes"),
        "{err}"
    );
    assert!(err.contains("lower batch.micro") && err.contains("--resume"), "{err}");
    assert!(!err.contains("memory allocation of"), "{err}");
    assert!(snapshot(&checkpoints) == before, "the checkpoint of step 1 is intact");
    let _ = std::fs::remove_dir_all(&out);
}

fn plan_json(args: &[&str]) -> serde_json::Value {
    let o = bin().arg("plan").arg("--json").args(args).output().expect("binary runs");
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("JSON")
}

#[test]
fn plan_memory_shares_and_base_batch_agree_with_the_config() {
    // `--memory 0.5` is half of what is available, as train.memory_budget = 0.5 is.
    let half = plan_json(&["--memory", "0.5"]);
    let all = plan_json(&[]);
    let (h, a) = (half["memory"].as_u64().unwrap(), all["memory"].as_u64().unwrap());
    assert!(h > 0 && (h as f64 / a as f64 - 0.5).abs() < 0.05, "--memory 0.5: {h} of {a}");
    let o = bin().args(["plan", "--memory", "99999999999999999999999"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("16 EiB"), "{}", stderr(&o));
    // --base-batch 0 is refused, not silently dropped.
    let o = bin().args(["plan", "--memory", "8GiB", "--base-batch", "0"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--base-batch"), "{}", stderr(&o));
}

#[test]
fn plan_does_not_need_a_global_batch_of_data() {
    // The bundled corpus holds ~1,100 sequences of 1024 tokens.
    let r = plan_json(&["--memory", "80GiB", "--set", "model.preset=gpt2", "--set", "batch.global=4096"]);
    assert_eq!(r["global_batch"], 4096);
    let o = common::train(&tmp("no-full-batch"), &["model.preset=gpt2", "batch.global=4096", "train.steps=1"]);
    assert!(stderr(&o).contains("one global batch needs 4096"), "train still checks it: {}", stderr(&o));
}

#[test]
fn auto_micro_in_plan_follows_world_size_and_memory() {
    let shape = ["--set", "model.preset=gpt2", "--set", "data.seq_len=1024", "--set", "batch.global=512"];
    let at = |memory: &str| {
        let mut a = vec!["--world-size", "8", "--memory", memory, "--set", "batch.micro=auto"];
        a.extend(shape);
        plan_json(&a)
    };
    let (big, small) = (at("80GiB"), at("8GiB"));
    for r in [&big, &small] {
        let k = &r["configured"]["knobs"];
        assert_eq!((k["world_size"].as_u64(), k["ranks_per_process"].as_u64()), (Some(8), Some(1)), "{k}");
        assert_eq!(r["auto_micro"], true);
        // "auto" is the plan's own choice for that memory.
        assert_eq!(r["configured"]["knobs"]["micro"], r["best"]["knobs"]["micro"], "{r}");
    }
    let micro = |r: &serde_json::Value| r["configured"]["knobs"]["micro"].as_u64().unwrap();
    assert!(micro(&big) > micro(&small), "80 GiB: micro {}, 8 GiB: micro {}", micro(&big), micro(&small));
}

#[test]
fn auto_micro_errors_name_auto_and_keep_the_margin() {
    let out = tmp("auto-errors");
    // No micro-batch keeps the global batch: the error names "auto", not micro 1.
    let o = common::train(&out, &["batch.micro=auto", "batch.global=15", "dist.world_size=2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("batch.micro = \"auto\""), "{}", stderr(&o));
    // A budget below the margin: refused before anything exists, not after a step.
    let o = common::train(&out, &["batch.micro=auto", "train.memory_budget=30MiB", "train.steps=1"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("not even micro-batch 1 fits") && !err.contains("first step peaked"), "{err}");
    assert!(!out.exists());
    // A budget above what is available plans for what is available: the
    // memory check passes (the injected fault then stops the run at step 1).
    let o = bin()
        .args(["train", "--out", &out.display().to_string()])
        .args(sets(&["model.preset=small", "batch.micro=auto", "batch.global=1024", "train.memory_budget=1TiB"]))
        .env("MACROBATCH_FAULT", "kind=error,step=1")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(err.contains("more than the") && err.contains("planning for what is available"), "{err}");
    assert!(!err.contains("needs at least"), "auto chose what the memory check refuses: {err}");
    let _ = std::fs::remove_dir_all(&out);
}
