//! `generate` with its key/value cache prints what `--no-kv-cache` prints:
//! greedy and sampled, across the context limit (where the window slides
//! and each token recomputes it), and in a chat with SmolLM2.

mod common;

use common::*;
use std::path::Path;

/// `generate DIR ARGS` (with `--no-kv-cache` when `cached` is false): its stdout and stderr.
fn generate(dir: &Path, args: &[&str], cached: bool) -> (String, String) {
    let mut c = bin();
    c.arg("generate").arg(dir).args(args);
    if !cached {
        c.arg("--no-kv-cache");
    }
    let o = c.output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    (String::from_utf8_lossy(&o.stdout).into_owned(), stderr(&o))
}

#[test]
fn cached_generation_prints_the_uncached_text_across_the_context() {
    let out = tmp("gen-cache");
    train_ok(&out, &tiny(&["train.steps=4"]));
    // A 31-byte prompt and 40 new bytes cross the context of 32.
    let prompt = ["--prompt", "Call me Ishmael. Some years ago", "--max-new-tokens", "40"];
    for sampling in [&["--temperature", "0"][..], &["--temperature", "0.8", "--seed", "7"]] {
        let args = [&prompt[..], sampling].concat();
        let (with, note) = generate(&out, &args, true);
        let (without, quiet) = generate(&out, &args, false);
        assert_eq!(with, without, "{sampling:?}");
        assert!(with.len() > prompt[1].len() + 20, "{with}");
        assert!(note.contains("longer than the model's context of 32"), "{note}");
        assert!(!quiet.contains("note:"), "{quiet}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn cached_chat_answers_as_uncached_on_smollm2() {
    let Some(gguf) = gguf::testing::smollm2_or_skip("cached_chat_answers_as_uncached_on_smollm2") else { return };
    let args = ["--chat", "--prompt", "Who is Captain Ahab?", "--temperature", "0", "--max-new-tokens", "30"];
    let (with, _) = generate(&gguf, &args, true);
    let (without, _) = generate(&gguf, &args, false);
    assert_eq!(with, without);
    assert!(with.split_whitespace().count() >= 5, "{with}");
}
