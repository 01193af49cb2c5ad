//! `macrobatch prepare` and training from u16 / u32 token files:
//! deterministic output for any thread count, the same losses as the text
//! path on the same tokens, and clear errors.

mod common;

use common::*;
use sha2::{Digest, Sha256};
use std::path::Path;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/moby-dick.txt");

fn prepare(args: &[&str], threads: &str) -> std::process::Output {
    bin().arg("prepare").args(args).env("RAYON_NUM_THREADS", threads).output().expect("binary runs")
}

fn u16_bytes(text: &[u8]) -> Vec<u8> {
    text.iter().flat_map(|&b| (b as u16).to_le_bytes()).collect()
}

#[test]
fn prepare_is_deterministic_and_its_files_train() {
    let dir = tmp("prepare");
    let text = std::fs::read(CORPUS).unwrap();
    let (a, rest) = text[..120_000].split_at(50_000);
    let (b, c) = rest.split_at(40_000);
    let input = dir.join("in");
    std::fs::create_dir_all(input.join("sub")).unwrap();
    std::fs::write(input.join("a.txt"), a).unwrap();
    std::fs::write(input.join("sub/c.txt"), c).unwrap();
    std::fs::write(input.join("b.txt"), b).unwrap();
    std::fs::write(input.join(".hidden"), "skipped").unwrap();

    let mut outs = Vec::new();
    for (tag, threads, chunk) in [("one", "1", "1000"), ("two", "2", "1000"), ("default", "2", "8388608")] {
        let out = dir.join(tag);
        let o = prepare(
            &[input.to_str().unwrap(), "--tokenizer", "byte", "--out", out.to_str().unwrap(), "--chunk-bytes", chunk],
            threads,
        );
        assert!(o.status.success(), "{}", stderr(&o));
        outs.push(out);
    }
    let read = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap();
    for out in &outs[1..] {
        assert_eq!(read(out, "train.bin"), read(&outs[0], "train.bin"), "same bytes for any thread count and chunking");
        assert_eq!(read(out, "val.bin"), read(&outs[0], "val.bin"));
    }
    // Byte tokens, u16, files in path order (a.txt, b.txt, sub/c.txt), the last 10 % held out.
    let all = u16_bytes(&[a, b, c].concat());
    let n_val = 12_000;
    assert_eq!(read(&outs[0], "train.bin"), all[..2 * (120_000 - n_val)]);
    assert_eq!(read(&outs[0], "val.bin"), all[2 * (120_000 - n_val)..]);
    let meta: serde_json::Value = serde_json::from_slice(&read(&outs[0], "meta.json")).unwrap();
    assert_eq!((meta["tokenizer"].as_str(), meta["dtype"].as_str()), (Some("byte"), Some("u16")));
    assert_eq!((meta["n_train_tokens"].as_u64(), meta["n_val_tokens"].as_u64()), (Some(108_000), Some(12_000)));
    let sources = meta["sources"].as_array().unwrap();
    let names: Vec<&str> = sources.iter().map(|s| s["path"].as_str().unwrap()).collect();
    assert!(names[0].ends_with("a.txt") && names[1].ends_with("b.txt") && names[2].ends_with("c.txt"), "{names:?}");
    let hex: String = Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect();
    assert_eq!(sources[1]["sha256"].as_str(), Some(hex.as_str()));

    // The prepared files train (val from its own file).
    let (train_bin, val_bin) = (outs[0].join("train.bin"), outs[0].join("val.bin"));
    let mut sets = SMALL.to_vec();
    let (p, v) = (format!("data.path={}", train_bin.display()), format!("data.val_path={}", val_bin.display()));
    sets.extend([p.as_str(), v.as_str(), "data.format=u16", "train.steps=3", "batch.global=8", "batch.micro=4"]);
    let run = dir.join("run");
    let o = train(&run, &sets);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(losses(&run).iter().all(|l| l.is_finite()));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The token-file path feeds the model exactly what the in-memory text path does.
#[test]
fn u16_and_u32_token_files_train_bit_identically_to_the_same_text() {
    let dir = tmp("same-tokens");
    std::fs::create_dir_all(&dir).unwrap();
    let text = &std::fs::read(CORPUS).unwrap()[..200_000];
    std::fs::write(dir.join("corpus.txt"), text).unwrap();
    std::fs::write(dir.join("corpus.u16"), u16_bytes(text)).unwrap();
    let u32s: Vec<u8> = text.iter().flat_map(|&b| (b as u32).to_le_bytes()).collect();
    std::fs::write(dir.join("corpus.u32"), u32s).unwrap();
    let mut runs = Vec::new();
    for (file, format) in [("corpus.txt", "text"), ("corpus.u16", "u16"), ("corpus.u32", "u32")] {
        let mut sets = SMALL.to_vec();
        let p = format!("data.path={}", dir.join(file).display());
        let f = format!("data.format={format}");
        sets.extend([p.as_str(), f.as_str(), "train.steps=4", "train.eval_every=2", "batch.global=8", "batch.micro=4"]);
        let out = dir.join(format!("run-{format}"));
        let o = train(&out, &sets);
        assert!(o.status.success(), "{format}: {}", stderr(&o));
        runs.push(metrics(&out).iter().map(|r| (r["loss"].to_string(), r["val_loss"].to_string())).collect::<Vec<_>>());
    }
    assert_eq!(runs[0].len(), 4);
    assert_eq!(runs[1], runs[0], "u16 file vs text");
    assert_eq!(runs[2], runs[0], "u32 file vs text");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prepare_and_token_file_errors_name_the_problem() {
    let dir = tmp("prepare-errors");
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.txt");
    std::fs::write(&good, "Call me Ishmael. Some years ago — never mind how long precisely —\n".repeat(200)).unwrap();
    let latin1 = dir.join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9\n").unwrap();
    let out = dir.join("out");
    let (g, o_) = (good.to_str().unwrap(), out.to_str().unwrap());
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![g, "--tokenizer", "llama", "--out", o_],
            "unknown tokenizer `llama`: this build has `byte`, `gpt2`, `PATH.gguf`, `PATH/tokenizer.json`",
        ),
        (vec!["/no/such/input.txt", "--out", o_], "/no/such/input.txt: no such file or folder"),
        (vec![latin1.to_str().unwrap(), "--out", o_], "is not UTF-8 text (invalid byte at offset 3)"),
        (vec![g, "--out", o_, "--val-fraction", "1.5"], "--val-fraction 1.5"),
    ];
    for (args, needle) in cases {
        let o = prepare(&args, "2");
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle) && !err.contains("panicked"), "{args:?}: expected `{needle}` in {err}");
        assert!(!out.join("train.bin").exists() && !out.join("train.bin.partial").exists(), "{args:?} left files");
    }
    let o = prepare(&[g, "--out", o_], "2");
    assert!(o.status.success(), "{}", stderr(&o));
    let o = prepare(&[g, "--out", o_], "2");
    assert!(stderr(&o).contains("exists already"), "never overwrites: {}", stderr(&o));

    let odd = dir.join("odd.bin");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    let (train_bin, odd_s) =
        (format!("data.path={}", out.join("train.bin").display()), format!("data.path={}", odd.display()));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec![train_bin.as_str(), "data.format=u32"], "its meta.json says u16 tokens, but data.format = \"u32\""),
        (vec![odd_s.as_str(), "data.format=u16"], "has 3 bytes, not a multiple of 2"),
        (vec![train_bin.as_str(), "data.format=u8"], "expected one of `text`"),
        (vec!["data.val_path=val.bin"], "needs data.path"),
    ];
    for (sets, needle) in cases {
        let run = dir.join("run");
        let o = train(&run, &sets);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{sets:?}: {err}");
        assert!(err.contains(needle) && !err.contains("panicked"), "{sets:?}: expected `{needle}` in {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Files `prepare` wrote train as the tokens its `meta.json` says even when
/// data.format is forgotten — as `eval` reads them —, never as text (their
/// raw u16 bytes would be read as byte tokens, half of them zeros).
#[test]
fn a_prepared_token_file_without_data_format_trains_as_its_meta_says() {
    let dir = tmp("prepared-no-format");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("corpus.txt");
    std::fs::write(&text, &std::fs::read(CORPUS).unwrap()[..60_000]).unwrap();
    let prep = dir.join("prep");
    let o = prepare(&[text.to_str().unwrap(), "--tokenizer", "byte", "--out", prep.to_str().unwrap()], "2");
    assert!(o.status.success(), "{}", stderr(&o));
    let p = format!("data.path={}", prep.join("train.bin").display());
    let v = format!("data.val_path={}", prep.join("val.bin").display());
    let (mut runs, mut err) = (Vec::new(), String::new());
    for (tag, format) in [("u16", Some("data.format=u16")), ("unset", None)] {
        let mut sets = SMALL.to_vec();
        sets.extend([p.as_str(), v.as_str(), "train.steps=3", "train.eval_every=3", "batch.global=8", "batch.micro=4"]);
        sets.extend(format);
        let out = dir.join(format!("run-{tag}"));
        let o = train(&out, &sets);
        err = stderr(&o);
        assert!(o.status.success(), "{tag}: {err}");
        runs.push(metrics(&out).iter().map(|r| (r["loss"].to_string(), r["val_loss"].to_string())).collect::<Vec<_>>());
    }
    assert_eq!(runs[0].len(), 3);
    assert_eq!(runs[1], runs[0], "data.format unset vs data.format = \"u16\" on the same prepared files");
    assert!(err.contains("meta.json") && err.contains("data.format = \"u16\""), "says how it is read: {err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
