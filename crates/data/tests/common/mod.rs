//! Helpers shared by the token-file tests.
#![allow(dead_code)]

use data::TokenDataset;
use std::path::PathBuf;

/// A fresh folder for one test.
pub fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("macrobatch-data-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The inputs and targets of samples `idx`, appended in order.
pub fn samples(ds: &TokenDataset, idx: &[usize]) -> (Vec<u32>, Vec<i32>) {
    let (mut i, mut t) = (Vec::new(), Vec::new());
    for &s in idx {
        ds.push_sample(s, &mut i, &mut t).unwrap();
    }
    (i, t)
}
