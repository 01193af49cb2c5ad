//! Helpers shared by the CLI tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_macrobatch"))
}

pub fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("macrobatch-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

pub fn with_sets(c: &mut Command, sets: &[&str]) {
    for s in sets {
        c.arg("--set").arg(s);
    }
}

pub fn train(out: &Path, sets: &[&str]) -> Output {
    let mut c = bin();
    c.arg("train").arg("--out").arg(out);
    with_sets(&mut c, sets);
    c.output().expect("binary runs")
}

/// `train --resume DIR` with `sets`.
pub fn resume(dir: &Path, sets: &[&str]) -> Output {
    let mut c = bin();
    c.arg("train").arg("--resume").arg(dir);
    with_sets(&mut c, sets);
    c.output().expect("binary runs")
}

pub fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

pub fn losses(out: &Path) -> Vec<f64> {
    metrics(out).iter().map(|r| r["loss"].as_f64().expect("loss")).collect()
}

/// A small model so that tests that are not about learning run in a second.
pub const SMALL: &[&str] = &["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64"];

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Final weights of a run, by the Hugging Face loader.
pub fn weights(out: &Path) -> Vec<f32> {
    gpt::hf::load(out).expect("saved model loads").1
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

pub fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// A model that trains a step in milliseconds.
pub const TINY: &[&str] = &[
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "batch.micro=4",
    "batch.accumulation_steps=2",
    "train.eval_every=0",
    "train.threads=1",
];

pub fn tiny<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = TINY.to_vec();
    s.extend_from_slice(extra);
    s
}

pub fn train_cmd(out: &Path, sets: &[&str]) -> Command {
    let mut c = bin();
    c.arg("train").arg("--out").arg(out);
    with_sets(&mut c, sets);
    c
}

/// A training run that must succeed; its stderr.
pub fn train_ok(out: &Path, sets: &[&str]) -> String {
    let o = train(out, sets);
    let err = stderr(&o);
    assert!(o.status.success(), "{sets:?}: {err}");
    err
}

/// `train --resume DIR` with `sets`, which must succeed; its stderr.
pub fn resume_ok(dir: &Path, sets: &[&str]) -> String {
    let o = resume(dir, sets);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    err
}

/// Every `a[i]` within `tol` of `b[i]`, relative to `b[i]`.
pub fn assert_close_rel(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * y.abs(), "{what}, line {i}: {x} vs {y} (tolerance {tol} relative)");
    }
}

/// The validation losses of a run, in step order.
pub fn val_losses(out: &Path) -> Vec<f64> {
    metrics(out).iter().filter_map(|r| r["val_loss"].as_f64()).collect()
}

/// A refused `train` (with `config`, if any, and `sets`): non-zero exit,
/// every one of `needles` in the message, and no run folder created.
pub fn refused_train(tag: &str, config: Option<&Path>, sets: &[&str], needles: &[&str]) {
    let out = tmp(&format!("refused-{tag}"));
    let mut c = bin();
    c.arg("train").arg("--out").arg(&out);
    if let Some(p) = config {
        c.arg(p);
    }
    with_sets(&mut c, sets);
    let o = c.output().expect("binary runs");
    let err = stderr(&o);
    assert!(!o.status.success(), "{tag}: must fail: {err}");
    for n in needles {
        assert!(err.contains(n), "{tag}: `{n}` missing in: {err}");
    }
    assert!(!out.exists(), "{tag}: no run folder may be created");
}

/// `macrobatch train --out out` under `mpirun -np N` on this host (shared
/// memory between the ranks), with the test fault `fault`
/// (`MACROBATCH_FAULT`) if given.
pub fn mpirun(np: usize, out: &Path, sets: &[&str], fault: Option<&str>) -> Output {
    mpirun_train(np, &[std::ffi::OsStr::new("--out"), out.as_os_str()], sets, fault)
}

/// `macrobatch train ARGS` under `mpirun -np N`, as [`mpirun`].
pub fn mpirun_train(np: usize, args: &[&std::ffi::OsStr], sets: &[&str], fault: Option<&str>) -> Output {
    let mut c = Command::new("mpirun");
    // Freed buffers go straight back to the OS, so resident-set growth
    // measures what is held (glibc otherwise keeps some in its heap).
    c.env("MALLOC_MMAP_THRESHOLD_", "65536");
    c.args(["-np", &np.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_btl", "self,vader")
        .arg(env!("CARGO_BIN_EXE_macrobatch"))
        .arg("train")
        .args(args);
    if let Some(f) = fault {
        c.env("MACROBATCH_FAULT", f);
    }
    with_sets(&mut c, sets);
    c.output().expect("mpirun runs (apt-get install openmpi-bin)")
}

/// A tiny Llama with SmolLM2's vocabulary (so its tokenizer fits), LoRA on
/// every linear layer, on the example's chat data.
pub fn chat_sets(gguf: &str) -> Vec<String> {
    [
        "model.family=llama",
        "model.preset=tiny",
        "model.vocab_size=49152",
        "data.format=jsonl",
        "data.path=../../examples/smollm-lora/train.jsonl",
        "data.val_path=../../examples/smollm-lora/heldout.jsonl",
        "data.seq_len=256",
        "lora.r=4",
        "lora.alpha=8",
        "lora.target_modules=[\"all-linear\"]",
        "batch.global=32",
        "optim.weight_decay=0.0",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("data.tokenizer={gguf}")])
    .collect()
}

/// A LoRA run of 4 steps on the tiny Llama shape from the model at `init`
/// (r = 4, α = 8 on every projection, the byte corpus, micro 2 × K 2, one
/// thread), with `sets` after these and `extra` arguments.
pub fn tiny_lora_run(out: &Path, init: &Path, sets: &[&str], extra: &[&str]) -> Output {
    let all = [TINY_LORA, sets].concat();
    let mut c = train_cmd(out, &all);
    c.arg("--init-from").arg(init).args(extra);
    c.output().expect("binary runs")
}

/// The settings of [`tiny_lora_run`]: rank-4 adapters on every projection,
/// 2 × 2 sequences of 32 tokens, 4 steps, one thread.
pub const TINY_LORA: &[&str] = &[
    "model.family=llama",
    "lora.r=4",
    "lora.alpha=8",
    "lora.target_modules=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\",\"down_proj\"]",
    "data.seq_len=32",
    "batch.micro=2",
    "batch.accumulation_steps=2",
    "train.eval_every=0",
    "train.steps=4",
    "train.threads=1",
];

/// Exit code 2 (an error), never a panic (101) or an abort (134), with
/// `needle` in its message; returns stderr.
pub fn fails(o: &Output, needle: &str) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "expected a clean error: {err}");
    assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{err}");
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
    err
}

/// A 2-layer GPT-2 small enough that a run takes a second; 4 heads, so 2
/// and 4 ranks divide them (the split suites' model).
pub const SPLIT_GPT: &[&str] = &["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=32"];

/// Llama with grouped-query attention: 4 query heads sharing 2 key/value
/// heads (2 tensor ranks split them, 4 do not: pairs of ranks share one).
pub const SPLIT_LLAMA: &[&str] = &[
    "model.family=llama",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.intermediate_size=64",
    "model.block_size=32",
];

/// The split suites' run of `model`: K = 4 micro-batches of 2, 4 steps,
/// clipping at 1, with `extra`.
pub fn split_sets<'a>(model: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = model.to_vec();
    s.extend([
        "batch.global=8",
        "batch.micro=2",
        "train.steps=4",
        "train.eval_every=2",
        "train.threads=1",
        "train.grad_clip=1.0",
    ]);
    s.extend_from_slice(extra);
    s
}

/// The saved model's weights, whichever family wrote them: the f32 data of
/// its `model.safetensors` after the header (two runs of one shape write
/// the same tensors in the same order), then its LoRA adapters' if any.
pub fn saved_weights(out: &Path) -> Vec<f32> {
    let mut w = Vec::new();
    for file in ["model.safetensors", "adapter_model.safetensors"] {
        let Ok(bytes) = std::fs::read(out.join(file)) else { continue };
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        w.extend(bytes[8 + header..].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())));
    }
    assert!(!w.is_empty(), "no weights saved in {}", out.display());
    w
}

/// The saved weights of runs `a` and `b` within `tol` of `b`'s largest.
pub fn assert_weights_close(what: &str, a: &Path, b: &Path, tol: f64) {
    let (wa, wb) = (saved_weights(a), saved_weights(b));
    let d = max_diff(&wa, &wb);
    assert!(f64::from(d) <= tol * f64::from(max_abs(&wb)), "{what}: weights differ by {d}");
}
