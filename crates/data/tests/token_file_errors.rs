//! Token files that are not what they should be: truncated while open,
//! text given as token ids, a token outside the vocabulary past the startup
//! probe — each an error naming the file. (Apart from `token_file.rs`, whose
//! resident-set measurement these would disturb.)

mod common;

use common::{samples, tmp};
use data::{load_splits, DataFormat, TokenDtype};

/// A token file truncated while a dataset holds it open: the next sample
/// that reaches past the new end is an error naming the file (not a bus
/// error, as a memory map gives); samples still inside it read as before.
#[test]
fn a_token_file_truncated_while_open_is_an_error_naming_it() {
    let dir = tmp("shrunk");
    let path = dir.join("train.bin");
    let tokens: Vec<u32> = (0..4096u32).map(|i| i % 256).collect();
    let mut bytes = Vec::new();
    TokenDtype::U16.encode(&tokens, &mut bytes).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let (train, _) = load_splits(&path, None, DataFormat::U16, 0.1, 64, 256).unwrap();
    let before = samples(&train, &[0, 1]);
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(1000).unwrap();
    assert_eq!(samples(&train, &[0, 1]), before, "samples inside the shorter file are unchanged");
    let (mut i, mut t) = (Vec::new(), Vec::new());
    let e = train.push_sample(40, &mut i, &mut t).unwrap_err().to_string();
    assert!(e.contains(path.to_str().unwrap()) && e.contains("shrank"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Text or JSON given as u16 tokens without a prepare `meta.json` is refused
/// with the fix; the same bytes beside a `meta.json` are taken as tokens.
#[test]
fn text_given_as_token_ids_is_refused_without_meta() {
    let dir = tmp("text-as-tokens");
    let path = dir.join("train.jsonl");
    let line = "{\"text\": \"the quick brown fox jumps over the lazy dog\"}\n";
    std::fs::write(&path, line.repeat(40)).unwrap();
    let e = load_splits(&path, None, DataFormat::U16, 0.1, 16, 1 << 16).unwrap_err().to_string();
    assert!(
        e.contains("looks like text") && e.contains("macrobatch prepare") && e.contains(path.to_str().unwrap()),
        "{e}"
    );
    let bom = dir.join("bom.txt");
    std::fs::write(&bom, [&b"\xEF\xBB\xBF"[..], ("plain words ".repeat(30) + ".").as_bytes()].concat()).unwrap();
    let e = load_splits(&bom, None, DataFormat::U32, 0.1, 8, 1 << 30).unwrap_err().to_string();
    assert!(e.contains("looks like text"), "{e}");
    // Real byte-level token ids hold zero high bytes: not text.
    let ids = dir.join("ids.bin");
    let mut bytes = Vec::new();
    TokenDtype::U16.encode(&line.repeat(40).bytes().map(u32::from).collect::<Vec<_>>(), &mut bytes).unwrap();
    std::fs::write(&ids, bytes).unwrap();
    load_splits(&ids, None, DataFormat::U16, 0.1, 16, 256).unwrap();
    // A prepare meta.json beside the file vouches for it.
    let meta = r#"{"tokenizer": "x", "vocab_size": 65536, "dtype": "u16", "n_train_tokens": 1, "n_val_tokens": 0, "val_fraction": 0.0, "sources": []}"#;
    std::fs::write(dir.join("meta.json"), meta).unwrap();
    load_splits(&path, None, DataFormat::U16, 0.1, 16, 1 << 16).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A token outside the vocabulary past the startup probe is an error when
/// its sample is read, naming the file and the token's position in it.
#[test]
fn a_token_outside_the_vocabulary_is_named_with_its_position() {
    let dir = tmp("oov");
    let path = dir.join("train.bin");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(4 << 20).unwrap(); // 2 M u16 tokens of id 0
    let at = 1_500_000u64;
    std::os::unix::fs::FileExt::write_all_at(&f, &999u16.to_le_bytes(), 2 * at).unwrap();
    let (train, _) = load_splits(&path, None, DataFormat::U16, 0.01, 100, 256).unwrap();
    let (mut i, mut t) = (Vec::new(), Vec::new());
    train.push_sample(0, &mut i, &mut t).unwrap();
    let e = train.push_sample(at as usize / 100, &mut i, &mut t).unwrap_err().to_string();
    assert!(e.contains("token 999 at token position 1500000") && e.contains(path.to_str().unwrap()), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
