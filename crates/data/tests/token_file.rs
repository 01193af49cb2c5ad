//! Token files read a sample at a time: a 64 MB file opens without being
//! read (the resident set grows by the samples read, not by the file), its
//! samples are the same windows an in-memory dataset of the same tokens
//! gives (token_file_errors.rs: files that change or hold the wrong data).

mod common;

use common::{samples, tmp};
use data::{load_splits, DataFormat, TokenDataset, TokenDtype};

/// Resident set of this process (VmRSS), bytes.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn a_64_mb_token_file_is_opened_not_read() {
    let dir = tmp("big");
    let path = dir.join("train.bin");
    // Sparse: 32 M u16 tokens of id 0, no disk blocks.
    std::fs::File::create(&path).unwrap().set_len(64 << 20).unwrap();
    let before = rss();
    let (train, val) = load_splits(&path, None, DataFormat::U16, 0.01, 128, 256).unwrap();
    assert_eq!(train.n_tokens() + val.n_tokens(), 32 << 20);
    assert_eq!(val.n_tokens(), ((32u64 << 20) as f64 * 0.01).round() as usize);
    let n = train.n_samples();
    let idx: Vec<usize> = (0..256).map(|i| i * 997 % n).collect();
    let (inputs, targets) = samples(&train, &idx);
    assert_eq!((inputs.len(), targets.len()), (256 * 128, 256 * 128));
    let grown = rss().saturating_sub(before);
    // Opening probes the first 1 M tokens for the vocabulary, 64 K at a time;
    // 256 samples read 129 tokens each. Reading the file would be 64 MB.
    assert!(grown < 12 << 20, "resident set grew by {} MB for a 64 MB file", grown >> 20);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn file_samples_equal_in_memory_samples_in_both_widths() {
    let dir = tmp("same");
    let tokens: Vec<u32> = (0..5000u32).map(|i| (i * 7919) % 300).collect();
    for dtype in [TokenDtype::U16, TokenDtype::U32] {
        let (path, vpath) = (dir.join(format!("t-{}.bin", dtype.name())), dir.join(format!("v-{}.bin", dtype.name())));
        let mut bytes = Vec::new();
        dtype.encode(&tokens, &mut bytes).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        std::fs::write(&vpath, &bytes[..bytes.len() / 10]).unwrap();
        let format = if dtype == TokenDtype::U16 { DataFormat::U16 } else { DataFormat::U32 };
        let (train, val) = load_splits(&path, None, format, 0.1, 16, 300).unwrap();
        let n_val = 500;
        let mem_train = TokenDataset::new("train", tokens[..5000 - n_val].to_vec(), 16).unwrap();
        let mem_val = TokenDataset::new("validation", tokens[5000 - n_val..].to_vec(), 16).unwrap();
        assert_eq!((train.n_samples(), val.n_samples()), (mem_train.n_samples(), mem_val.n_samples()));
        let all: Vec<usize> = (0..train.n_samples()).rev().collect();
        assert_eq!(samples(&train, &all), samples(&mem_train, &all));
        let all_val: Vec<usize> = (0..val.n_samples()).collect();
        assert_eq!(samples(&val, &all_val), samples(&mem_val, &all_val));
        // A separate validation file: the whole train file trains.
        let (train, val) = load_splits(&path, Some(&vpath), format, 0.1, 16, 300).unwrap();
        assert_eq!((train.n_tokens(), val.n_tokens()), (5000, 500));
        // A vocabulary the first tokens do not fit is an error at once, naming the file.
        let e = load_splits(&path, None, format, 0.1, 16, 256).unwrap_err().to_string();
        assert!(e.contains("outside the model's vocabulary of 256") && e.contains(path.to_str().unwrap()), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
