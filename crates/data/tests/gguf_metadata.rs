//! Tokenizers written as GGUF `tokenizer.*` metadata: SmolLM2's read from
//! its GGUF gives back the source's keys exactly, so does the
//! `tokenizer.json` save_pretrained writes for it, and a file written with
//! that metadata tokenizes as the source; GPT-2's and the byte tokenizer
//! read back with the same ids.

use data::{ByteTokenizer, Tokenizer};
use gguf::testing::smollm2_or_skip;
use gguf::{GgufFile, Value};
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("macrobatch-data-gguf-meta-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// A GGUF file holding `metadata` (and no tensors).
fn write(name: &str, metadata: &[(String, Value)]) -> PathBuf {
    let path = tmp(name);
    let meta: Vec<(&str, Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    gguf::writer::write(&path, 3, &meta, &[]).unwrap();
    path
}

fn get<'a>(m: &'a [(String, Value)], key: &str) -> Option<&'a Value> {
    m.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// Multilingual text with digits, whitespace runs and the chat template's
/// special tokens.
const TEXT: &str =
    "<|im_start|>user\nHello, wörld! 12345 ½ — ἀρχή 日本語 🙂\n\n  3.14<|im_end|>\n<|im_start|>assistant\n";

/// `t` and `u` give the same ids for TEXT and a chat, and decode them alike.
fn same_tokenization(t: &Tokenizer, u: &Tokenizer) {
    let ids = t.encode(TEXT).unwrap();
    assert_eq!(u.encode(TEXT).unwrap(), ids);
    assert_eq!(u.decode(&ids).unwrap(), t.decode(&ids).unwrap());
    assert_eq!(
        (u.bos_id(), u.eos_id(), u.pad_id(), u.vocab_size()),
        (t.bos_id(), t.eos_id(), t.pad_id(), t.vocab_size())
    );
}

const KEYS: [&str; 12] = [
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
];

#[test]
fn smollm2_metadata_equals_the_source_file() {
    let Some(path) = smollm2_or_skip("smollm2_metadata_equals_the_source_file") else { return };
    let source = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&path).unwrap();
    let ours = tok.gguf_metadata().unwrap();
    // (a) every tokenizer key of the source, with its type, and no other.
    for key in KEYS {
        assert_eq!(get(&ours, key), source.get(key), "{key}");
    }
    let theirs: Vec<&str> =
        source.metadata().iter().map(|(k, _)| k.as_str()).filter(|k| k.starts_with("tokenizer.")).collect();
    assert_eq!(ours.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), theirs, "same keys in the same order");

    // (b) the tokenizer.json save_pretrained writes gives the same metadata.
    let dir = tmp("smollm2-hf");
    std::fs::create_dir_all(&dir).unwrap();
    assert!(tok.save_pretrained(&dir).unwrap());
    let from_json = Tokenizer::from_tokenizer_json(&dir.join("tokenizer.json")).unwrap();
    assert_eq!(from_json.gguf_metadata().unwrap(), ours);

    // (c) a file written with it tokenizes as the source.
    let back = Tokenizer::from_gguf(&write("smollm2-tok.gguf", &ours)).unwrap();
    same_tokenization(&tok, &back);
    let ids = back.encode(TEXT).unwrap();
    assert!(ids.contains(&1) && ids.contains(&2), "the special tokens are matched whole: {ids:?}");
}

#[test]
fn gpt2_metadata_reads_back_with_the_same_ids() {
    let tok = Tokenizer::gpt2().unwrap();
    let m = tok.gguf_metadata().unwrap();
    assert_eq!(get(&m, "tokenizer.ggml.pre"), Some(&Value::String("gpt-2".into())));
    assert_eq!(get(&m, "tokenizer.ggml.eos_token_id"), Some(&Value::U32(50256)));
    let types = get(&m, "tokenizer.ggml.token_type").and_then(Value::as_array).unwrap();
    assert_eq!(types.len(), 50257);
    assert_eq!(types[50256], Value::I32(3), "<|endoftext|> is a control token");
    assert!(types[..50256].iter().all(|t| *t == Value::I32(1)));
    assert_eq!(get(&m, "tokenizer.ggml.merges").and_then(Value::as_array).map(<[Value]>::len), Some(50000));
    let back = Tokenizer::from_gguf(&write("gpt2-tok.gguf", &m)).unwrap();
    same_tokenization(&tok, &back);
    assert_eq!(back.gguf_metadata().unwrap(), m);
}

/// The byte tokenizer as a 256-token byte-level vocabulary without merges:
/// read back as BPE, every byte of any text is its own value as id.
#[test]
fn byte_metadata_reads_back_as_bytes() {
    let tok = Tokenizer::Byte(ByteTokenizer);
    let m = tok.gguf_metadata().unwrap();
    let back = Tokenizer::from_gguf(&write("byte-tok.gguf", &m)).unwrap();
    assert_eq!(back.vocab_size(), 256);
    let text = format!("{TEXT}\u{0}\t\r\u{7f} end");
    let ids = back.encode(&text).unwrap();
    assert_eq!(ids, tok.encode(&text).unwrap());
    assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
    assert_eq!(back.decode(&ids).unwrap(), text);

    // For a model of 260 ids: four unused ids after the bytes, which change
    // nothing of the tokenization.
    let m = tok.gguf_metadata_padded(260).unwrap();
    let tokens = get(&m, "tokenizer.ggml.tokens").and_then(Value::as_array).unwrap();
    let types = get(&m, "tokenizer.ggml.token_type").and_then(Value::as_array).unwrap();
    assert_eq!((tokens.len(), &tokens[259], &types[259]), (260, &Value::String("[PAD259]".into()), &Value::I32(5)));
    let padded = Tokenizer::from_gguf(&write("byte-260.gguf", &m)).unwrap();
    assert_eq!((padded.vocab_size(), padded.encode(&text).unwrap()), (260, ids));
    let e = tok.gguf_metadata_padded(255).unwrap_err().to_string();
    assert!(e.contains("256 ids") && e.contains("255"), "{e}");
}

#[test]
fn unknown_pre_tokenizers_are_named() {
    // A tokenizer.json whose pre-tokenizer splits on whitespace only.
    let dir = tmp("whitespace");
    std::fs::create_dir_all(&dir).unwrap();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
    });
    let path: &Path = &dir.join("tokenizer.json");
    std::fs::write(path, json.to_string()).unwrap();
    let t = Tokenizer::from_tokenizer_json(path).unwrap();
    let e = t.gguf_metadata().unwrap_err().to_string();
    assert!(e.contains("pre-tokenizer") && e.contains("Whitespace") && e.contains("tokenizer.ggml.pre"), "{e}");
}
