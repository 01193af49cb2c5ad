//! Reliability: nothing left behind, nothing adopted by mistake,
//! no abort. One test per hostile case, plus a kill -9 crash-consistency test
//! and a full-disk test (ENOSPC injected by MACROBATCH_FAULT=kind=enospc: a
//! tmpfs mount is not available in every CI container).

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn ok(o: Output) -> String {
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    err
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|e| e.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn steps_of(dir: &Path) -> Vec<String> {
    names(&dir.join("checkpoints")).into_iter().filter(|n| n.starts_with("step-")).collect()
}

/// Every leftover of an interrupted write in a run folder.
fn leftovers(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = names(dir).into_iter().filter(|n| n.contains(".tmp-")).collect();
    v.extend(
        names(&dir.join("checkpoints"))
            .into_iter()
            .filter(|n| n.starts_with(".tmp-") || n.starts_with(".old-") || n.contains(".tmp-")),
    );
    v
}

/// Every line of metrics.jsonl is a whole JSON object ending in a newline.
fn assert_metrics_whole(dir: &Path) -> usize {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert!(text.is_empty() || text.ends_with('\n'), "torn last line: {:?}", text.lines().last());
    for l in text.lines() {
        serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("torn line {l:?}: {e}"));
    }
    text.lines().count()
}

fn bytes_of(path: PathBuf) -> Vec<u8> {
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

// 1. Leftovers of killed writes are removed on start; an interrupted replacement is restored.
#[test]
fn leftovers_of_killed_writes_are_cleaned_and_an_interrupted_replacement_restored() {
    let dir = tmp("leftovers");
    ok(train(&dir, &tiny(&["train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=0"])));
    let ck = dir.join("checkpoints");
    // What kill -9 leaves: an unfinished checkpoint of another PID, a temp file
    // of write_atomic, and step 4 caught between the two renames of a replacement.
    std::fs::create_dir_all(ck.join(".tmp-step-00000006-99999")).unwrap();
    std::fs::write(ck.join(".tmp-step-00000006-99999").join("model.safetensors"), b"partial").unwrap();
    std::fs::write(dir.join(".metrics.jsonl.tmp-4242"), b"partial").unwrap();
    std::fs::write(ck.join(".manifest.json.tmp-4243"), b"partial").unwrap();
    std::fs::rename(ck.join("step-00000004"), ck.join(".old-step-00000004-31337")).unwrap();
    let err = ok(resume(&dir, &["train.steps=5"]));
    assert!(err.contains("removed unfinished checkpoint") && err.contains(".tmp-step-00000006-99999"), "{err}");
    assert!(err.contains("restored") && err.contains("step-00000004"), "{err}");
    assert!(err.contains("removed leftover temporary file"), "{err}");
    assert!(err.contains("resuming from") && err.contains("step-00000004"), "the restored step is used: {err}");
    assert_eq!(leftovers(&dir), Vec::<String>::new());
    assert_eq!(steps_of(&dir), ["step-00000002", "step-00000004", "step-00000005"]);
    let _ = std::fs::remove_dir_all(&dir);
}

// 2. A folder holding another run's checkpoints is not adopted.
#[test]
fn another_runs_checkpoints_are_never_adopted() {
    let dir = tmp("adopt");
    ok(train(&dir, &tiny(&["train.steps=6", "train.checkpoint_every=3", "train.seed=1"])));
    let old_id = std::fs::read_to_string(dir.join("run_id")).unwrap_or_default().trim().to_string();
    // The hostile sequence: delete what the old check looked at, start another run there.
    std::fs::remove_file(dir.join("metrics.jsonl")).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut c = train_cmd(&dir, &tiny(&["train.steps=6", "train.checkpoint_every=1", "train.seed=2"]));
    fails(&c.arg("--stop-after").arg("2").output().unwrap(), "already holds a run");
    assert!(!old_id.is_empty(), "the run folder has an id");
    std::fs::remove_file(dir.join("run_id")).unwrap();
    let mut c = train_cmd(&dir, &tiny(&["train.steps=6", "train.checkpoint_every=1", "train.seed=2"]));
    fails(&c.arg("--stop-after").arg("2").output().unwrap(), "already holds a run");

    // A checkpoint of another run copied into a run folder: resume names both runs.
    let other = tmp("adopt-other");
    let mut c = train_cmd(&other, &tiny(&["train.steps=6", "train.checkpoint_every=1", "train.seed=2"]));
    ok(c.arg("--stop-after").arg("2").output().unwrap());
    let new_id = std::fs::read_to_string(other.join("run_id")).unwrap().trim().to_string();
    assert_ne!(old_id, new_id);
    let src = dir.join("checkpoints").join("step-00000006");
    let dst = other.join("checkpoints").join("step-00000006");
    std::fs::create_dir_all(&dst).unwrap();
    for f in names(&src) {
        std::fs::copy(src.join(&f), dst.join(&f)).unwrap();
    }
    let err = fails(&resume(&other, &[]), "belongs to run");
    assert!(err.contains(&old_id) && err.contains(&new_id), "{err}");
    for d in [dir, other] {
        let _ = std::fs::remove_dir_all(d);
    }
}

// 3. eps = 0 is rejected; non-finite parameters are never saved, the last good checkpoint stays.
#[test]
fn eps_zero_is_rejected_and_non_finite_parameters_are_never_saved() {
    let dir = tmp("eps");
    fails(&train(&dir, &tiny(&["optim.eps=0", "data.seq_len=16"])), "optim.eps = 0");
    assert!(!dir.exists(), "nothing is created for an invalid config");

    let mut c = train_cmd(&dir, &tiny(&["train.steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=0"]));
    let o = c.env("MACROBATCH_FAULT", "kind=nan,step=4").output().unwrap();
    let err = fails(&o, "non-finite");
    assert!(err.contains("transformer.ln_f.bias"), "names the tensor: {err}");
    assert_eq!(steps_of(&dir), ["step-00000002"], "the NaN checkpoint is not written");
    assert_eq!(leftovers(&dir), Vec::<String>::new());
    assert!(!dir.join("model.safetensors").exists());
    let err = ok(resume(&dir, &[]));
    assert!(err.contains("step-00000002"), "{err}");
    assert!(weights(&dir).iter().all(|x| x.is_finite()));
    let _ = std::fs::remove_dir_all(&dir);
}

// 4 + full disk. ENOSPC during a checkpoint and during a metrics line.
#[test]
fn a_full_disk_is_a_clear_error_and_the_rerun_resumes_exactly() {
    let sets = tiny(&["train.steps=10", "train.checkpoint_every=2", "train.keep_checkpoints=0"]);
    let straight = tmp("disk-straight");
    ok(train(&straight, &sets));

    // The disk fills up during the checkpoint of step 6 (50 kB after step 5 starts).
    let dir = tmp("disk-ckpt");
    let o = train_cmd(&dir, &sets).env("MACROBATCH_FAULT", "kind=enospc,step=5,bytes=50000").output().unwrap();
    fails(&o, "No space left on device");
    assert_eq!(steps_of(&dir), ["step-00000002", "step-00000004"], "earlier checkpoints intact");
    assert_eq!(leftovers(&dir), Vec::<String>::new(), "no temporary folder or file left");
    assert_eq!(assert_metrics_whole(&dir), 6);
    // Space freed: the rerun resumes and ends where an uninterrupted run does.
    let err = ok(resume(&dir, &[]));
    assert!(err.contains("step-00000004"), "{err}");
    assert_eq!(bytes_of(dir.join("model.safetensors")), bytes_of(straight.join("model.safetensors")));
    assert_eq!(assert_metrics_whole(&dir), 10);

    // The disk fills up in the middle of the metrics line of step 5 (300 bytes).
    let dir2 = tmp("disk-metrics");
    let o = train_cmd(&dir2, &sets).env("MACROBATCH_FAULT", "kind=enospc,step=5,bytes=300").output().unwrap();
    let err = fails(&o, "No space left on device");
    assert!(err.contains("metrics.jsonl") && err.contains("last complete line"), "{err}");
    assert_eq!(assert_metrics_whole(&dir2), 4, "no torn line");
    ok(resume(&dir2, &[]));
    assert_eq!(bytes_of(dir2.join("model.safetensors")), bytes_of(straight.join("model.safetensors")));

    // A torn line left by an older writer or a crash: dropped on resume, with a warning.
    let dir3 = tmp("disk-torn");
    let mut c = train_cmd(&dir3, &sets);
    ok(c.arg("--stop-after").arg("4").output().unwrap());
    let mut f = std::fs::OpenOptions::new().append(true).open(dir3.join("metrics.jsonl")).unwrap();
    std::io::Write::write_all(&mut f, b"{\"step\":5,\"epoch\":0,\"lo").unwrap();
    drop(f);
    let err = ok(resume(&dir3, &[]));
    assert!(err.contains("torn line"), "{err}");
    assert_eq!(assert_metrics_whole(&dir3), 10);
    for d in [straight, dir, dir2, dir3] {
        let _ = std::fs::remove_dir_all(d);
    }
}

// 5. A model too large for memory is an error with numbers, not an abort.
#[test]
fn a_model_too_large_for_memory_is_an_error_not_an_abort() {
    let dir = tmp("huge");
    for sets in [
        vec!["model.n_embd=1000000", "model.n_head=1", "train.steps=1"],
        vec!["model.block_size=100000000", "data.seq_len=64", "train.steps=1"],
    ] {
        let err = fails(&train(&dir, &sets), "bytes are available");
        assert!(err.contains("needs at least") && err.contains("batch.micro") && err.contains("zero_stage"), "{err}");
        assert!(!dir.exists(), "{sets:?}: nothing created");
    }
    // gpt2-xl under a 6 GB address-space limit.
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 6000000 && exec '{}' train --out '{}' --set model.preset=gpt2-xl --set train.steps=1",
            env!("CARGO_BIN_EXE_macrobatch"),
            dir.display()
        ))
        .output()
        .unwrap();
    let err = fails(&o, "ulimit -v");
    assert!(err.contains("bytes are available"), "{err}");

    // A config.json that claims n_embd = 2^20, for generate and --init-from.
    let hf = tmp("huge-hf");
    ok(train(&hf, &tiny(&["train.steps=1"])));
    let cfg = std::fs::read_to_string(hf.join("config.json")).unwrap();
    let cfg = cfg.replace("\"n_embd\": 32", "\"n_embd\": 1048576").replace("\"n_head\": 2", "\"n_head\": 1");
    assert!(cfg.contains("1048576"));
    std::fs::write(hf.join("config.json"), cfg).unwrap();
    fails(&bin().arg("generate").arg(&hf).output().unwrap(), "bytes are available");
    let o = bin().arg("train").arg("--out").arg(&dir).arg("--init-from").arg(&hf).output().unwrap();
    fails(&o, "bytes are available");
    assert!(!dir.exists());
    let _ = std::fs::remove_dir_all(&hf);
}

// 6. Invalid settings fail before anything is created; a run that fails before
// its first step leaves nothing that blocks the corrected rerun.
#[test]
fn a_run_that_fails_before_its_first_step_leaves_nothing_that_blocks_a_rerun() {
    let dir = tmp("early");
    for (bad, field) in [
        (vec!["optim.beta1=1.5"], "optim.beta1"),
        (vec!["optim.beta1=1.5", "dist.world_size=2", "batch.micro=2"], "optim.beta1"),
        (vec!["optim.weight_decay=-0.5"], "optim.weight_decay"),
        (vec!["optim.name=sgd", "optim.momentum=1.5"], "optim.momentum"),
    ] {
        fails(&train(&dir, &tiny(&bad)), field);
        assert!(!dir.exists(), "{bad:?}: nothing created");
    }
    // Fails after the folder exists (rank 0 errors at step 1): removed again.
    let o = train_cmd(&dir, &tiny(&["train.steps=2"])).env("MACROBATCH_FAULT", "kind=error,step=1").output().unwrap();
    fails(&o, "injected fault");
    assert!(!dir.exists(), "left behind: {:?}", names(&dir));
    // An existing, empty --out folder stays, emptied of what the run wrote.
    std::fs::create_dir_all(&dir).unwrap();
    let o = train_cmd(&dir, &tiny(&["train.steps=2", "dist.world_size=2", "batch.micro=2"]))
        .env("MACROBATCH_FAULT", "rank=1,step=1,kind=error")
        .output()
        .unwrap();
    fails(&o, "injected fault");
    assert_eq!(names(&dir), Vec::<String>::new());
    ok(train(&dir, &tiny(&["train.steps=2"])));
    let _ = std::fs::remove_dir_all(&dir);
}

// 7. Overflowing batch numbers.
#[test]
fn overflowing_batch_numbers_are_errors_not_panics() {
    let dir = tmp("overflow");
    let huge = "batch.micro=4611686018427387904";
    fails(&train(&dir, &[huge, "batch.accumulation_steps=4"]), "overflows");
    fails(&train(&dir, &[huge, "batch.global=16", "dist.world_size=4"]), "overflows");
    assert!(!dir.exists());
}

// 8. bench --steps 0.
#[test]
fn bench_with_zero_steps_is_rejected() {
    let mut c = bin();
    c.args(["bench", "--steps", "0", "--no-k-sweep"]);
    with_sets(&mut c, TINY);
    fails(&c.output().unwrap(), "--steps 0");
}

// 9. SIGTERM: checkpoint, exit 143, say how to resume (SIGINT → 130: tests/checkpoint.rs).
#[test]
fn sigterm_exits_143_after_the_checkpoint_and_says_how_to_resume() {
    let dir = tmp("sigterm");
    let mut c = train_cmd(&dir, &tiny(&["train.steps=1000000"]));
    let child = spawn_until_steps(&mut c, &dir, 3);
    send("-TERM", child.id());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(143), "{err}");
    assert!(err.contains("exit code 143") && err.contains("--resume"), "{err}");
    assert_eq!(steps_of(&dir).len(), 1, "the checkpoint is safe before the exit");
    assert!(!dir.join("model.safetensors").exists(), "not a finished run");
    let _ = std::fs::remove_dir_all(&dir);
}

// SIGTERM while the model loads, before any step: the handlers are already
// in place, so loading ends, step 1 runs, its checkpoint is written and the
// exit is 143 with how to resume (never a silent kill by the default action).
// Deterministic: the signal goes once the run says loading is under way.
#[test]
fn sigterm_while_the_model_loads_checkpoints_step_one_and_says_so() {
    use std::io::{BufRead, BufReader, Read};
    let dir = tmp("sigterm-loading");
    let mut c = train_cmd(&dir, &tiny(&["train.steps=1000000"]));
    let mut child = c.env("MACROBATCH_FAULT", "kind=slow_load,secs=2").stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap());
    let mut err = String::new();
    while !err.contains("injected fault: loading takes") {
        assert!(lines.read_line(&mut err).unwrap() > 0, "the run ended before loading: {err}");
    }
    send("-TERM", child.id());
    lines.read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143), "{err}");
    assert!(err.contains("stopped after step 1") && err.contains("exit code 143") && err.contains("--resume"), "{err}");
    assert_eq!(steps_of(&dir).len(), 1, "step 1's checkpoint is written before the exit: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

// kill -9 inside the checkpoint of step 4, and inside the final save: the
// folder keeps the last whole checkpoint (step 2, resp. the last step 5)
// and no model,
// and a resume ends with the uninterrupted run's weights, bit for bit.
#[test]
fn kill_9_in_a_checkpoint_or_the_final_save_resumes_to_the_same_weights() {
    let sets = tiny(&["train.steps=5", "train.checkpoint_every=2"]);
    let whole = tmp("kill-phase-whole");
    ok(train(&whole, &sets));
    let want = weights(&whole);
    for (phase, kept) in [("checkpoint", "step-00000002"), ("save", "step-00000005")] {
        let dir = tmp(&format!("kill-phase-{phase}"));
        let fault = format!("rank=0,step=4,kind=kill,phase={phase}");
        let o = train_cmd(&dir, &sets).env("MACROBATCH_FAULT", &fault).output().unwrap();
        assert_eq!(o.status.code(), None, "{phase}: killed by a signal: {}", stderr(&o));
        assert!(!dir.join("model.safetensors").exists(), "{phase}: no model from a killed save");
        assert_eq!(steps_of(&dir).last().map(String::as_str), Some(kept), "{phase}: {:?}", steps_of(&dir));
        resume_ok(&dir, &[]);
        assert!(weights(&dir) == want, "{phase}: the resumed run's weights are the uninterrupted run's");
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir_all(&whole);
}

/// Starts `c` (a train into `dir`, stderr piped) and waits until it has
/// logged `steps` steps.
fn spawn_until_steps(c: &mut Command, dir: &Path, steps: usize) -> std::process::Child {
    let child = c.stderr(Stdio::piped()).spawn().unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(dir.join("metrics.jsonl")).map(|t| t.lines().count()).unwrap_or(0) < steps {
        assert!(t0.elapsed() < Duration::from_secs(60), "training never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Sends `sig` to `pid` with kill(1).
fn send(sig: &str, pid: u32) {
    assert!(Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success());
}

// A double Ctrl-C (two SIGINTs 50 ms apart) is one request: the run stops
// after the step in progress with a checkpoint (exit 130, said on stderr),
// not at once with nothing saved.
#[test]
fn two_sigints_in_quick_succession_still_write_the_checkpoint() {
    let dir = tmp("double-sigint");
    let mut c = train_cmd(&dir, &tiny(&["train.steps=1000000"]));
    let child = spawn_until_steps(&mut c, &dir, 3);
    send("-INT", child.id());
    std::thread::sleep(Duration::from_millis(50));
    send("-INT", child.id());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("exit code 130") && err.contains("--resume"), "{err}");
    assert_eq!(steps_of(&dir).len(), 1, "the checkpoint is written before the exit: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

// 10 + warmup warning. Resuming with train.steps below the checkpoint's step.
#[test]
fn resuming_below_the_checkpoint_step_is_an_error() {
    let dir = tmp("below");
    let err = ok(train(&dir, &tiny(&["train.steps=5", "train.checkpoint_every=5"])));
    assert!(err.contains("warning: schedule.warmup_steps = 20 is more than train.steps = 5"), "{err}");
    let resolved = std::fs::read_to_string(dir.join("config.resolved.toml")).unwrap();
    let weights_before = bytes_of(dir.join("model.safetensors"));
    fails(&resume(&dir, &["train.steps=3"]), "below the checkpoint's step 5");
    assert_eq!(std::fs::read_to_string(dir.join("config.resolved.toml")).unwrap(), resolved, "untouched");
    assert_eq!(bytes_of(dir.join("model.safetensors")), weights_before);
    let _ = std::fs::remove_dir_all(&dir);
}

// 11. --resume A --out B.
#[test]
fn resume_with_a_different_out_is_refused() {
    let (a, b) = (tmp("resume-a"), tmp("resume-b"));
    ok(train(&a, &tiny(&["train.steps=2", "train.checkpoint_every=2"])));
    let o = bin().arg("train").arg("--resume").arg(&a).arg("--out").arg(&b).args(["--set", "train.steps=3"]).output();
    let err = fails(&o.unwrap(), "--out");
    assert!(err.contains(&a.display().to_string()) && err.contains(&b.display().to_string()), "{err}");
    assert!(!b.exists());
    let _ = std::fs::remove_dir_all(&a);
}

// 12. Default run folders started in the same second never collide.
#[test]
fn default_run_folders_never_collide() {
    let cwd = tmp("default-out");
    std::fs::create_dir_all(&cwd).unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| {
            let mut c = bin();
            c.arg("train").current_dir(&cwd);
            with_sets(&mut c, &tiny(&["train.steps=1"]));
            c.stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    for child in children {
        ok(child.wait_with_output().unwrap());
    }
    let runs = names(&cwd.join("runs"));
    assert_eq!(runs.len(), 4, "{runs:?}");
    for r in &runs {
        assert!(cwd.join("runs").join(r).join("model.safetensors").is_file(), "{r}");
    }
    let _ = std::fs::remove_dir_all(&cwd);
}

// Prune after a fallback from a corrupt newer checkpoint keeps the good ones.
#[test]
fn pruning_after_a_fallback_never_keeps_the_corrupt_checkpoint() {
    let dir = tmp("prune");
    ok(train(&dir, &tiny(&["train.steps=6", "train.checkpoint_every=3", "train.keep_checkpoints=2"])));
    assert_eq!(steps_of(&dir), ["step-00000003", "step-00000006"]);
    let w = dir.join("checkpoints").join("step-00000006").join("model.safetensors");
    let mut bytes = std::fs::read(&w).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&w, bytes).unwrap();
    // Resume from step 3 to step 4 with keep 1: step 4 must be what stays.
    let err = ok(resume(&dir, &["train.steps=4", "train.keep_checkpoints=1"]));
    assert!(err.contains("skipping checkpoint") && err.contains("step-00000003"), "{err}");
    assert_eq!(steps_of(&dir), ["step-00000004"]);
    assert!(names(&dir.join("checkpoints")).contains(&"corrupt-step-00000006".to_string()));
    // And it resumes from there.
    let err = ok(resume(&dir, &["train.steps=5"]));
    assert!(err.contains("resuming from") && err.contains("step-00000004"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

// A slow checkpoint on rank 0 does not trip the other ranks' short timeout;
// a stalled rank is still named within it (tests/dist.rs).
#[test]
fn a_slow_checkpoint_on_rank_0_does_not_time_out_the_other_ranks() {
    let dir = tmp("slow-ckpt");
    let sets = tiny(&["dist.world_size=2", "batch.micro=2", "dist.timeout_s=1.5", "train.steps=4"]);
    let mut sets = sets;
    sets.push("train.checkpoint_every=2");
    let t0 = Instant::now();
    let o = train_cmd(&dir, &sets).env("MACROBATCH_FAULT", "rank=0,step=2,kind=slow_checkpoint,secs=4").output();
    ok(o.unwrap());
    assert!(t0.elapsed() >= Duration::from_secs(4), "the delay (> 2.5 × timeout) was injected");
    assert_eq!(steps_of(&dir), ["step-00000002", "step-00000004"]);
    let _ = std::fs::remove_dir_all(&dir);
}

// Sharded, every rank writes its own share: one rank far slower than the
// others (a slow disk) trips no rank's timeout, and the others wait for it.
// (It once lost the result of every rank that finished a heartbeat early.)
#[test]
fn a_slow_rank_writing_its_share_of_a_sharded_checkpoint_times_out_no_one() {
    let dir = tmp("slow-sharded");
    let mut sets = tiny(&["dist.world_size=3", "batch.micro=2", "dist.timeout_s=1.5", "train.steps=4"]);
    sets.extend([
        "batch.global=6",
        "batch.accumulation_steps=1",
        "train.checkpoint_every=2",
        "train.checkpoint_sharded=true",
    ]);
    let t0 = Instant::now();
    let o = train_cmd(&dir, &sets).env("MACROBATCH_FAULT", "rank=1,step=2,kind=slow_checkpoint,secs=4").output();
    ok(o.unwrap());
    assert!(t0.elapsed() >= Duration::from_secs(4), "the delay (> 2.5 × timeout) was injected");
    assert_eq!(steps_of(&dir), ["step-00000002", "step-00000004"]);
    let _ = std::fs::remove_dir_all(&dir);
}

// f16 stuck at the minimum loss scale stops with an error instead of skipping forever.
#[test]
fn f16_stuck_at_the_minimum_loss_scale_stops_with_an_error() {
    let dir = tmp("f16-stuck");
    let o = train(
        &dir,
        &tiny(&[
            "train.precision=f16",
            "train.initial_loss_scale=1e30",
            "train.min_loss_scale=1e30",
            "train.max_skips_at_min_scale=3",
            "train.steps=50",
        ]),
    );
    fails(&o, "3 steps in a row were skipped");
    assert!(metrics(&dir).len() < 5, "stopped early");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Crash consistency: kill -9 at random moments while a run writes a
/// checkpoint every step, resume each time; every resume starts from a valid
/// checkpoint, nothing is left behind, and the final weights equal those of
/// a run that was never interrupted, byte for byte. (Constant learning rate,
/// so the run can be ended at whatever step the kills reached.)
#[test]
fn kill_9_during_checkpoint_writes_then_resume_matches_an_uninterrupted_run() {
    const KILLS: usize = 24;
    let base = tiny(&["train.checkpoint_every=1", "train.keep_checkpoints=2", "schedule.kind=constant"]);
    let mut sets = base.clone();
    sets.extend(["schedule.warmup_steps=0", "train.steps=1000000"]);
    let dir = tmp("crash");
    ok(train_cmd(&dir, &sets).arg("--stop-after").arg("1").output().unwrap());
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let (mut kills, mut last_step, mut resumes_seen) = (0, 1u64, 0);
    while kills < KILLS {
        let mut c = bin();
        c.arg("train").arg("--resume").arg(&dir).stdout(Stdio::null()).stderr(Stdio::piped());
        let child = c.spawn().unwrap();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(20 + rng % 230));
        let _ = Command::new("kill").args(["-9", &child.id().to_string()]).status();
        let o = child.wait_with_output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), None, "killed by the signal, not an error: {err}");
        kills += 1;
        if let Some(line) = err.lines().find(|l| l.starts_with("resuming from")) {
            resumes_seen += 1;
            assert!(!err.contains("skipping checkpoint"), "a published checkpoint was invalid: {err}");
            let step: u64 = line.rsplit("step ").next().unwrap().trim_end_matches(')').parse().unwrap();
            assert!(step >= last_step, "went back from step {last_step} to {step}");
            last_step = step;
        }
    }
    // End the interrupted run a few steps past its newest checkpoint, and run
    // the same number of steps without interruption.
    let newest = steps_of(&dir).last().cloned().unwrap();
    let end: u64 = newest.trim_start_matches("step-").parse::<u64>().unwrap() + 3;
    let end_set = format!("train.steps={end}");
    let err = ok(resume(&dir, &[&end_set]));
    assert!(err.contains("done:") && !err.contains("skipping checkpoint"), "{err}");
    assert_eq!(leftovers(&dir), Vec::<String>::new());
    let straight = tmp("crash-straight");
    let mut sets = base.clone();
    sets.extend(["schedule.warmup_steps=0", &end_set]);
    ok(train(&straight, &sets));
    assert_eq!(
        bytes_of(dir.join("model.safetensors")),
        bytes_of(straight.join("model.safetensors")),
        "final weights equal the uninterrupted run's"
    );
    assert_eq!(assert_metrics_whole(&dir), end as usize);
    eprintln!("crash test: {kills} kills ({resumes_seen} after resuming), {end} steps in all");
    let _ = (std::fs::remove_dir_all(&straight), std::fs::remove_dir_all(&dir));
}

// A full disk at the final save (no checkpoint to fall back on): the error
// says the model was NOT saved and the weights are kept in the system's
// temporary folder instead (another file system here), whole.
#[test]
fn a_full_disk_at_the_final_save_says_so_and_keeps_the_weights_elsewhere() {
    let mnt = tmp("full-disk");
    std::fs::create_dir_all(&mnt).unwrap();
    // A 3 MiB file system: the run's first files fit, its 6 MiB model
    // (1.6M parameters) does not.
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=3m", "tmpfs"]).arg(&mnt).output();
    if !mounted.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: cannot mount a small tmpfs here (needs root / CAP_SYS_ADMIN): {mounted:?}");
        let _ = std::fs::remove_dir_all(&mnt);
        return;
    }
    let spare_root = tmp("full-disk-spare");
    std::fs::create_dir_all(&spare_root).unwrap();
    let dir = mnt.join("run");
    let sets = tiny(&["model.n_embd=256", "model.n_layer=2", "train.steps=2", "train.checkpoint_every=0"]);
    let o = train_cmd(&dir, &sets).env("TMPDIR", &spare_root).output();
    let _ = Command::new("umount").arg(&mnt).status();
    let o = o.unwrap();
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("was NOT saved") && err.contains("no checkpoint was written"), "{err}");
    let spare: Vec<_> = std::fs::read_dir(&spare_root).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(spare.len(), 1, "one folder of unsaved weights: {spare:?}\n{err}");
    assert!(err.contains(&spare[0].display().to_string()), "the error names where the weights went: {err}");
    let weights = std::fs::metadata(spare[0].join("model.safetensors")).unwrap().len();
    assert!(weights > 4 << 20, "the whole model ({weights} bytes)");
    let _ = std::fs::remove_dir_all(&mnt);
    let _ = std::fs::remove_dir_all(&spare_root);
}
