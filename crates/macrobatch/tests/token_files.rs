//! Training from memory-mapped u16 / u32 token files: the same losses as the
//! text path on the same tokens, and clear errors.

mod common;

use common::*;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/moby-dick.txt");

fn u16_bytes(text: &[u8]) -> Vec<u8> {
    text.iter().flat_map(|&b| (b as u16).to_le_bytes()).collect()
}

/// The memory-mapped path feeds the model exactly what the in-memory text path does.
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
fn token_file_errors_name_the_problem() {
    let dir = tmp("token-errors");
    std::fs::create_dir_all(&dir).unwrap();
    let odd = dir.join("odd.bin");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    let odd_s = format!("data.path={}", odd.display());
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec![odd_s.as_str(), "data.format=u16"], "has 3 bytes, not a multiple of 2"),
        (vec![odd_s.as_str(), "data.format=u8"], "use text, u16 or u32"),
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
