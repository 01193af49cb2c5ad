//! Data that would make a run fail late, loop or lie, through the command
//! line: chats whose reply lies beyond `seq_len`, a validation set without
//! targets, symlink loops and prepare's own outputs as input, a token file
//! truncated during training, text given as token ids, a validation file
//! that is the training file, and JSON Lines errors.

mod common;

use common::*;
use data::{BpeParts, BpeTokenizer, PreTokenizer};
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/moby-dick.txt");

/// ChatML over byte tokens: one token per byte, `<|im_start|>` = 256,
/// `<|im_end|>` = 257 (EOS), saved as `dir/tokenizer.json` (+ config);
/// returns the `data.tokenizer` value.
fn byte_chatml(dir: &Path) -> String {
    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    let mut tokens: Vec<String> = data::bpe::byte_to_char().iter().map(|c| c.to_string()).collect();
    tokens.extend(["<|im_start|>".to_string(), "<|im_end|>".to_string()]);
    let t = BpeTokenizer::from_parts(BpeParts {
        source_name: "test".into(),
        tokens,
        merges: vec![],
        special_ids: vec![256, 257],
        added_ids: vec![],
        pre_tokenizer: PreTokenizer::Gpt2,
        bos_id: None,
        eos_id: Some(257),
        pad_id: None,
        add_bos: false,
        add_eos: false,
        chat_template: Some(CHATML.into()),
    })
    .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    t.save_pretrained(dir).unwrap();
    format!("data.tokenizer={}", dir.join("tokenizer.json").display())
}

fn chat(question: &str, reply: &str) -> String {
    format!(
        r#"{{"messages": [{{"role": "user", "content": "{question}"}}, {{"role": "assistant", "content": "{reply}"}}]}}"#
    )
}

/// A question whose rendering alone fills more than 48 positions.
const LONG: &str = "a question so long that the reply starts beyond the sequence length of this run";

/// Sets for a small GPT on JSON Lines of byte ChatML, T = 48, global 2 = micro 1 × K 2, no shuffling.
fn jsonl_sets(tok: &str, train: &Path, val: &Path, extra: &[&str]) -> Vec<String> {
    let mut sets: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
    sets.extend([
        "model.vocab_size=258".into(),
        tok.into(),
        "data.format=jsonl".into(),
        format!("data.path={}", train.display()),
        format!("data.val_path={}", val.display()),
        "data.seq_len=48".into(),
        "data.shuffle=false".into(),
        "batch.global=2".into(),
        "batch.micro=1".into(),
        "train.eval_every=2".into(),
        "train.eval_batches=2".into(),
    ]);
    sets.extend(extra.iter().map(|s| s.to_string()));
    sets
}

fn train_with(out: &Path, sets: &[String]) -> Output {
    let refs: Vec<&str> = sets.iter().map(String::as_str).collect();
    train(out, &refs)
}

/// Six chats, the last two with replies beyond T: in file order (no
/// shuffling) step 3 of each epoch would be those two alone, a global batch
/// without targets, and a resume would stop there again. They are dropped at
/// load, named by line, and 3 epochs of the 4 left train; with
/// data.drop_empty = false they are refused before training, naming them.
#[test]
fn chats_whose_reply_lies_beyond_seq_len_are_dropped_or_refused_at_load() {
    let dir = tmp("cut-chats");
    let tok = byte_chatml(&dir.join("tok"));
    let mut lines: Vec<String> = (0..4).map(|i| chat(&format!("q{i}"), &format!("answer {i}"))).collect();
    lines.extend([chat(LONG, "lost"), chat(LONG, "lost too")]);
    let (train_p, val_p) = (dir.join("train.jsonl"), dir.join("val.jsonl"));
    std::fs::write(&train_p, lines.join("\n")).unwrap();
    std::fs::write(&val_p, [chat("v", "held out"), chat("w", "also")].join("\n")).unwrap();

    let run = dir.join("run");
    let o = train_with(&run, &jsonl_sets(&tok, &train_p, &val_p, &["train.steps=6"]));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("dropped 2 examples") && err.contains("lines 5, 6"), "{err}");
    let m = metrics(&run);
    assert_eq!(m.len(), 6, "3 epochs of 2 steps");
    assert!(m.iter().all(|r| r["loss"].as_f64().is_some_and(f64::is_finite)));

    let run = dir.join("refused");
    let o = train_with(&run, &jsonl_sets(&tok, &train_p, &val_p, &["train.steps=6", "data.drop_empty=false"]));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(train_p.to_str().unwrap()) && err.contains("lines 5, 6;"), "{err}");
    assert!(err.contains("data.drop_empty = true") && !err.contains("panicked"), "{err}");
    assert!(!run.join("metrics.jsonl").exists(), "refused before the first step");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A validation file whose every example is cut to no target: an error at
/// load naming it (never a `val 0.0000` that reads as a perfect model).
#[test]
fn a_validation_set_without_targets_is_an_error_at_load() {
    let dir = tmp("val-no-targets");
    let tok = byte_chatml(&dir.join("tok"));
    let (train_p, val_p) = (dir.join("train.jsonl"), dir.join("val.jsonl"));
    std::fs::write(&train_p, (0..4).map(|i| chat(&format!("q{i}"), "a")).collect::<Vec<_>>().join("\n")).unwrap();
    std::fs::write(&val_p, [chat(LONG, "x"), chat(LONG, "y")].join("\n")).unwrap();
    let run = dir.join("run");
    let o = train_with(&run, &jsonl_sets(&tok, &train_p, &val_p, &["train.steps=4"]));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(val_p.to_str().unwrap()) && err.contains("no example is left"), "{err}");
    assert!(err.contains("raise data.seq_len"), "{err}");
    let zero_val = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default().contains("\"val_loss\":0.0");
    assert!(!zero_val, "a validation loss of 0 was recorded");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn prepare(args: &[&str]) -> Output {
    bin().arg("prepare").args(args).env("RAYON_NUM_THREADS", "2").output().expect("binary runs")
}

fn sources(out: &Path) -> Vec<String> {
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("meta.json")).unwrap()).unwrap();
    meta["sources"].as_array().unwrap().iter().map(|s| s["path"].as_str().unwrap().to_string()).collect()
}

/// `ln -s . sl/loop`: the link is not followed (every file is read once)
/// and is named on stderr; re-running prepare on a folder that holds an
/// earlier output reads the text, not the token files (also named).
#[test]
fn prepare_skips_folder_links_and_its_own_outputs() {
    let dir = tmp("prepare-links");
    let input = dir.join("in");
    std::fs::create_dir_all(input.join("sl")).unwrap();
    let text = "Call me Ishmael. Some years ago, never mind how long precisely.\n".repeat(50);
    std::fs::write(input.join("a.txt"), &text).unwrap();
    std::fs::write(input.join("sl/b.txt"), &text).unwrap();
    std::os::unix::fs::symlink(".", input.join("sl/loop")).unwrap();
    let first = input.join("tok");
    let o = prepare(&[input.to_str().unwrap(), "--out", first.to_str().unwrap()]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let names = sources(&first);
    assert_eq!(names.len(), 2, "each file once: {names:?}");
    assert!(err.contains(&format!("skipped {}: a link to a folder", input.join("sl/loop").display())), "{err}");

    // in/ now holds tok/{train.bin, val.bin, meta.json}: a second run reads the same two texts.
    let second = dir.join("again");
    let o = prepare(&[input.to_str().unwrap(), "--out", second.to_str().unwrap()]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(sources(&second), names, "{err}");
    assert_eq!(std::fs::read(second.join("train.bin")).unwrap(), std::fs::read(first.join("train.bin")).unwrap());
    let skipped = format!("skipped {}: an output of macrobatch prepare", first.join("train.bin").display());
    assert!(err.contains(&skipped), "{err}");
    // Token ids without their meta.json are binary: refused, named.
    let copied = dir.join("copied");
    std::fs::create_dir_all(&copied).unwrap();
    std::fs::copy(first.join("train.bin"), copied.join("train.bin")).unwrap();
    let o = prepare(&[copied.to_str().unwrap(), "--out", dir.join("third").to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("holds a NUL byte at offset 1: it is binary"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--val-fraction 0` writes no val.bin (and says so); a share that leaves
/// train.bin empty is refused and writes nothing.
#[test]
fn prepare_val_fraction_zero_and_one_without_train() {
    let dir = tmp("prepare-fraction");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("t.txt");
    std::fs::write(&text, "a few words of text\n".repeat(20)).unwrap();
    let out = dir.join("out");
    let o = prepare(&[text.to_str().unwrap(), "--out", out.to_str().unwrap(), "--val-fraction", "0"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("no val.bin") && !out.join("val.bin").exists(), "{err}");
    assert_eq!(std::fs::metadata(out.join("train.bin")).unwrap().len(), 2 * 400);
    let out = dir.join("out2");
    let o = prepare(&[text.to_str().unwrap(), "--out", out.to_str().unwrap(), "--val-fraction", "0.9999999"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("leaving train.bin empty"), "{err}");
    assert!(
        !out.join("train.bin").exists() && !out.join("train.bin.partial").exists() && !out.join("val.bin").exists()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Truncating the token file under a running training: an error naming the
/// file (exit 2), not a bus error (signal 7, the shell's 135).
#[test]
fn a_token_file_truncated_during_training_is_an_error_naming_it() {
    let dir = tmp("truncated");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corpus.u16");
    let text = &std::fs::read(CORPUS).unwrap()[..400_000];
    std::fs::write(&path, text.iter().flat_map(|&b| (b as u16).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let run = dir.join("run");
    let mut c = bin();
    c.arg("train").arg("--out").arg(&run);
    let p = format!("data.path={}", path.display());
    let sets =
        ["data.format=u16", p.as_str(), "train.steps=100000", "train.log_every=1", "batch.global=8", "batch.micro=4"];
    with_sets(&mut c, &[SMALL, &sets].concat());
    let mut child = c.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    let metrics_lines = || std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |s| s.lines().count());
    while metrics_lines() < 2 {
        assert!(started.elapsed() < Duration::from_secs(120), "training did not start");
        assert!(child.try_wait().unwrap().is_none(), "training ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(1000).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("training went on after its token file was truncated");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "exit {:?} (a signal if None): {err}", o.status);
    assert!(err.contains(&format!("token file {} shrank", path.display())), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Input mistakes caught before the first step, each naming the file and
/// the fix: JSON Lines given as u16 tokens, data.val_path = data.path, a
/// JSON error said once, a non-UTF-8 JSON Lines line named.
#[test]
fn data_input_mistakes_are_named_before_training() {
    let dir = tmp("data-mistakes");
    let tok = byte_chatml(&dir.join("tok"));
    let train_p = dir.join("train.jsonl");
    std::fs::write(&train_p, (0..40).map(|i| chat(&format!("q{i}"), "a reply")).collect::<Vec<_>>().join("\n"))
        .unwrap();
    let as_u16 = vec![format!("data.path={}", train_p.display()), "data.format=u16".to_string()];
    let same_val = jsonl_sets(&tok, &train_p, &train_p, &[]);
    let bad_json = dir.join("bad.jsonl");
    std::fs::write(&bad_json, format!("{}\n{{\"text\": oops}}\n", chat("q", "a"))).unwrap();
    let latin1 = dir.join("latin1.jsonl");
    std::fs::write(&latin1, [chat("q", "a").as_bytes(), b"\n{\"text\": \"caf\xe9\"}\n"].concat()).unwrap();
    let cases: Vec<(Vec<String>, Vec<String>)> = vec![
        (as_u16, vec![format!("{} looks like text", train_p.display()), "macrobatch prepare".into()]),
        (same_val, vec!["is the training file data.path".into(), "give a held-out file".into()]),
        (
            jsonl_sets(&tok, &bad_json, &train_p, &[]),
            vec![format!("{}:2: not valid JSON: expected value at line 1 column 10", bad_json.display())],
        ),
        (
            jsonl_sets(&tok, &latin1, &train_p, &[]),
            vec![format!("{}:2: not UTF-8 (invalid byte at column 14)", latin1.display())],
        ),
    ];
    for (sets, needles) in cases {
        let o = train_with(&dir.join("run"), &sets);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{sets:?}: {err}");
        for n in needles {
            assert!(err.contains(&n) && !err.contains("panicked"), "{sets:?}: expected `{n}` in {err}");
        }
        assert!(err.matches("expected value").count() <= 1, "said twice: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `data.path` = a folder of text (docs/data.md, and as `eval` reads one)
/// trains with the byte tokenizer too: its files in path order, as one
/// stream — the run of the folder is the run of its files joined.
#[test]
fn a_text_folder_trains_as_its_files_joined() {
    let dir = tmp("text-folder");
    let text = std::fs::read_to_string(CORPUS).unwrap();
    let cut = |s: &str, n: usize| s.char_indices().nth(n).map_or(s.len(), |(i, _)| i);
    let (a, rest) = text.split_at(cut(&text, 30_000));
    let b = &rest[..cut(rest, 30_000)];
    std::fs::create_dir_all(dir.join("corpus/part")).unwrap();
    std::fs::write(dir.join("corpus/a.txt"), a).unwrap();
    std::fs::write(dir.join("corpus/part/b.txt"), b).unwrap();
    std::fs::write(dir.join("joined.txt"), format!("{a}{b}")).unwrap();
    let run = |tag: &str, path: &Path| {
        let key = format!("data.path={:?}", path.display().to_string());
        train_ok(&dir.join(tag), &tiny(&["train.steps=2", "train.eval_every=1", &key]));
        (losses(&dir.join(tag)), val_losses(&dir.join(tag)))
    };
    let folder = run("out-folder", &dir.join("corpus"));
    assert_eq!(folder, run("out-joined", &dir.join("joined.txt")));
    std::fs::remove_dir_all(&dir).unwrap();
}
