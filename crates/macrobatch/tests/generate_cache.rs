//! `generate` with its key/value cache prints what `--no-kv-cache` prints:
//! greedy and sampled, across the context limit (where the window slides
//! and each token recomputes it), and in a chat with SmolLM2 (whose Q4_1
//! blocks stay packed, as `--dequantize` answers).

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
    // The GGUF's Q4_1 projections stay in their blocks; held as f32
    // (--dequantize) the model answers the same, token for token.
    let (f32_weights, _) = generate(&gguf, &[&args[..], &["--dequantize"]].concat(), true);
    assert_eq!(with, f32_weights);
}

/// Plain generation stops before the model's end-of-sequence token, as
/// transformers' `generate` does: `generation_config.json`'s eos_token_id
/// (here a list, of which one id is a byte the model emits), else
/// `config.json`'s; `--ignore-eos` runs on to `--max-new-tokens`.
#[test]
fn plain_generation_stops_at_the_eos_token() {
    let out = tmp("gen-eos");
    train_ok(&out, &tiny(&["train.steps=4"]));
    let prompt = "Call me Ishmael.";
    let args = ["--prompt", prompt, "--max-new-tokens", "24", "--temperature", "0"];
    let (free, _) = generate(&out, &args, true);
    // The byte tokenizer has no EOS and the byte-level config.json none.
    let new = free.strip_prefix(prompt).unwrap().trim_end_matches('\n');
    // A byte the model emits first after its third: where an EOS must stop it.
    let (cut, eos) = new.char_indices().skip(3).find(|&(i, c)| c.is_ascii() && !new[..i].contains(c)).unwrap();
    let (eos, stop) = (eos as u32, &new[..cut]);
    let json = format!("{{\"eos_token_id\": [60000, {eos}]}}");
    std::fs::write(out.join("generation_config.json"), &json).unwrap();
    for cached in [true, false] {
        let (stopped, _) = generate(&out, &args, cached);
        assert_eq!(stopped, format!("{prompt}{stop}\n"), "eos {eos}, cached {cached}");
    }
    let (ignored, _) = generate(&out, &[&args[..], &["--ignore-eos"]].concat(), true);
    assert_eq!(ignored, free);
    // Without generation_config.json, config.json's id.
    std::fs::remove_file(out.join("generation_config.json")).unwrap();
    let path = out.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["eos_token_id"] = eos.into();
    std::fs::write(&path, config.to_string()).unwrap();
    assert_eq!(generate(&out, &args, true).0, format!("{prompt}{stop}\n"));
    std::fs::remove_dir_all(&out).unwrap();
}
