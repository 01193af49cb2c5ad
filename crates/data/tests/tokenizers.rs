//! Our BPE tokenizers against transformers (fixtures/make_tokenizer_reference.py,
//! whose docstring has the command): SmolLM2 from its GGUF (skipped with a
//! message when the file is absent, failed under `MACROBATCH_REQUIRE_GGUF=1`)
//! and GPT-2 from the bundled files (always runs).

use data::{BpeTokenizer, Message, Role, Tokenizer};
use gguf::testing::smollm2_or_skip;
use gguf::writer::{self};
use gguf::{Value, ValueType};
use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

fn reference() -> Json {
    serde_json::from_str(include_str!("fixtures/tokenizer_reference.json")).expect("the committed reference parses")
}

fn ids(v: &Json) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("macrobatch-data-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Multilingual, whitespace-, digit-, contraction- and emoji-heavy text, and
/// special-token strings: every id equal, and decoding gives the text back.
#[test]
fn smollm2_ids_equal_transformers() {
    let Some(path) = smollm2_or_skip("smollm2_ids_equal_transformers") else { return };
    let tok = Tokenizer::from_gguf(&path).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!((tok.bos_id(), tok.eos_id(), tok.pad_id()), (Some(1), Some(2), Some(2)));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_id("Ġthe"), Some(260));
    let reference = reference();
    for case in reference["smollm2"]["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode(text).unwrap();
        assert_eq!(got, ids(&case["ids"]), "{text:?}");
        assert_eq!(tok.decode(&got).unwrap(), text, "round trip");
    }
}

/// Whitespace before a numeral (a run of two or more whitespace characters,
/// or a space before a non-ASCII numeral): we follow SmolLM2's own
/// tokenizer.json (digits split off first, as llama.cpp's `smollm` does),
/// which transformers' GGUF loader does not; both id lists are pinned.
#[test]
fn smollm2_whitespace_before_numeral_follows_the_models_tokenizer() {
    let Some(path) = smollm2_or_skip("smollm2_whitespace_before_numeral_follows_the_models_tokenizer") else {
        return;
    };
    let tok = Tokenizer::from_gguf(&path).unwrap();
    for case in reference()["smollm2_whitespace_before_numeral"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode(text).unwrap();
        assert_eq!(got, ids(&case["digits_then_byte_level_ids"]), "{text:?}");
        assert_ne!(got, ids(&case["transformers_gguf_ids"]), "{text:?}");
        assert_eq!(tok.decode(&got).unwrap(), text);
    }
}

/// The whole bundled corpus (1.2 MB of English with some Greek, Hebrew and
/// numerals) through our tokenizer (Rust `tokenizers`, fancy-regex) equals
/// Python `tokenizers` (onig) with SmolLM2's pre-tokenizer, id for id
/// (SHA-256 of the ids). transformers' GGUF loader differs in 7 spans, all
/// whitespace before a numeral.
#[test]
fn smollm2_whole_corpus_equals_python_tokenizers() {
    let Some(path) = smollm2_or_skip("smollm2_whole_corpus_equals_python_tokenizers") else { return };
    let tok = Tokenizer::from_gguf(&path).unwrap();
    let corpus = moby_dick();
    assert_ids_digest(&tok.encode(&corpus).unwrap(), &reference()["smollm2_moby_dick"]);
}

fn moby_dick() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/moby-dick.txt")).unwrap()
}

/// `ids` has the count and SHA-256 (of the little-endian u32s) in `want`.
fn assert_ids_digest(ids: &[u32], want: &Json) {
    assert_eq!(ids.len() as u64, want["n_ids"].as_u64().unwrap());
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    let digest: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(digest, want["ids_sha256"].as_str().unwrap());
}

/// GPT-2 over the whole bundled corpus equals GPT2TokenizerFast, id for id.
#[test]
fn gpt2_whole_corpus_equals_transformers() {
    let tok = Tokenizer::gpt2().unwrap();
    assert_ids_digest(&tok.encode(&moby_dick()).unwrap(), &reference()["gpt2_moby_dick"]);
}

/// The template text from the GGUF is SmolLM2's ChatML, and minijinja renders
/// it to the same string as transformers' apply_chat_template; the ids of
/// that string are the same too.
#[test]
fn smollm2_chat_template_equals_apply_chat_template() {
    let Some(path) = smollm2_or_skip("smollm2_chat_template_equals_apply_chat_template") else { return };
    let tok = Tokenizer::from_gguf(&path).unwrap();
    let reference = reference();
    let template = tok.chat_template().expect("SmolLM2 has a chat template");
    assert_eq!(template.source(), reference["smollm2"]["chat_template"].as_str().unwrap());
    for chat in reference["smollm2"]["chats"].as_array().unwrap() {
        let messages: Vec<Message> = chat["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(Role::parse(m["role"].as_str().unwrap()).unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let text = template.render(&messages, chat["add_generation_prompt"].as_bool().unwrap()).unwrap();
        assert_eq!(text, chat["text"].as_str().unwrap());
        assert_eq!(tok.encode(&text).unwrap(), ids(&chat["ids"]));
    }
}

/// GPT-2 (vocabulary 50257) from the bundled files equals GPT2TokenizerFast
/// built from the same files: Unicode, numbers, whitespace runs,
/// contractions, `<|endoftext|>`.
#[test]
fn gpt2_ids_equal_gpt2_tokenizer_fast() {
    let tok = Tokenizer::gpt2().unwrap();
    assert_eq!(tok.vocab_size(), 50257);
    assert_eq!((tok.bos_id(), tok.eos_id(), tok.pad_id()), (Some(50256), Some(50256), None));
    for case in reference()["gpt2"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode(text).unwrap();
        assert_eq!(got, ids(&case["ids"]), "{text:?}");
        assert_eq!(tok.decode(&got).unwrap(), text);
    }
}

/// `tokenizer.json` + `tokenizer_config.json`: what we save, we load back to
/// the same ids and special tokens.
#[test]
fn tokenizer_json_round_trip() {
    let gpt2 = BpeTokenizer::gpt2().unwrap();
    let dir = tmp_dir("tokenizer-json");
    gpt2.save_tokenizer_json(&dir.join("tokenizer.json")).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}, "chat_template": "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"}"#,
    )
    .unwrap();
    let back = Tokenizer::from_tokenizer_json(&dir.join("tokenizer.json")).unwrap();
    assert_eq!((back.bos_id(), back.eos_id(), back.pad_id()), (Some(50256), Some(50256), None));
    for case in reference()["gpt2"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(back.encode(text).unwrap(), gpt2.encode(text).unwrap());
    }
    let chat = back.chat_template().unwrap().render(&[Message::new(Role::User, "hi")], false).unwrap();
    assert_eq!(chat, "hi<|endoftext|>");
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "<nope>"}"#).unwrap();
    let e = Tokenizer::from_tokenizer_json(&dir.join("tokenizer.json")).unwrap_err().to_string();
    assert!(e.contains("<nope>"), "{e}");
    let e = Tokenizer::from_tokenizer_json(&dir.join("missing.json")).unwrap_err().to_string();
    assert!(e.contains("missing.json"), "{e}");
}

/// A GGUF with a byte-level vocabulary of 256 byte tokens, two control tokens
/// and one merge, written by `gguf::writer`: `from_gguf` reads it; unknown
/// tokenizer kinds and pre-tokenizers are named errors.
#[test]
fn synthetic_gguf_tokenizer_and_its_errors() {
    let mut tokens: Vec<Value> = data::bpe::byte_to_char().iter().map(|c| Value::String(c.to_string())).collect();
    tokens.push(Value::String("<|im_start|>".into()));
    tokens.push(Value::String("<|im_end|>".into()));
    tokens.push(Value::String("Ġt".into()));
    let n = tokens.len();
    let mut types = vec![Value::I32(1); n];
    types[256] = Value::I32(3);
    types[257] = Value::I32(3);
    let meta = |model: &str, pre: Option<&str>| {
        let mut m = vec![
            ("general.architecture", Value::String("llama".into())),
            ("tokenizer.ggml.model", Value::String(model.into())),
            ("tokenizer.ggml.tokens", Value::Array(ValueType::String, tokens.clone())),
            ("tokenizer.ggml.token_type", Value::Array(ValueType::I32, types.clone())),
            ("tokenizer.ggml.merges", Value::Array(ValueType::String, vec![Value::String("Ġ t".into())])),
            ("tokenizer.ggml.eos_token_id", Value::U32(257)),
            (
                "tokenizer.chat_template",
                Value::String("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}".into()),
            ),
        ];
        if let Some(p) = pre {
            m.push(("tokenizer.ggml.pre", Value::String(p.into())));
        }
        m
    };
    let dir = tmp_dir("synthetic-gguf");
    let write = |name: &str, model: &str, pre: Option<&str>| {
        let p = dir.join(name);
        writer::write(&p, 3, &meta(model, pre), &[]).unwrap();
        p
    };
    let tok = Tokenizer::from_gguf(&write("ok.gguf", "gpt2", Some("gpt2"))).unwrap();
    assert_eq!(tok.vocab_size(), n);
    assert_eq!(tok.eos_id(), Some(257));
    // "a t<|im_end|>": a, then "Ġt" merged, then the control token whole
    assert_eq!(tok.encode("a t<|im_end|>").unwrap(), vec![b'a' as u32, 258, 257]);
    let e = Tokenizer::from_gguf(&write("pre.gguf", "gpt2", Some("qwen2"))).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.pre = qwen2") && e.contains("smollm"), "{e}");
    let e = Tokenizer::from_gguf(&write("nopre.gguf", "gpt2", None)).unwrap_err().to_string();
    assert!(e.contains("no tokenizer.ggml.pre"), "{e}");
    let e = Tokenizer::from_gguf(&write("spm.gguf", "llama", Some("default"))).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.model = llama"), "{e}");
}

/// Fine-tuning data through SmolLM2's tokenizer and template: the rows are
/// exactly apply_chat_template's ids, and the targets that count decode to
/// each assistant reply followed by `<|im_end|>`, nothing else.
#[test]
fn smollm2_sft_trains_only_the_assistant_replies() {
    let Some(path) = smollm2_or_skip("smollm2_sft_trains_only_the_assistant_replies") else { return };
    let tok = Tokenizer::from_gguf(&path).unwrap();
    let reference = reference();
    let chats = reference["smollm2"]["chats"].as_array().unwrap();
    let trained: Vec<&Json> = chats.iter().filter(|c| !c["add_generation_prompt"].as_bool().unwrap()).collect();
    let jsonl: String =
        trained.iter().map(|c| format!("{}\n", serde_json::json!({ "messages": c["messages"] }))).collect();
    let ds =
        data::SftDataset::from_jsonl(std::path::Path::new("chat.jsonl"), &jsonl, &tok, &Default::default()).unwrap();
    for (idx, chat) in trained.iter().enumerate() {
        let batch = ds.micro_batch(&[idx]);
        let want_ids = ids(&chat["ids"]);
        assert_eq!(batch.inputs, want_ids[..want_ids.len() - 1]);
        // consecutive runs of counted targets, decoded
        let mut runs: Vec<Vec<u32>> = Vec::new();
        let mut in_run = false;
        for &t in &batch.targets {
            match (t >= 0, in_run) {
                (true, false) => runs.push(vec![t as u32]),
                (true, true) => runs.last_mut().unwrap().push(t as u32),
                _ => {}
            }
            in_run = t >= 0;
        }
        let got: Vec<String> = runs.iter().map(|r| tok.decode(r).unwrap()).collect();
        let want: Vec<String> = chat["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "assistant")
            .map(|m| format!("{}<|im_end|>", m["content"].as_str().unwrap()))
            .collect();
        assert_eq!(got, want);
    }
}

/// `encode_prefix` gives the whole text's first n ids while tokenizing a
/// prefix: GPT-2 (and SmolLM2 where its file is present) over Moby-Dick,
/// as one long line, with every kind of cut place (mid-paragraph, runs of
/// blank lines, punctuation), for n from 1 to past the text's end.
#[test]
fn encode_prefix_is_the_whole_texts_first_ids() {
    let text = moby_dick();
    let mut toks = vec![("gpt2", Tokenizer::gpt2().unwrap())];
    if let Some(path) = smollm2_or_skip("encode_prefix_is_the_whole_texts_first_ids") {
        toks.push(("smollm2", Tokenizer::from_gguf(&path).unwrap()));
    }
    // The same text with newlines as spaces: one long JSONL-like line.
    let one_line = text.replace('\n', " ");
    for (name, tok) in &toks {
        for t in [&text[..200_000], &one_line[..200_000], "no-space-at-all-".repeat(2000).as_str(), "short text"] {
            let whole = tok.encode(t).unwrap();
            for n in [1, 2, 63, 64, 65, 255, 1000, 4097, whole.len() - 1, whole.len(), whole.len() + 5] {
                let got = tok.encode_prefix(t, n).unwrap();
                assert_eq!(got[..], whole[..n.min(whole.len())], "{name}: n = {n}, text of {} bytes", t.len());
            }
        }
    }
}
