//! Checkpoints: exact resume (also with thread ranks), a real SIGINT (exit 130),
//! fallback from corrupt checkpoints, --init-from, and bad input.

mod common;

use common::*;
use std::path::Path;
use std::time::{Duration, Instant};

fn ckpt_sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = SMALL.to_vec();
    s.extend(["batch.micro=4", "batch.accumulation_steps=2", "train.steps=20", "train.eval_every=5"]);
    s.extend(["train.checkpoint_every=5", "train.keep_checkpoints=0"]);
    s.extend_from_slice(extra);
    s
}

/// `loss` and `val_loss` of every line, as written (bit-exact text).
fn loss_text(out: &Path) -> Vec<String> {
    metrics(out).iter().map(|r| format!("{} {}", r["loss"], r["val_loss"])).collect()
}

fn run_ok(o: std::process::Output) -> String {
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    err
}

#[test]
fn stop_and_resume_is_bit_identical_with_accumulation_ranks_and_zero() {
    let variants: [&[&str]; 5] = [
        &["dist.world_size=1"],
        &["dist.world_size=2"],
        &["dist.world_size=2", "dist.zero_stage=3"],
        &["train.precision=f16"],
        &["dist.world_size=2", "dist.zero_stage=1", "train.precision=bf16"],
    ];
    for (i, extra) in variants.iter().enumerate() {
        let (a, b) = (tmp(&format!("straight-{i}")), tmp(&format!("resumed-{i}")));
        run_ok(train(&a, &ckpt_sets(extra)));
        let mut c = bin();
        c.arg("train").arg("--out").arg(&b).args(["--stop-after", "10"]);
        with_sets(&mut c, &ckpt_sets(extra));
        let err = run_ok(c.output().unwrap());
        assert!(err.contains("stopped after step 10"), "{err}");
        assert_eq!(metrics(&b).len(), 10);
        let err = run_ok(resume(&b, &[]));
        assert!(err.contains("resuming from") && err.contains("step-00000010"), "{err}");
        assert_eq!(loss_text(&a), loss_text(&b), "{extra:?}: every logged loss identical");
        assert_eq!(weights(&a), weights(&b), "{extra:?}: final parameters identical bit for bit");
        let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
    }
}

#[test]
fn sigint_checkpoints_exits_130_and_resumes_exactly() {
    let (a, b) = (tmp("sig-a"), tmp("sig-b"));
    let sets = ckpt_sets(&["train.steps=100000", "train.checkpoint_every=0", "train.eval_every=0"]);
    let mut c = bin();
    c.arg("train").arg("--out").arg(&a).stderr(std::process::Stdio::piped());
    with_sets(&mut c, &sets);
    let child = c.spawn().unwrap();
    let t0 = Instant::now();
    while metrics_len(&a) < 3 {
        assert!(t0.elapsed() < Duration::from_secs(60), "training never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let kill = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "stopped by SIGINT is not success: {err}");
    let stopped = metrics(&a).len() as u64;
    assert!(err.contains(&format!("stopped after step {stopped}")), "{err}");
    // Continue 3 more steps and compare with a run that never stopped.
    run_ok({
        let mut c = bin();
        c.arg("train").arg("--resume").arg(&a).args(["--stop-after", "3"]);
        c.output().unwrap()
    });
    let mut c = bin();
    c.arg("train").arg("--out").arg(&b).args(["--stop-after", &(stopped + 3).to_string()]);
    with_sets(&mut c, &sets);
    run_ok(c.output().unwrap());
    assert_eq!(loss_text(&a), loss_text(&b));
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

fn metrics_len(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl")).map(|t| t.lines().count()).unwrap_or(0)
}

#[test]
fn corrupt_newest_checkpoint_falls_back_and_none_left_is_an_error() {
    let dir = tmp("corrupt");
    run_ok(train(&dir, &ckpt_sets(&["train.steps=15"])));
    let ck = dir.join("checkpoints");
    // Flip a byte in the newest, truncate the one before.
    let newest = ck.join("step-00000015").join("model.safetensors");
    let mut bytes = std::fs::read(&newest).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&newest, &bytes).unwrap();
    let err = run_ok(resume(&dir, &["train.steps=16"]));
    assert!(err.contains("skipping checkpoint") && err.contains("step-00000015"), "{err}");
    assert!(err.contains("resuming from") && err.contains("step-00000010"), "{err}");

    let opt = ck.join("step-00000010").join("optimizer.safetensors");
    let len = std::fs::metadata(&opt).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&opt).unwrap().set_len(len / 3).unwrap();
    // That resume wrote step 16 at its end; take it and the corrupt step 15 away.
    std::fs::remove_dir_all(ck.join("step-00000016")).unwrap();
    std::fs::remove_dir_all(ck.join("step-00000015")).unwrap();
    let o = resume(&dir, &["train.steps=16"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("optimizer.safetensors does not match its checksum"), "{err}");
    assert!(err.contains("step-00000005"), "fell back twice: {err}");

    std::fs::remove_dir_all(&ck).unwrap();
    let o = resume(&dir, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no checkpoint to resume from"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_directory_without_manifest_is_never_taken_as_valid() {
    // What a kill during a write leaves behind: files but no manifest, under
    // the temporary name — and, even if renamed by hand, no manifest.
    let dir = tmp("partial");
    run_ok(train(&dir, &ckpt_sets(&["train.steps=10"])));
    let ck = dir.join("checkpoints");
    std::fs::remove_file(ck.join("step-00000010").join("manifest.json")).unwrap();
    let err = run_ok(resume(&dir, &["train.steps=11"]));
    assert!(err.contains("no readable manifest.json") && err.contains("step-00000005"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn init_from_a_hugging_face_directory_and_bad_files_are_named() {
    let src = tmp("init-src");
    run_ok(train(&src, &ckpt_sets(&["train.steps=40", "train.checkpoint_every=0"])));
    let val_src = metrics(&src).last().unwrap()["val_loss"].as_f64().unwrap();
    // Fine-tune from it: the first step starts from the trained weights, so its loss is near the source's.
    let ft = tmp("init-ft");
    let mut c = bin();
    c.arg("train").arg("--out").arg(&ft).arg("--init-from").arg(&src);
    with_sets(&mut c, &["train.steps=1", "batch.micro=4", "optim.lr=1e-9", "schedule.min_lr=0"]);
    run_ok(c.output().unwrap());
    let first = metrics(&ft)[0]["loss"].as_f64().unwrap();
    // A fresh model starts near ln 256 = 5.55; the loaded one near its validation loss.
    assert!(
        val_src < 4.0 && (first - val_src).abs() < 0.3,
        "fine-tune starts from the loaded model: {first} vs {val_src}"
    );

    // Truncated weights.
    let bad = tmp("init-bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(src.join("config.json"), bad.join("config.json")).unwrap();
    let w = std::fs::read(src.join("model.safetensors")).unwrap();
    std::fs::write(bad.join("model.safetensors"), &w[..w.len() / 2]).unwrap();
    let mut c = bin();
    c.arg("train").arg("--out").arg(tmp("init-x")).arg("--init-from").arg(&bad);
    let o = c.output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("model.safetensors") && err.contains("truncated or corrupt"), "{err}");

    // Wrong tensor shapes: a config.json that claims another width.
    let cfg = std::fs::read_to_string(src.join("config.json")).unwrap().replace("\"n_embd\": 64", "\"n_embd\": 32");
    std::fs::write(bad.join("config.json"), cfg).unwrap();
    std::fs::copy(src.join("model.safetensors"), bad.join("model.safetensors")).unwrap();
    let o = bin().arg("train").arg("--out").arg(tmp("init-y")).arg("--init-from").arg(&bad).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(err.contains("model.safetensors") && err.contains("has shape"), "{err}");
    for d in [src, ft, bad] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn resuming_with_another_model_shape_or_an_unwritable_output_is_an_error() {
    let dir = tmp("shape");
    run_ok(train(&dir, &ckpt_sets(&["train.steps=5"])));
    let o = resume(&dir, &["model.n_embd=32"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("holds a model of shape"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);

    // An output path below a regular file cannot be created (root can write anywhere else).
    let file = tmp("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let o = train(&file.join("run"), &ckpt_sets(&["train.steps=1"]));
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("cannot create output directory") && err.contains("a-file"), "{err}");
    let _ = std::fs::remove_file(&file);
}

/// A LoRA run on `all-linear` resumes bit for bit, on the Llama block, on
/// Phi-3's fused modules and on GPT-2: the checkpoint spells the targets as
/// the fewest names of the layers they select (GPT-2: `c_attn`, `c_proj`,
/// `c_fc`; Phi-3: `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`), the
/// config as `all-linear`, and both are the same shape.
#[test]
fn a_lora_run_on_all_linear_resumes_bit_for_bit() {
    for family in ["llama", "phi3", "gpt2"] {
        let fam = format!("model.family={family}");
        // Phi-3's tiny preset has a key/value head per query head.
        let kv = if family == "phi3" { "model.n_kv_head=2" } else { "train.seed=1" };
        let lora = ckpt_sets(&[
            &fam,
            kv,
            "model.preset=tiny",
            "lora.r=4",
            "lora.target_modules=[\"all-linear\"]",
            "train.steps=6",
            "train.checkpoint_every=2",
        ]);
        let (a, b) = (tmp(&format!("lora-{family}-straight")), tmp(&format!("lora-{family}-resumed")));
        run_ok(train(&a, &lora));
        let mut c = bin();
        c.arg("train").arg("--out").arg(&b).args(["--stop-after", "2"]);
        with_sets(&mut c, &lora);
        run_ok(c.output().unwrap());
        let err = run_ok(resume(&b, &[]));
        assert!(err.contains("resuming from") && err.contains("step-00000002"), "{family}: {err}");
        assert_eq!(loss_text(&a), loss_text(&b), "{family}: every logged loss identical");
        let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
    }
}

/// LoRA fine-tuning of a GPT-2 through the command line: `--init-from` a
/// trained GPT-2 folder with `[lora]` trains the adapters alone (only they
/// hold gradients and optimizer state), saves PEFT's adapter files and a
/// reference to the base (its path and SHA-256) instead of a copy of it,
/// and `--merge` writes a plain GPT-2 that answers as base + adapters.
#[test]
fn gpt2_lora_fine_tunes_adapters_only_and_merges() {
    let (src, ft) = (tmp("gpt2-lora-src"), tmp("gpt2-lora-ft"));
    let base = ckpt_sets(&["train.steps=4", "train.checkpoint_every=0"]);
    run_ok(train(&src, &base));
    let lora = [&base[..], &["lora.r=4", "lora.target_modules=[\"c_attn\", \"c_proj\"]", "optim.lr=1e-2"]].concat();
    let mut c = bin();
    c.arg("train").arg("--out").arg(&ft).arg("--init-from").arg(&src).arg("--merge");
    with_sets(&mut c, &lora);
    let err = run_ok(c.output().unwrap());
    assert!(err.contains("LoRA r=4 on c_attn, c_proj"), "{err}");
    let bytes = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap_or_else(|e| panic!("{}: {e}", d.join(f).display()));
    assert!(!ft.join("model.safetensors").exists(), "the run folder copied its base");
    let base: serde_json::Value = serde_json::from_slice(&bytes(&ft, "base.json")).unwrap();
    assert_eq!(base["path"].as_str(), Some(&*std::fs::canonicalize(&src).unwrap().to_string_lossy()));
    assert_eq!(base["files"], serde_json::json!(["config.json", "model.safetensors"]));
    let whole = [bytes(&src, "config.json"), bytes(&src, "model.safetensors")].concat();
    assert_eq!(base["bytes"].as_u64(), Some(whole.len() as u64));
    assert_eq!(base["sha256"].as_str(), Some(&*sha256_hex(&whole)), "the reference is the base's bytes");
    let adapter: serde_json::Value = serde_json::from_slice(&bytes(&ft, "adapter_config.json")).unwrap();
    assert_eq!(adapter["target_modules"], serde_json::json!(["c_attn", "c_proj"]));
    assert_eq!(adapter["base_model_name_or_path"], base["path"], "PEFT's config names the base");
    assert_eq!(adapter["fan_in_fan_out"], true);
    let m = metrics(&ft);
    let (grads, opt) = (m[0]["mem_grads"].as_u64().unwrap(), m[0]["mem_optimizer"].as_u64().unwrap());
    let file = bytes(&ft, "adapter_model.safetensors").len() as u64;
    assert!(grads < file && opt == 2 * grads, "grads {grads}, optimizer {opt}, adapter file {file} bytes");
    let greedy = |dir: &Path| {
        let o = bin()
            .arg("generate")
            .arg(dir)
            .args(["--prompt", "Call me", "--temperature", "0", "--max-new-tokens", "12"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        run_ok(o);
        text
    };
    let merged = ft.join("merged");
    assert!(!merged.join("adapter_config.json").exists());
    assert_eq!(greedy(&ft), greedy(&merged), "merged weights answer as base + adapters");
    let _ = (std::fs::remove_dir_all(&src), std::fs::remove_dir_all(&ft));
}

/// SHA-256 of `bytes`, hex (`sha256sum`'s).
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A LoRA run `--init-from` a base folder checkpoints the adapters, their
/// optimizer state and the sampler's position beside a reference to the
/// base, never the base: a checkpoint far smaller than the base, every file
/// in its manifest. Resuming reads the base again and continues bit for
/// bit; a base changed since (one bit of one weight) or gone is refused by
/// resume and by generate, naming the base and the fix.
#[test]
fn a_lora_checkpoint_refers_to_its_base_and_resumes_exactly() {
    let (src, a, b) = (tmp("lora-ref-src"), tmp("lora-ref-a"), tmp("lora-ref-b"));
    let base = ckpt_sets(&["train.steps=4", "train.checkpoint_every=0"]);
    run_ok(train(&src, &base));
    let lora = [
        &base[..],
        &["lora.r=4", "lora.target_modules=[\"c_attn\"]", "train.steps=6", "train.checkpoint_every=2", "optim.lr=1e-2"],
    ]
    .concat();
    let lora_run = |out: &Path, extra: &[&str]| {
        let mut c = bin();
        c.arg("train").arg("--out").arg(out).arg("--init-from").arg(&src).args(extra);
        with_sets(&mut c, &lora);
        c.output().unwrap()
    };
    run_ok(lora_run(&a, &[]));
    let err = run_ok(lora_run(&b, &["--stop-after", "2"]));
    assert!(err.contains("stopped after step 2"), "{err}");

    let ck = b.join("checkpoints").join("step-00000002");
    let mut names: Vec<String> =
        std::fs::read_dir(&ck).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let want = ["adapter_config.json", "adapter_model.safetensors", "base.json", "config.json"].into_iter().chain([
        "config.resolved.toml",
        "manifest.json",
        "optimizer.safetensors",
        "trainer_state.json",
    ]);
    assert_eq!(names, want.collect::<Vec<_>>());
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["files"].as_object().unwrap().len(), names.len() - 1, "every file is checksummed");
    let size = |d: &Path| std::fs::read_dir(d).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum::<u64>();
    let base_bytes = std::fs::metadata(src.join("model.safetensors")).unwrap().len();
    assert!(size(&ck) * 4 < base_bytes, "checkpoint {} bytes, base {base_bytes}", size(&ck));

    // Changed: the last byte of the file is the last weight's; one bit of it.
    let weights = src.join("model.safetensors");
    let original = std::fs::read(&weights).unwrap();
    let mut changed = original.clone();
    *changed.last_mut().unwrap() ^= 1;
    std::fs::write(&weights, &changed).unwrap();
    let err = fails(&resume(&b, &[]), "is not the one it was trained on");
    assert!(err.contains(&*std::fs::canonicalize(&src).unwrap().to_string_lossy()), "{err}");
    let generate = |dir: &Path| {
        bin().arg("generate").arg(dir).args(["--prompt", "Call me", "--max-new-tokens", "2"]).output().unwrap()
    };
    fails(&generate(&ck), "is not the one it was trained on");
    fails(&generate(&a), "is not the one it was trained on");
    // Gone.
    let aside = tmp("lora-ref-src-moved");
    std::fs::rename(&src, &aside).unwrap();
    fails(&resume(&b, &[]), "cannot be found");
    fails(&generate(&a), "is gone");
    std::fs::rename(&aside, &src).unwrap();
    std::fs::write(&weights, &original).unwrap();

    let err = run_ok(resume(&b, &[]));
    assert!(err.contains("step-00000002"), "{err}");
    assert_eq!(loss_text(&a), loss_text(&b), "every logged loss identical");
    let adapters = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
    assert!(adapters(&a) == adapters(&b), "the final adapters identical bit for bit");
    // train.save_base: folders that stand alone, the base copied in.
    let c = tmp("lora-ref-copied");
    run_ok(lora_run(&c, &["--set", "train.save_base=true"]));
    for d in [c.clone(), c.join("checkpoints").join("step-00000002")] {
        assert!(d.join("model.safetensors").exists() && !d.join("base.json").exists(), "{}", d.display());
    }
    assert!(adapters(&a) == adapters(&c), "the same training");
    for d in [&src, &a, &b, &c] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// `train.checkpoint_async`: the steps go on while rank 0's writer thread
/// writes a checkpoint. The checkpoints hold what the synchronous ones do
/// (the same weights and optimizer state, bit for bit, at W 1 and at W 2
/// under ZeRO-2, whose state is gathered from both ranks), and the run's
/// losses and weights are the same. With the checkpoint of step 4 held up
/// for a minute, step 5 is logged while step 4 is not yet published; a
/// `kill -9` then loses only that unpublished one: the run resumes from step
/// 2 and ends as the run that never stopped.
#[test]
fn async_checkpoints_let_the_steps_go_on_and_a_kill_loses_only_the_unpublished_one() {
    let files = |d: &Path, step: &str| {
        let ck = d.join("checkpoints").join(step);
        ["model.safetensors", "optimizer.safetensors"].map(|f| std::fs::read(ck.join(f)).unwrap())
    };
    for extra in [&["dist.world_size=1"][..], &["dist.world_size=2", "dist.zero_stage=2"]] {
        let (sync, asy) = (tmp("ck-sync"), tmp("ck-async"));
        run_ok(train(&sync, &ckpt_sets(extra)));
        run_ok(train(&asy, &ckpt_sets(&[extra, &["train.checkpoint_async=true"]].concat())));
        assert_eq!(loss_text(&sync), loss_text(&asy), "{extra:?}");
        assert_eq!(weights(&sync), weights(&asy), "{extra:?}");
        for step in ["step-00000005", "step-00000010", "step-00000015", "step-00000020"] {
            assert!(files(&sync, step) == files(&asy, step), "{extra:?} {step}: the same checkpoint");
        }
        let _ = (std::fs::remove_dir_all(&sync), std::fs::remove_dir_all(&asy));
    }

    let (a, b) = (tmp("ck-async-killed"), tmp("ck-async-straight"));
    let sets = ckpt_sets(&["train.checkpoint_every=2", "train.checkpoint_async=true", "train.eval_every=0"]);
    let mut c = bin();
    c.arg("train").arg("--out").arg(&a).env("MACROBATCH_FAULT", "rank=0,step=4,kind=slow_checkpoint,secs=60");
    with_sets(&mut c, &sets);
    let mut child = c.stderr(std::process::Stdio::null()).spawn().unwrap();
    let t0 = Instant::now();
    while metrics_len(&a) < 5 {
        assert!(t0.elapsed() < Duration::from_secs(50), "the steps after step 4 did not go on");
        std::thread::sleep(Duration::from_millis(20));
    }
    let ck = a.join("checkpoints");
    assert!(ck.join("step-00000002").is_dir() && !ck.join("step-00000004").exists(), "step 5 ran while 4 was written");
    child.kill().unwrap();
    child.wait().unwrap();
    let err = run_ok(resume(&a, &[]));
    assert!(err.contains("resuming from") && err.contains("step-00000002"), "{err}");
    run_ok(train(&b, &sets));
    assert_eq!(loss_text(&a), loss_text(&b), "every logged loss identical");
    assert_eq!(weights(&a), weights(&b));
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}
