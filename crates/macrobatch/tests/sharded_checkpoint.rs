//! Sharded checkpoints (`train.checkpoint_sharded`): every rank writes its
//! own share, each value exactly once; a resume at any (data, tensor,
//! pipeline, ZeRO) layout reads the pieces it keeps and continues bit for
//! bit as a resume from the whole (gathered) checkpoint of the same step
//! does — same losses, same final weights, at every layout (the layouts
//! themselves differ from each other by the order of sums only; see
//! tensor_cli.rs) — and as the uninterrupted run at the layout that wrote
//! it. A truncated data file falls back to the previous checkpoint; a
//! corrupt piece is named.

mod common;

use common::*;
use std::path::Path;

/// A 2-layer GPT with 4 heads (T = 2 splits them), 6 steps of a global
/// batch of 8, checkpoints at steps 3 and 6.
fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut s = vec![
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=4",
        "model.block_size=32",
        "batch.global=8",
        "batch.micro=2",
        "train.steps=6",
        "train.eval_every=0",
        "train.checkpoint_every=3",
        "train.threads=1",
        "train.grad_clip=1.0",
    ];
    s.extend_from_slice(extra);
    s
}

/// P 2 × T 2 × D 2 on eight thread ranks (K = 2).
const P2T2D2: &[&str] =
    &["dist.world_size=8", "dist.tensor_parallel=2", "dist.pipeline_parallel=2", "batch.accumulation_steps=2"];
/// Four data ranks (K = 1).
const D4: &[&str] =
    &["dist.world_size=4", "dist.tensor_parallel=1", "dist.pipeline_parallel=1", "batch.accumulation_steps=1"];
/// One rank (K = 4).
const W1: &[&str] =
    &["dist.world_size=1", "dist.tensor_parallel=1", "dist.pipeline_parallel=1", "batch.accumulation_steps=4"];

/// The final weights' bytes (every tensor, in the saved order): the run
/// folder's `model.safetensors`, or a sharded run's exported to one.
fn weight_bytes(out: &Path) -> Vec<u8> {
    if out.join("model.safetensors").exists() {
        return std::fs::read(out.join("model.safetensors")).unwrap();
    }
    let hf = out.join("exported");
    let o = bin().arg("export").arg(out).args(["--format", "hf", "--out"]).arg(&hf).output().unwrap();
    assert!(o.status.success(), "export {}: {}", out.display(), stderr(&o));
    std::fs::read(hf.join("model.safetensors")).unwrap()
}

/// A run stopped after step 3 (its checkpoint written), sharded or whole.
fn stopped(tag: &str, layout: &[&str], sharded: bool) -> std::path::PathBuf {
    let out = tmp(tag);
    let flag = if sharded { "train.checkpoint_sharded=true" } else { "train.checkpoint_sharded=false" };
    let mut c = train_cmd(&out, &sets(&[layout, &[flag]].concat()));
    let o = c.args(["--stop-after", "3"]).output().unwrap();
    assert!(o.status.success() && stderr(&o).contains("stopped after step 3"), "{tag}: {}", stderr(&o));
    out
}

/// A copy of run folder `from` resumed with `layout`: its losses and
/// final weights.
fn resumed_copy(from: &Path, tag: &str, layout: &[&str]) -> (Vec<f64>, Vec<u8>) {
    let to = tmp(tag);
    let o = std::process::Command::new("cp").arg("-a").arg(from).arg(&to).output().unwrap();
    assert!(o.status.success(), "cp: {}", String::from_utf8_lossy(&o.stderr));
    let err = resume_ok(&to, layout);
    assert!(err.contains("step-00000003"), "{tag}: {err}");
    within_plan(&to, tag, true);
    let got = (losses(&to), weight_bytes(&to));
    let _ = std::fs::remove_dir_all(&to);
    got
}

/// Every rank's heap while it loaded a sharded checkpoint and while it
/// wrote its share (memory.json; 0 where it did not) within what `plan`
/// gives that rank, and the 10% every fit keeps above it (the trainer's
/// tables besides its buffers; tests/plan_tensor.rs holds the step's plan
/// to the same): each holds its share and bounded buffers, never the whole
/// state.
fn within_plan(run: &Path, tag: &str, resumed: bool) {
    let text = std::fs::read_to_string(run.join("memory.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let list = |k: &str| -> Vec<u64> { m[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect() };
    for (measured, planned) in
        [("load_rank_heap", "planned_load_rank"), ("checkpoint_rank_heap", "planned_checkpoint_rank")]
    {
        for (r, (got, plan)) in list(measured).into_iter().zip(list(planned)).enumerate() {
            let bound = plan + plan / 10;
            assert!(got <= bound, "{tag}: rank {r}'s {measured} {got} B exceeds the plan's {plan} B + 10%");
            // A sharded run wrote (and a resumed one read) on every rank.
            let did = measured.starts_with("checkpoint") || resumed;
            assert!(got > 0 || !run.join("model.sharded.json").exists() || !did, "{tag}: rank {r}: no {measured}");
        }
    }
}

/// Bytes of every rank's data file of a sharded checkpoint.
fn data_files(dir: &Path) -> Vec<u64> {
    let mut sizes: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
        .filter(|(n, _)| n.starts_with("rank-") && n.ends_with(".bin"))
        .collect();
    sizes.sort();
    sizes.into_iter().map(|s| s.1).collect()
}

/// Parameters in a whole checkpoint's `model.safetensors` (f32 data after the header).
fn n_params(ckpt: &Path) -> u64 {
    let bytes = std::fs::read(ckpt.join("model.safetensors")).expect("model.safetensors");
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    (bytes.len() as u64 - 8 - header) / 4
}

#[test]
fn a_sharded_checkpoint_resumes_at_any_layout_bit_for_bit_as_the_whole_one() {
    for (tag, save, extra) in [("p2t2d2", P2T2D2, &[][..]), ("p2t2d2-zero1", P2T2D2, &["dist.zero_stage=1"][..])] {
        let save = [save, extra].concat();
        let sharded = stopped(&format!("sharded-{tag}"), &save, true);
        let whole = stopped(&format!("whole-{tag}"), &save, false);
        let ckpt = sharded.join("checkpoints/step-00000003");
        // Eight ranks wrote a piece each; every value of the parameters and
        // of AdamW's two slots exactly once (nothing replicated twice).
        let sizes = data_files(&ckpt);
        assert_eq!(sizes.len(), 8, "{tag}: {sizes:?}");
        let n = n_params(&whole.join("checkpoints/step-00000003"));
        assert_eq!(sizes.iter().sum::<u64>(), 3 * 4 * n, "{tag}: {sizes:?}");
        assert!(!ckpt.join("model.safetensors").exists() && !ckpt.join("optimizer.safetensors").exists());
        // At the layout that wrote it: the uninterrupted run, bit for bit.
        let straight = tmp(&format!("straight-{tag}"));
        train_ok(&straight, &sets(&[&save[..], &["train.checkpoint_sharded=true"]].concat()));
        within_plan(&straight, tag, false);
        let (l, w) = resumed_copy(&sharded, &format!("same-{tag}"), &[]);
        assert_eq!(l, losses(&straight), "{tag}: resumed at the same layout");
        assert!(w == weight_bytes(&straight), "{tag}: resumed weights differ from the uninterrupted run's");
        // At D 4 (ZeRO-3: each rank keeps a quarter) and at one rank: as the
        // whole checkpoint resumed there.
        let d4_zero3 = [D4, &["dist.zero_stage=3"]].concat();
        let w1_zero0 = [W1, &["dist.zero_stage=0"]].concat();
        for (at, layout) in [("d4", D4), ("d4-zero3", &d4_zero3[..]), ("w1", &w1_zero0[..])] {
            let a = resumed_copy(&sharded, &format!("s-{tag}-{at}"), layout);
            let b = resumed_copy(&whole, &format!("w-{tag}-{at}"), layout);
            assert_eq!(a.0.len(), 6, "{tag} -> {at}");
            assert_eq!(a.0, b.0, "{tag} -> {at}: losses of the sharded and the whole checkpoint's resumes");
            assert!(
                a.1 == b.1,
                "{tag} -> {at}: final weights of the sharded and the whole checkpoint's resumes differ"
            );
        }
        for d in [sharded, whole, straight] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[test]
fn a_zero3_sharded_checkpoint_resumes_on_another_number_of_ranks() {
    // Uneven ZeRO pieces (3 ranks, padding) written, read back by 2 and by
    // pipeline × tensor ranks.
    let save: &[&str] =
        &["dist.world_size=3", "dist.zero_stage=3", "batch.global=6", "batch.accumulation_steps=2", "batch.micro=1"];
    let sharded = stopped("z3-sharded", save, true);
    let whole = stopped("z3-whole", save, false);
    let p2t2: &[&str] = &[
        "dist.world_size=4",
        "dist.zero_stage=1",
        "dist.tensor_parallel=2",
        "dist.pipeline_parallel=2",
        "batch.accumulation_steps=6",
    ];
    let d2: &[&str] = &["dist.world_size=2", "batch.accumulation_steps=3"];
    for (at, layout) in [("d2", d2), ("p2t2", p2t2)] {
        let a = resumed_copy(&sharded, &format!("z3-s-{at}"), layout);
        let b = resumed_copy(&whole, &format!("z3-w-{at}"), layout);
        assert_eq!(a.0, b.0, "zero3 -> {at}: losses");
        assert!(a.1 == b.1, "zero3 -> {at}: final weights differ");
    }
    let _ = std::fs::remove_dir_all(&sharded);
    let _ = std::fs::remove_dir_all(&whole);
}

#[test]
fn a_damaged_sharded_checkpoint_is_skipped_or_named() {
    let out = tmp("sharded-damaged");
    let two: &[&str] = &["dist.world_size=2", "train.checkpoint_sharded=true"];
    train_ok(&out, &sets(two));
    let last = out.join("checkpoints/step-00000006");
    // Truncated: the length check skips it, and the run resumes from step 3.
    let data = last.join("rank-00001.bin");
    let len = std::fs::metadata(&data).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&data).unwrap().set_len(len - 4).unwrap();
    let err = resume_ok(&out, &["train.steps=7"]);
    assert!(err.contains("skipping checkpoint") && err.contains("rank-00001.bin"), "{err}");
    assert!(err.contains("step-00000003"), "{err}");
    // A flipped byte inside a piece: its checksum names the piece and file.
    let ckpt = out.join("checkpoints/step-00000007");
    let data = ckpt.join("rank-00000.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&data, &bytes).unwrap();
    let o = resume(&out, &["train.steps=8"]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("does not match its checksum") && err.contains("rank-00000.bin"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn sharded_checkpoints_refuse_what_they_do_not_combine_with() {
    refused_train(
        "sharded-async",
        None,
        &sets(&["train.checkpoint_sharded=true", "train.checkpoint_async=true"]),
        &["train.checkpoint_sharded", "train.checkpoint_async = false"],
    );
}

#[test]
fn a_sharded_runs_final_model_is_its_last_checkpoint_for_generate_and_export() {
    // Without train.checkpoint_every the last step is still written: it is
    // the model. `generate` reads it where it is, `export` gathers it into
    // the whole run's very file.
    let two: &[&str] = &["dist.world_size=2", "train.checkpoint_every=0"];
    let (sharded, whole) = (tmp("final-sharded"), tmp("final-whole"));
    train_ok(&sharded, &sets(&[two, &["train.checkpoint_sharded=true"]].concat()));
    train_ok(&whole, &sets(two));
    assert!(sharded.join("model.sharded.json").exists() && !sharded.join("model.safetensors").exists());
    assert!(sharded.join("checkpoints/step-00000006/rank-00001.bin").exists());
    assert!(weight_bytes(&sharded) == weight_bytes(&whole), "exported weights differ from the whole run's");
    let generated = |dir: &Path| {
        let o =
            bin().arg("generate").arg(dir).args(["--prompt", "Call me", "--max-new-tokens", "12"]).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        o.stdout
    };
    assert_eq!(generated(&sharded), generated(&whole));
    // And a new run starts from it as from the whole run's model.
    let (from_sharded, from_whole) = (tmp("init-from-sharded"), tmp("init-from-whole"));
    for (out, init) in [(&from_sharded, &sharded), (&from_whole, &whole)] {
        let o = train_cmd(out, &sets(&["train.steps=2"])).arg("--init-from").arg(init).output().unwrap();
        assert!(o.status.success(), "--init-from {}: {}", init.display(), stderr(&o));
    }
    assert_eq!(losses(&from_sharded), losses(&from_whole), "--init-from a sharded run folder");
    let _ = std::fs::remove_dir_all(&from_sharded);
    let _ = std::fs::remove_dir_all(&from_whole);
    let _ = std::fs::remove_dir_all(&sharded);
    let _ = std::fs::remove_dir_all(&whole);
}

/// Llama with grouped-query attention: 4 query heads sharing 2 key/value
/// heads, so at T = 4 pairs of tensor ranks hold the same key/value piece
/// (one of them writes it).
const LLAMA: &[&str] = &[
    "model.family=llama",
    "model.n_kv_head=2",
    "model.intermediate_size=64",
    "dist.world_size=4",
    "dist.tensor_parallel=4",
    "batch.accumulation_steps=4",
];

/// A run's settings, the layout that saved it and the layout it resumes at.
type Case<'a> = (&'a str, Vec<&'a str>, &'a [&'a str], &'a [&'a str]);

#[test]
fn every_optimizer_split_and_frozen_set_resumes_from_pieces_as_from_the_whole_checkpoint() {
    let one: &[&str] =
        &["dist.world_size=1", "dist.tensor_parallel=1", "dist.pipeline_parallel=1", "batch.accumulation_steps=4"];
    let d2: &[&str] =
        &["dist.world_size=2", "dist.tensor_parallel=1", "dist.pipeline_parallel=1", "batch.accumulation_steps=2"];
    let d2_zero2: &[&str] = &["dist.world_size=2", "dist.zero_stage=2", "batch.accumulation_steps=2"];
    let p2d2_zero1: &[&str] =
        &["dist.world_size=4", "dist.pipeline_parallel=2", "dist.zero_stage=1", "batch.accumulation_steps=2"];
    let d4_zero3: &[&str] = &["dist.world_size=4", "dist.zero_stage=3", "batch.accumulation_steps=1"];
    let frozen = "train.trainable=[\"transformer.h.1.*\", \"transformer.wte.weight\"]";
    // (tag, the run's settings, where it was saved, where it resumes)
    let vocab = [LLAMA, &["dist.vocab_parallel=true", "model.tie_word_embeddings=false"]].concat();
    let cases: [Case; 6] = [
        ("gqa-t4", LLAMA.to_vec(), &[], d2),
        // The embedding and head saved as vocabulary slices, read back whole.
        ("gqa-t4-vocab", vocab, &[], d2),
        ("adamw8bit-zero2", vec!["optim.name=adamw8bit"], d2_zero2, d4_zero3),
        ("adafactor-p2d2", vec!["optim.name=adafactor", "optim.adafactor.beta1=0.9"], p2d2_zero1, one),
        ("frozen-zero2", vec![frozen], d2_zero2, p2d2_zero1),
        ("bf16-zero1-master-sharded", vec!["train.precision=bf16", "dist.zero_stage=1"], d2, d4_zero3),
    ];
    for (tag, run, save, at) in cases {
        let save = [&run[..], save].concat();
        let sharded = stopped(&format!("cov-s-{tag}"), &save, true);
        let whole = stopped(&format!("cov-w-{tag}"), &save, false);
        let at = [&run[..], at].concat();
        let a = resumed_copy(&sharded, &format!("cov-rs-{tag}"), &at);
        let b = resumed_copy(&whole, &format!("cov-rw-{tag}"), &at);
        assert_eq!(a.0.len(), 6, "{tag}");
        assert_eq!(a.0, b.0, "{tag}: losses of the sharded and the whole checkpoint's resumes");
        assert!(a.1 == b.1, "{tag}: final weights of the sharded and the whole checkpoint's resumes differ");
        let _ = std::fs::remove_dir_all(&sharded);
        let _ = std::fs::remove_dir_all(&whole);
    }
}
