//! Run folders as a hostile user meets them: a user's files in `--out` are
//! never overwritten, one process at a time writes a run folder (and a
//! killed holder leaves no stale lock), an unstarted run's leftovers do not
//! block the folder, and damaged pretrained weights are named at load.

mod common;

use common::*;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

fn ok(o: Output) -> String {
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    err
}

#[test]
fn out_folder_with_user_files_is_refused_and_the_files_are_kept() {
    let dir = tmp("userfiles");
    std::fs::create_dir_all(&dir).unwrap();
    // Names a run writes (plot, config, memory report, tokenizer), holding the user's own bytes.
    for f in ["plot.svg", "config.json", "memory.json", "tokenizer.json"] {
        std::fs::write(dir.join(f), b"mine").unwrap();
    }
    let err = fails(&train(&dir, &tiny(&["train.steps=1"])), "is not empty");
    assert!(err.contains("config.json") && err.contains("plot.svg"), "the files are named: {err}");
    for f in ["plot.svg", "config.json", "memory.json", "tokenizer.json"] {
        assert_eq!(std::fs::read(dir.join(f)).unwrap(), b"mine", "{f} was overwritten");
    }
    assert!(!dir.join(".macrobatch.lock").exists(), "a refused folder gets no lock file");
    // Any other content too: a new run takes an empty folder.
    let other = tmp("userfiles-other");
    std::fs::create_dir_all(other.join("notes")).unwrap();
    fails(&train(&other, &tiny(&["train.steps=1"])), "notes");
    assert!(other.join("notes").is_dir());
    // An empty folder is fine.
    let empty = tmp("userfiles-empty");
    std::fs::create_dir_all(&empty).unwrap();
    ok(train(&empty, &tiny(&["train.steps=1"])));
    for d in [dir, other, empty] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn an_unstarted_runs_leftovers_do_not_block_the_folder() {
    // What an abort before the first step leaves: the run's identity, its
    // resolved config, its tokenizer and an empty metrics.jsonl.
    let dir = tmp("unstarted");
    std::fs::create_dir_all(dir.join("checkpoints")).unwrap();
    std::fs::write(dir.join("run_id"), b"1-2-3-0\n").unwrap();
    std::fs::write(dir.join("metrics.jsonl"), b"").unwrap();
    std::fs::write(dir.join("config.resolved.toml"), b"[train]\n").unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), b"{}").unwrap();
    // A file of the user's beside such leftovers: the folder is not ours to clear.
    std::fs::write(dir.join("notes.md"), b"mine").unwrap();
    fails(&train(&dir, &tiny(&["train.steps=2"])), "notes.md");
    assert_eq!(std::fs::read(dir.join("notes.md")).unwrap(), b"mine");
    std::fs::remove_file(dir.join("notes.md")).unwrap();
    let err = ok(train(&dir, &tiny(&["train.steps=2"])));
    assert!(err.contains("never finished a step"), "{err}");
    assert_eq!(losses(&dir).len(), 2);
    let id = std::fs::read_to_string(dir.join("run_id")).unwrap();
    assert_ne!(id.trim(), "1-2-3-0", "the new run has its own identity");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits until `dir/metrics.jsonl` has at least `n` lines.
fn wait_for_steps(dir: &Path, n: usize, child: &mut std::process::Child) {
    let t0 = Instant::now();
    loop {
        let lines = std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |t| t.lines().count());
        if lines >= n {
            return;
        }
        if let Ok(Some(s)) = child.try_wait() {
            panic!("the first run ended ({s}) before step {n}");
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no step {n} after 2 minutes");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn one_process_per_run_folder_and_a_killed_holder_leaves_no_stale_lock() {
    let dir = tmp("lock");
    // A run long enough to be caught in the middle, checkpointing every step.
    let sets = tiny(&["train.steps=100000", "train.checkpoint_every=1", "train.keep_checkpoints=2"]);
    let mut first = train_cmd(&dir, &sets).stderr(Stdio::null()).stdout(Stdio::null()).spawn().unwrap();
    wait_for_steps(&dir, 2, &mut first);
    let pid = first.id().to_string();

    // A resume of the same folder while it runs: refused, naming the holder.
    let mut c = bin();
    // (--stop-after 1: without the lock it would finish a step and exit 0.)
    c.arg("train").arg("--resume").arg(&dir).arg("--set").arg("optim.lr=1e-3").arg("--stop-after").arg("1");
    let err = fails(&c.output().unwrap(), "is in use");
    assert!(err.contains(&pid), "the holder's pid {pid} is named: {err}");
    // A second new run into it: refused too (it holds a run, and it is locked).
    let mut c = train_cmd(&dir, &tiny(&["train.steps=1"]));
    fails(&c.output().unwrap(), &dir.display().to_string());

    // kill -9: the kernel releases the lock; the folder can be resumed at once.
    first.kill().unwrap();
    first.wait().unwrap();
    let mut c = bin();
    c.arg("train").arg("--resume").arg(&dir);
    with_sets(&mut c, &["train.steps=100000"]);
    let resumed = c.arg("--stop-after").arg("1").output().unwrap();
    let err = ok(resumed);
    assert!(err.contains("resuming from"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The byte offset of the first element of `tensor` in a safetensors file.
fn tensor_offset(file: &[u8], tensor: &str) -> usize {
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
    let entry = [format!("transformer.{tensor}"), tensor.to_string()]
        .into_iter()
        .find_map(|k| header.get(&k).cloned())
        .unwrap_or_else(|| panic!("{tensor} is not in the file"));
    8 + n + entry["data_offsets"][0].as_u64().unwrap() as usize
}

#[test]
fn non_finite_pretrained_weights_are_named_at_load() {
    let base = tmp("nan-base");
    ok(train(&base, &tiny(&["train.steps=1"])));
    let path = base.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    // Element [1, 3] of the first block's attention weight ([in, out] = [32, 96]).
    let tensor = "h.0.attn.c_attn.weight";
    let at = tensor_offset(&bytes, tensor) + 4 * (96 + 3);
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();

    let out = tmp("nan-run");
    let mut c = train_cmd(&out, &tiny(&["train.steps=1"]));
    let err = fails(&c.arg("--init-from").arg(&base).output().unwrap(), tensor);
    assert!(err.contains("NaN") && err.contains("[1, 3]"), "the element is named: {err}");
    assert!(!err.contains("learning rate"), "not blamed on the optimizer: {err}");
    assert!(!out.exists(), "nothing is created for a model that cannot be trained");
    // generate refuses it the same way.
    let o = bin().arg("generate").arg(&base).arg("--prompt").arg("a").output().unwrap();
    fails(&o, tensor);
    for d in [base, out] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn init_from_does_not_silently_replace_an_explicit_shape() {
    let base = tmp("pin-base");
    ok(train(&base, &tiny(&["train.steps=1"])));
    let out = tmp("pin-run");
    // The pretrained model has one layer; the user asked for two.
    let mut c = train_cmd(&out, &tiny(&["train.steps=1", "model.n_layer=2"]));
    let err = fails(&c.arg("--init-from").arg(&base).output().unwrap(), "--set model.n_layer=2");
    assert!(err.contains("model.n_layer = 1"), "{err}");
    // The same value is no conflict.
    let mut c = train_cmd(&out, &tiny(&["train.steps=1"]));
    ok(c.arg("--init-from").arg(&base).output().unwrap());
    for d in [base, out] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Context extension: a pretrained Llama-block model trains on longer
/// sequences than it was made for with `--set model.block_size` and a
/// `model.rope_scaling` (its rotary tables are computed: no parameter
/// depends on either), the resolved config keeping both; GPT-2's learned
/// positions are parameters, so its `block_size` stays its shape.
#[test]
fn a_pretrained_rotary_model_takes_a_longer_context_and_its_scaling() {
    let llama = ["model.family=llama", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32"];
    let base = tmp("ctx-base");
    ok(train(&base, &tiny(&[&llama[..], &["train.steps=1"]].concat())));
    let out = tmp("ctx-run");
    let scaling = "model.rope_scaling={factor=2.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32}";
    let longer = ["train.steps=1", "model.block_size=64", "data.seq_len=64", scaling];
    let mut c = train_cmd(&out, &tiny(&longer));
    ok(c.arg("--init-from").arg(&base).output().unwrap());
    let text = std::fs::read_to_string(out.join("config.resolved.toml")).unwrap();
    assert!(text.contains("block_size = 64") && text.contains("original_max_position_embeddings = 32"), "{text}");
    assert!(text.contains("n_layer = 1") && text.contains("n_embd = 32"), "the rest is the pretrained shape: {text}");
    let gpt_base = tmp("ctx-gpt-base");
    ok(train(&gpt_base, &tiny(&["train.steps=1"])));
    let mut c = train_cmd(&tmp("ctx-gpt-run"), &tiny(&["train.steps=1", "model.block_size=64"]));
    fails(&c.arg("--init-from").arg(&gpt_base).output().unwrap(), "--set model.block_size=64");
    for d in [base, out, gpt_base] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A run started from a folder records that folder as the source of its
/// shape, never a preset it did not use (`preset = "tiny"` beside another
/// shape's keys), and its resolved config alone trains the same shape.
#[test]
fn a_run_from_a_folder_records_its_source_not_a_preset() {
    let base = tmp("src-base");
    // A shape no preset has.
    ok(train(&base, &tiny(&["train.steps=1", "model.n_embd=48", "model.n_head=3"])));
    let (out, again) = (tmp("src-run"), tmp("src-again"));
    let sets =
        ["train.steps=1", "batch.micro=4", "batch.accumulation_steps=2", "train.eval_every=0", "train.threads=1"];
    let mut c = train_cmd(&out, &sets);
    ok(c.arg("--init-from").arg(&base).output().unwrap());
    let model = |dir: &Path| {
        let text = std::fs::read_to_string(dir.join("config.resolved.toml")).unwrap();
        text.parse::<toml::Table>().unwrap()["model"].as_table().unwrap().clone()
    };
    let m = model(&out);
    assert!(!m.contains_key("preset"), "{m:?}");
    let source = std::fs::canonicalize(&base).unwrap().display().to_string();
    assert_eq!(m["source"].as_str(), Some(source.as_str()), "{m:?}");
    assert_eq!((m["n_embd"].as_integer(), m["n_head"].as_integer()), (Some(48), Some(3)), "{m:?}");
    // Trained again from its resolved config alone: the same shape, still no preset.
    let mut c = train_cmd(&again, &["train.steps=1"]);
    ok(c.arg(out.join("config.resolved.toml")).output().unwrap());
    let shape = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
    };
    assert_eq!(shape(&again), shape(&out));
    assert_eq!(model(&again), m);
    for d in [base, out, again] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn generate_on_a_stopped_run_points_to_its_checkpoint() {
    let dir = tmp("stopped");
    let mut c = train_cmd(&dir, &tiny(&["train.steps=5", "train.checkpoint_every=1"]));
    ok(c.arg("--stop-after").arg("2").output().unwrap());
    assert!(!dir.join("model.safetensors").exists());
    let o = bin().arg("generate").arg(&dir).arg("--prompt").arg("a").output().unwrap();
    let err = fails(&o, "step-00000002");
    assert!(err.contains("--resume"), "{err}");
    // And the checkpoint it points to does generate.
    let ck = dir.join("checkpoints").join("step-00000002");
    let o = bin().args(["generate", "--max-new-tokens", "3", "--prompt", "a"]).arg(&ck).output().unwrap();
    ok(o);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flags_that_would_be_ignored_are_refused() {
    let dir = tmp("flags");
    // --stop-after 0 used to train one step.
    let mut c = train_cmd(&dir, &tiny(&["train.steps=2"]));
    let o = c.arg("--stop-after").arg("0").output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("--stop-after"), "{}", stderr(&o));
    assert!(!dir.exists());
    // --system only means something with --chat.
    let o = bin().args(["generate", "x", "--system", "be brief"]).output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("--chat"), "{}", stderr(&o));
    // A misspelt GEMM backend is an error, not a silent fallback.
    let o = train_cmd(&dir, &tiny(&["train.steps=1"])).env("MACROBATCH_GEMM", "bogus").output().unwrap();
    fails(&o, "MACROBATCH_GEMM=bogus");
    assert!(!dir.exists());
    let o = train_cmd(&dir, &tiny(&["train.steps=1"])).env("MACROBATCH_BF16", "hardwre").output().unwrap();
    fails(&o, "MACROBATCH_BF16=hardwre");
    assert!(!dir.exists());
    // ./x and x/ are the same folder for --resume and --out.
    let run = tmp("flags-run");
    ok(train(&run, &tiny(&["train.steps=2", "train.checkpoint_every=1"])));
    let slash = format!("{}/", run.display());
    let dot = format!("{}/.", run.display());
    let o = bin().args(["train", "--resume", &slash, "--out", &dot, "--set", "train.steps=3"]).output().unwrap();
    ok(o);
    let _ = std::fs::remove_dir_all(&run);
}

#[test]
fn progress_and_metrics_count_input_tokens_and_targets_apart() {
    let dir = tmp("inputs");
    ok(train(&dir, &tiny(&["train.steps=2", "data.seq_len=16"])));
    for r in metrics(&dir) {
        // Windows: every input position has a target; global 8 × T 16.
        assert_eq!(r["input_tokens"].as_u64(), Some(8 * 16), "{r}");
        assert_eq!(r["tokens"].as_u64(), Some(8 * 16), "{r}");
        assert!(r["input_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_on_a_random_base_warns_and_missing_adapters_are_an_error() {
    let dir = tmp("lora-adapters");
    let sets = [
        "model.family=llama",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "batch.micro=2",
        "batch.accumulation_steps=1",
        "train.eval_every=0",
        "train.threads=1",
        "train.steps=1",
        "lora.r=2",
        "lora.target_modules=[\"q_proj\"]",
    ];
    // No lora.alpha: PEFT's default (8) applies.
    let err = ok(train(&dir, &sets));
    assert!(err.contains("without --init-from") && err.contains("randomly initialised"), "{err}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["lora_alpha"].as_f64(), Some(8.0), "{cfg}");
    ok(bin().args(["generate", "--max-new-tokens", "2", "--prompt", "a"]).arg(&dir).output().unwrap());
    // Without its adapter files the folder is not silently the base.
    std::fs::remove_file(dir.join("adapter_config.json")).unwrap();
    let o = bin().args(["generate", "--max-new-tokens", "2", "--prompt", "a"]).arg(&dir).output().unwrap();
    fails(&o, "adapter_config.json is missing");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `run_id` of someone else's (any content but the ids a run writes)
/// beside the user's `tokenizer.json` and `memory.json` — names a run
/// writes too — is not an unstarted run of ours: the folder is refused and
/// nothing in it is touched.
#[test]
fn a_run_id_that_is_not_ours_does_not_make_the_folder_ours() {
    let dir = tmp("foreign-run-id");
    std::fs::create_dir_all(&dir).unwrap();
    let files: [(&str, &[u8]); 3] = [
        ("run_id", b"experiment 7, do not delete\n"),
        ("tokenizer.json", b"{\"model\": \"the user's own\"}"),
        ("memory.json", b"{\"notes\": \"the user's own\"}"),
    ];
    for (f, bytes) in files {
        std::fs::write(dir.join(f), bytes).unwrap();
    }
    let err = fails(&train(&dir, &tiny(&["train.steps=1"])), "run_id");
    assert!(err.contains(&dir.display().to_string()) && err.contains("--out"), "names the folder and the fix: {err}");
    assert!(!err.contains("never finished a step"), "not taken for a run of ours: {err}");
    for (f, bytes) in files {
        assert_eq!(std::fs::read(dir.join(f)).unwrap(), bytes, "{f} was changed");
    }
    assert!(!dir.join(".macrobatch.lock").exists() && !dir.join("metrics.jsonl").exists(), "nothing was added");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two `train` on one new `--out`: the second finds the first holding the
/// folder's lock mid-way through writing its files (here this test holds
/// it, with the first run's half-written `run_id`): it is told who is
/// setting the folder up, not about the temporary file.
#[test]
fn a_folder_being_set_up_by_another_train_names_that_process() {
    let dir = tmp("being-set-up");
    std::fs::create_dir_all(&dir).unwrap();
    let pid = std::process::id();
    let lock = std::fs::File::create(dir.join(".macrobatch.lock")).unwrap();
    lock.try_lock().unwrap();
    std::fs::write(dir.join(".macrobatch.lock"), format!("{pid} (train)\n")).unwrap();
    std::fs::write(dir.join(format!(".run_id.tmp-{pid}")), "1-2-3").unwrap();
    let err = fails(&train(&dir, &tiny(&["train.steps=1"])), &format!("is being set up by process {pid} (train)"));
    assert!(!err.contains(".run_id.tmp"), "{err}");
    drop(lock);
    let _ = std::fs::remove_dir_all(&dir);
}
