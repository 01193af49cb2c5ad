//! The end of a fine-tune, through the command line: `eval` measures what
//! the run's own validation measured, and `export` writes models that
//! compute what the run computes (a Hugging Face folder here; the GGUF file
//! and transformers' readings of both in scripts/export_check.py, run by CI).

mod common;
use common::*;
use std::path::Path;

/// The mean loss, targets and samples of `eval MODEL --data DATA ARGS --json`.
fn eval_json(model: &Path, data: &Path, args: &[&str]) -> serde_json::Value {
    let o = bin().arg("eval").arg(model).arg("--data").arg(data).args(args).arg("--json").output().unwrap();
    assert!(o.status.success(), "eval {args:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("eval --json prints one object: {e}"))
}

fn refused(args: &[&std::ffi::OsStr], needles: &[&str]) {
    let o = bin().args(args).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?} must fail with a message: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: expected `{n}` in: {err}");
    }
}

/// [`chat_sets`] at micro 4 × K 2 for 3 steps, evaluated on every held-out
/// example (60 of them: 15 micro-batches of 4).
fn chat_run(out: &Path, gguf: &Path) {
    let mut sets = chat_sets(&gguf.display().to_string());
    sets.extend(
        [
            "batch.global=8",
            "batch.micro=4",
            "batch.accumulation_steps=2",
            "train.steps=3",
            "train.eval_every=0",
            "train.eval_batches=15",
            "optim.lr=3e-3",
        ]
        .map(String::from),
    );
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    train_ok(out, &sets);
}

/// A checkpoint carries no tokenizer: `eval` (and `generate`) of one
/// tokenizes with its run's (`data.tokenizer`, here SmolLM2's GGUF), so the
/// last step's checkpoint evaluates as the finished run folder, to the bit.
#[test]
fn a_checkpoint_evaluates_with_its_runs_tokenizer() {
    let Some(gguf) = gguf::testing::smollm2_or_skip("eval_export") else { return };
    let out = tmp("eval-checkpoint");
    let mut sets = chat_sets(&gguf.display().to_string());
    sets.extend(["batch.micro=4", "train.steps=2", "train.eval_every=0", "train.checkpoint_every=2"].map(String::from));
    train_ok(&out, &sets.iter().map(String::as_str).collect::<Vec<_>>());
    let heldout = Path::new("../../examples/smollm-lora/heldout.jsonl");
    let (run, ck) = (eval_json(&out, heldout, &[]), eval_json(&out.join("checkpoints/step-00000002"), heldout, &[]));
    assert_eq!(run["samples"], 60, "{run}");
    assert_eq!(
        (ck["samples"].clone(), ck["loss"].clone()),
        (run["samples"].clone(), run["loss"].clone()),
        "{ck} vs {run}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// The loss `eval` reports on the held-out file is the validation loss the
/// run logged on it: the same examples, masking and micro-batches, so the
/// same sums in the same order — equal to the last bit. Two thread ranks
/// take the micro-batches in turn and give the same number.
#[test]
fn eval_on_the_heldout_file_equals_the_runs_validation_loss() {
    let Some(gguf) = gguf::testing::smollm2_or_skip("eval_export") else { return };
    let out = tmp("eval-chat");
    chat_run(&out, &gguf);
    let logged = *val_losses(&out).last().expect("the last step is evaluated");
    let heldout = Path::new("../../examples/smollm-lora/heldout.jsonl");
    let one = eval_json(&out, heldout, &[]);
    assert_eq!(one["samples"], 60, "{one}");
    assert_eq!(one["micro"], 4, "the run's batch.micro: {one}");
    let loss = one["loss"].as_f64().unwrap();
    assert_eq!(loss.to_bits(), logged.to_bits(), "eval {loss} vs the run's validation loss {logged}");
    assert!((one["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-9 * loss.exp());
    let two = eval_json(&out, heldout, &["--world-size", "2"]);
    assert_eq!(two["loss"].as_f64().unwrap().to_bits(), logged.to_bits(), "two thread ranks: {two}");
    assert_eq!(two["targets"], one["targets"]);
    // Exact match: the greedy reply to each conversation against its last
    // assistant message; a 3-step tiny model matches none, but every
    // conversation is asked.
    let em = eval_json(&out, heldout, &["--exact-match", "--max-new-tokens", "4", "--max-samples", "3"]);
    assert_eq!(em["exact_match"]["examples"], 3, "{em}");
    assert!(em["exact_match"]["generated_tokens"].as_u64().unwrap() <= 12, "{em}");

    // A GGUF file is a model too (dequantised to f32): the pretrained
    // SmolLM2 predicts the held-out replies far better than the tiny run.
    let g = eval_json(&gguf, heldout, &["--max-samples", "2", "--seq-len", "256"]);
    let gl = g["loss"].as_f64().unwrap();
    assert!(gl.is_finite() && gl < loss / 2.0, "SmolLM2 {gl} vs the tiny run {loss}");

    // The merged Hugging Face export computes the adapted model: the same
    // held-out loss within f32 rounding of W + α/r·B·A (the merged weight
    // is rounded once where the adapted model adds two products: ~1e-7
    // relative per weight, measured ~1e-7 on the loss; a wrong scale or a
    // missing adapter moves it by 1e-2), and the same greedy answer.
    let hf = out.join("export-hf");
    let o = bin().arg("export").arg(&out).args(["--format", "hf", "--out"]).arg(&hf).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(hf.join(f).is_file(), "the export holds {f}");
    }
    assert!(!hf.join("adapter_config.json").exists(), "adapters are merged, not copied");
    let merged = eval_json(&hf, heldout, &["--micro", "4", "--seq-len", "256"]);
    let m = merged["loss"].as_f64().unwrap();
    assert!((m - loss).abs() < 1e-5 * loss, "merged export {m} vs run {loss}");
    let greedy = |model: &Path| {
        let o = bin()
            .arg("generate")
            .arg(model)
            .args(["--chat", "--prompt", "Who is Starbuck?", "--temperature", "0", "--max-new-tokens", "8"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(greedy(&out), greedy(&hf), "the merged export answers as base + adapters");
    let gen: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("generation_config.json")).unwrap()).unwrap();
    assert!(gen["eos_token_id"].is_u64(), "{gen}");

    // GGUF: one file our own loader reads back (llama.cpp's names, Q/K rows
    // permuted and back). f32 holds the merged weights exactly: the same
    // loss as the HF export to the last bit, the same greedy answer. Q8_0
    // and Q4_0 round each weight to 1/254 and 1/16 of its block's largest
    // magnitude: the loss moves by well under 1% and 5% (measured 5e-5 and
    // 4e-4 relative on this near-uniform tiny model), and it does move.
    let f32_file = out.join("export.gguf");
    let o = bin().arg("export").arg(&out).args(["--format", "gguf", "--out"]).arg(&f32_file).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let gf = eval_json(&f32_file, heldout, &["--micro", "4", "--seq-len", "256"])["loss"].as_f64().unwrap();
    assert_eq!(gf.to_bits(), m.to_bits(), "f32 GGUF {gf} vs merged HF folder {m}");
    assert_eq!(greedy(&out), greedy(&f32_file), "the GGUF export answers as base + adapters");
    for (dtype, tol) in [("q8_0", 1e-2), ("q4_0", 5e-2)] {
        let file = out.join(format!("export-{dtype}.gguf"));
        let o = bin()
            .arg("export")
            .arg(&out)
            .args(["--format", "gguf", "--dtype", dtype, "--out"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(o.status.success(), "{dtype}: {}", stderr(&o));
        let q = eval_json(&file, heldout, &["--micro", "4", "--seq-len", "256"])["loss"].as_f64().unwrap();
        // The file's projections stay in their blocks unless --dequantize
        // makes them f32: the packed GEMMs compute the dequantised model.
        let d =
            eval_json(&file, heldout, &["--micro", "4", "--seq-len", "256", "--dequantize"])["loss"].as_f64().unwrap();
        assert_eq!(q.to_bits(), d.to_bits(), "{dtype}: packed {q} vs dequantised {d}");
        println!("{dtype}: loss {q} vs f32 {gf} ({:.1e} relative)", (q - gf).abs() / gf);
        assert!((q - gf).abs() < tol * gf && q != gf, "{dtype} export {q} vs f32 {gf}");
    }
    // A LoRA run on the Q8_0 file refers to it (base.json): `eval` of its
    // folder reads that file as a model file is read (projections and
    // embedding in their Q8_0 blocks) with the adapters in the layout, to
    // the loss of the f32 reading, bit for bit.
    let ft = tmp("eval-lora-on-q8");
    let mut sets = chat_sets(&gguf.display().to_string());
    sets.extend(["batch.micro=4", "train.steps=2", "train.eval_every=0"].map(String::from));
    let mut c = train_cmd(&ft, &sets.iter().map(String::as_str).collect::<Vec<_>>());
    let o = c.arg("--init-from").arg(out.join("export-q8_0.gguf")).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(ft.join("base.json").is_file() && !ft.join("model.safetensors").exists());
    let (packed, whole) = (eval_json(&ft, heldout, &[]), eval_json(&ft, heldout, &["--dequantize"]));
    assert!(packed["weights"].as_str().unwrap().contains("frozen in q8_0"), "{packed}");
    assert!(!whole["weights"].as_str().unwrap().contains("frozen"), "{whole}");
    assert_eq!(
        packed["loss"].as_f64().unwrap().to_bits(),
        whole["loss"].as_f64().unwrap().to_bits(),
        "{packed} vs {whole}"
    );
    let _ = std::fs::remove_dir_all(&ft);
    // An existing file is kept without --force.
    let before = std::fs::metadata(&f32_file).unwrap().len();
    let o = bin()
        .arg("export")
        .arg(&out)
        .args(["--format", "gguf", "--dtype", "q8_0", "--out"])
        .arg(&f32_file)
        .output()
        .unwrap();
    assert!(!o.status.success() && stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(std::fs::metadata(&f32_file).unwrap().len(), before, "the existing file is untouched");

    // bf16: half the bytes, and the loss within bf16's rounding of the
    // weights (8 bits of mantissa: ~4e-3 relative per weight, well under
    // 1e-2 of the loss through two layers).
    let half = out.join("export-bf16");
    let o =
        bin().arg("export").arg(&out).args(["--format", "hf", "--dtype", "bf16", "--out"]).arg(&half).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let size = |d: &Path| std::fs::metadata(d.join("model.safetensors")).unwrap().len() as f64;
    assert!((size(&half) / size(&hf) - 0.5).abs() < 0.01, "bf16 holds 2 bytes a weight");
    let b = eval_json(&half, heldout, &["--micro", "4", "--seq-len", "256"])["loss"].as_f64().unwrap();
    assert!((b - loss).abs() < 1e-2 * loss && b != loss, "bf16 export {b} vs run {loss}");
}

/// Text is read as training reads it: windows of seq_len + 1 tokens; the
/// sums do not depend on how many thread ranks computed them; a token file
/// written by `prepare` from the same text scores the same.
#[test]
fn eval_reads_text_and_token_files_alike() {
    let out = tmp("eval-text");
    train_ok(&out, &tiny(&["train.steps=2"]));
    let text = out.join("held.txt");
    let passage = "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the world. ";
    std::fs::write(&text, passage.repeat(8)).unwrap();
    let a = eval_json(&out, &text, &["--seq-len", "32", "--micro", "2"]);
    let n = passage.len() * 8;
    // Windows of 33 tokens, each starting at the last token of the one
    // before: every token but the first is a target exactly once.
    assert_eq!(a["samples"].as_u64().unwrap() as usize, (n - 1) / 32, "{a}");
    assert_eq!(a["targets"].as_u64().unwrap(), 32 * a["samples"].as_u64().unwrap());
    let b = eval_json(&out, &text, &["--seq-len", "32", "--micro", "2", "--world-size", "2"]);
    assert_eq!(a["loss"], b["loss"]);
    let prepared = out.join("prepared");
    let o = bin().arg("prepare").arg(&text).arg("--out").arg(&prepared).args(["--val-fraction", "0"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let c = eval_json(&out, &prepared.join("train.bin"), &["--seq-len", "32", "--micro", "2"]);
    assert_eq!(c["format"], "u16", "{c}");
    assert_eq!((a["loss"].clone(), a["samples"].clone()), (c["loss"].clone(), c["samples"].clone()));

    // An untrained copy (1e-12 learning rate) scores worse: eval sees the weights.
    let fresh = tmp("eval-text-fresh");
    train_ok(&fresh, &tiny(&["train.steps=1", "optim.lr=1e-12", "schedule.min_lr=0"]));
    let f = eval_json(&fresh, &text, &["--seq-len", "32", "--micro", "2"]);
    assert!(f["loss"].as_f64().unwrap() > a["loss"].as_f64().unwrap(), "{f} vs {a}");
    let _ = std::fs::remove_dir_all(&fresh);
    let _ = std::fs::remove_dir_all(&out);
}

/// Bad input is refused with what to do, and nothing saved is replaced.
#[test]
fn eval_and_export_refuse_bad_input() {
    let out = tmp("export-bad");
    train_ok(&out, &tiny(&["train.steps=2"]));
    let os = |s: &str| std::ffi::OsString::from(s);
    let p = |s: &Path| s.as_os_str().to_owned();
    // A token file whose vocabulary does not fit the byte model.
    let text = out.join("t.txt");
    std::fs::write(&text, "hello world, hello tokens. ".repeat(40)).unwrap();
    let prepared = out.join("gpt2-tokens");
    let o = bin().arg("prepare").arg(&text).arg("--out").arg(&prepared).args(["--tokenizer", "gpt2"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let args = [os("eval"), p(&out), os("--data"), p(&prepared.join("train.bin"))];
    refused(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), &["vocab"]);
    // --exact-match on text.
    let args = [os("eval"), p(&out), os("--data"), p(&text), os("--exact-match")];
    refused(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), &["--exact-match needs chat JSON Lines"]);
    // --max-samples 0 counts nothing: the option is at fault, not the data.
    let args = [os("eval"), p(&out), os("--data"), p(&text), os("--max-samples"), os("0")];
    refused(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), &["--max-samples must be at least 1"]);

    // A q8_0 Hugging Face folder does not exist.
    let dest = tmp("export-bad-dest");
    let args = [os("export"), p(&out), os("--format"), os("hf"), os("--dtype"), os("q8_0"), os("--out"), p(&dest)];
    refused(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), &["--format gguf"]);
    assert!(!dest.exists());
    // An existing output is kept without --force; with it, only an export
    // of ours is replaced, never a folder of the user's.
    std::fs::create_dir_all(&dest).unwrap();
    std::fs::write(dest.join("mine.txt"), "keep me").unwrap();
    let args = [os("export"), p(&out), os("--format"), os("hf"), os("--out"), p(&dest)];
    refused(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), &["exists", "--force"]);
    assert_eq!(std::fs::read_to_string(dest.join("mine.txt")).unwrap(), "keep me");
    let forced = [&args[..], &[os("--force")]].concat();
    refused(&forced.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), &["not an export", "mine.txt"]);
    assert_eq!(std::fs::read_to_string(dest.join("mine.txt")).unwrap(), "keep me");
    std::fs::remove_file(dest.join("mine.txt")).unwrap();
    for _ in 0..2 {
        let o = bin().args(&forced).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(dest.join("model.safetensors").is_file());
    }
    // A run stopped before its end holds checkpoints, no model: say where they are.
    let stopped = tmp("export-stopped");
    let mut c = train_cmd(&stopped, &tiny(&["train.steps=4", "train.checkpoint_every=1"]));
    let o = c.arg("--stop-after").arg("2").output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let args = [os("export"), p(&stopped), os("--format"), os("hf"), os("--out"), p(&out.join("x"))];
    refused(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), &["no final model", "checkpoint is step 2"]);
    let _ = std::fs::remove_dir_all(&stopped);
    let _ = std::fs::remove_dir_all(&dest);
    let _ = std::fs::remove_dir_all(&out);
}

/// Every file below `dir` with its bytes, by path relative to `dir`.
fn tree(dir: &Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.insert(p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
            }
        }
    }
    files
}

/// `export RUN --out X --force` never deletes what is not an export of
/// ours: a folder holding the run (its parent, `.`), a part of the run,
/// the user's folder or file. Each is refused, naming the problem, and
/// every file stays as it was.
#[test]
fn export_force_never_deletes_the_run_its_siblings_or_the_users_files() {
    let parent = tmp("export-parent");
    let run = parent.join("run");
    train_ok(&run, &tiny(&["train.steps=1"]));
    train_ok(&parent.join("sibling-run"), &tiny(&["train.steps=1"]));
    std::fs::write(parent.join("notes.txt"), "the user's notes").unwrap();
    std::fs::create_dir_all(parent.join("mine")).unwrap();
    std::fs::write(parent.join("mine/config.json"), "{\"mine\": true}").unwrap();
    std::fs::write(parent.join("data.gguf"), "not a model").unwrap();
    std::fs::create_dir_all(run.join("checkpoints")).unwrap();
    let before = tree(&parent);
    let export = |out: &Path, format: &str, cwd: &Path| {
        bin().current_dir(cwd).arg("export").arg(&run).args(["--format", format, "--force", "--out"]).arg(out).output()
    };
    let cases: [(&Path, &str, &Path, &[&str]); 6] = [
        (&parent, "hf", Path::new("."), &["holds the model being exported", "choose"]),
        (Path::new("."), "hf", &parent, &["holds the model being exported", "choose"]),
        (&parent.join("run/checkpoints"), "hf", Path::new("."), &["inside the model being exported", "choose"]),
        (&parent.join("sibling-run"), "hf", Path::new("."), &["not an export", "sibling-run", "metrics.jsonl"]),
        (&parent.join("mine"), "hf", Path::new("."), &["not an export", "mine"]),
        (&parent.join("data.gguf"), "gguf", Path::new("."), &["not a GGUF file", "data.gguf"]),
    ];
    for (out, format, cwd, needles) in cases {
        let o = export(out, format, cwd).unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "--out {} must be refused: {err}", out.display());
        for n in needles {
            assert!(err.contains(n), "--out {}: expected `{n}` in: {err}", out.display());
        }
        assert!(tree(&parent) == before, "--out {}: files changed or removed", out.display());
    }
    // An export of ours is replaced with --force; a new path inside the run is fine.
    let hf = parent.join("hf");
    for _ in 0..2 {
        let o = export(&hf, "hf", Path::new(".")).unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let gguf = parent.join("model.gguf");
    for _ in 0..2 {
        let o = export(&gguf, "gguf", Path::new(".")).unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let o = export(&run.join("exported"), "hf", Path::new(".")).unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&parent);
}

/// Two exports to one path at once: one writes it, the other is told the
/// path is being written (or exists) and writes nothing; the file is
/// whole, one export's bytes. Without --force a later export never
/// replaces it, and a lock left by a dead process does not block.
#[test]
fn concurrent_exports_to_one_path_never_mix_or_replace_each_other() {
    let dir = tmp("export-race");
    let run = dir.join("run");
    train_ok(&run, &tiny(&["train.steps=1"]));
    let export = |dtype: &str, out: &Path| {
        let mut c = bin();
        c.arg("export").arg(&run).args(["--format", "gguf", "--dtype", dtype, "--out"]).arg(out);
        c.stderr(std::process::Stdio::piped());
        c
    };
    let mut reference = std::collections::HashMap::new();
    for dtype in ["f32", "f16"] {
        let file = dir.join(format!("ref-{dtype}.gguf"));
        let o = export(dtype, &file).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        reference.insert(dtype, std::fs::read(&file).unwrap());
    }
    assert_ne!(reference["f32"], reference["f16"]);
    for round in 0..3 {
        let out = dir.join(format!("race-{round}.gguf"));
        let children = [export("f32", &out).spawn().unwrap(), export("f16", &out).spawn().unwrap()];
        let outputs: Vec<_> = children.map(|c| c.wait_with_output().unwrap()).into_iter().collect();
        let won: Vec<&str> =
            ["f32", "f16"].into_iter().zip(&outputs).filter(|(_, o)| o.status.success()).map(|(d, _)| d).collect();
        let errs: Vec<String> = outputs.iter().map(stderr).collect();
        assert_eq!(won.len(), 1, "round {round}: exactly one export writes a path that did not exist: {errs:?}");
        let lost = outputs.iter().find(|o| !o.status.success()).unwrap();
        assert_eq!(lost.status.code(), Some(2), "{errs:?}");
        let err = stderr(lost);
        assert!(err.contains("is being written by process") || err.contains("exists"), "{err}");
        assert!(std::fs::read(&out).unwrap() == reference[won[0]], "round {round}: the file is whole, {}'s", won[0]);
    }
    // Nothing left beside the outputs: no staging file, no lock.
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["race-0.gguf", "race-1.gguf", "race-2.gguf", "ref-f16.gguf", "ref-f32.gguf", "run"]);
    // A later export without --force leaves the file byte for byte.
    let out = dir.join("race-0.gguf");
    let kept = std::fs::read(&out).unwrap();
    let o = export("q8_0", &out).output().unwrap();
    assert!(o.status.code() == Some(2) && stderr(&o).contains("--force"), "{}", stderr(&o));
    assert!(std::fs::read(&out).unwrap() == kept);
    // A live holder's lock is respected; a dead one's is taken over.
    let lock = dir.join("locked.gguf.lock");
    std::fs::write(&lock, format!("{}\n", std::process::id())).unwrap();
    let o = export("f32", &dir.join("locked.gguf")).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("is being written by process {}", std::process::id())), "{err}");
    assert!(!dir.join("locked.gguf").exists() && lock.exists());
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    std::fs::write(&lock, format!("{dead_pid}\n")).unwrap();
    // What an export killed mid-write left (its staging file, and the old
    // folder it was replacing) goes; a live process's staging stays.
    let stale_file = dir.join(format!(".locked.gguf.part-{dead_pid}"));
    let stale_dir = dir.join(format!(".locked.gguf.part-{dead_pid}.old"));
    let live = dir.join(format!(".locked.gguf.part-{}", std::process::id()));
    std::fs::write(&stale_file, b"half a gguf").unwrap();
    std::fs::create_dir(&stale_dir).unwrap();
    std::fs::write(stale_dir.join("model.safetensors"), b"old").unwrap();
    std::fs::write(&live, b"being written").unwrap();
    let o = export("f32", &dir.join("locked.gguf")).output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "a dead process's lock is stale: {err}");
    assert!(std::fs::read(dir.join("locked.gguf")).unwrap() == reference["f32"] && !lock.exists());
    assert!(!stale_file.exists() && !stale_dir.exists() && live.exists(), "{err}");
    assert_eq!(err.matches("killed before it finished").count(), 2, "{err}");
    // A full disk while an HF folder is written: the message names the
    // export's weights (not "a checkpoint file"), and nothing is left.
    let full = dir.join("full-hf");
    let mut c = bin();
    c.arg("export").arg(&run).args(["--format", "hf", "--out"]).arg(&full);
    let o = c.env("MACROBATCH_FAULT", "kind=enospc,bytes=1000").output().unwrap();
    let err = fails(&o, "No space left on device");
    assert!(err.contains("cannot write the model's weights for --out") && !err.contains("checkpoint"), "{err}");
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("full-hf"))
        .collect();
    assert!(left.is_empty(), "a failed export leaves nothing: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
