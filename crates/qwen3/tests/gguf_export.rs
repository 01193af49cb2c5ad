//! Qwen3 written as GGUF (llama.cpp's `qwen3` architecture: Llama's names,
//! the per-head norms as `attn_q_norm` / `attn_k_norm`, the head width as
//! `attention.key_length`, Q and K rows as Hugging Face has them):
//! transformers' GGUF loader reads the file and computes our logits at
//! every position, tied and untied.

use family::{Build, Registration};
use gguf::GgmlType;
use llama::Dialect;

/// Tolerance as `family::reference`'s: 1e-5 of the largest logit (both f32,
/// different summation orders; a wrong permutation, gain or name moves
/// logits by ~1e-1).
#[test]
fn transformers_reads_the_file_with_our_logits() {
    let dir = std::env::temp_dir().join(format!("macrobatch-qwen3-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for tied in [true, false] {
        let mut json = qwen3::QWEN3.hf_json(&qwen3::QWEN3.preset("tiny").unwrap());
        json["tie_word_embeddings"] = tied.into();
        // Heads of the released width: transformers' GGUF reader (5.25) maps
        // no head-width key for qwen3 and assumes Qwen3Config's 128, where
        // llama.cpp reads `qwen3.attention.key_length` (written, and checked below).
        json["head_dim"] = 128.into();
        let f = qwen3::FAMILY.for_hf_dir(&dir, &json).unwrap();
        let mut model = f.build(Build::default()).unwrap();
        let layout = model.layout().clone();
        let p = gguf::testing::uniform_params(layout.n_params(), 1 + tied as u64);
        let m = f.gguf_export(&layout, &p).unwrap();
        assert!(m.tensors.iter().any(|t| t.name == "blk.0.attn_k_norm.weight"));
        let key_length = m.metadata.iter().find(|(k, _)| k == "qwen3.attention.key_length");
        assert!(matches!(key_length, Some((_, gguf::Value::U32(128)))), "{key_length:?}");
        assert_eq!(m.tensors.iter().any(|t| t.name == "output.weight"), !tied);
        let path = dir.join(format!("qwen3-{tied}.gguf"));
        m.write(&path, GgmlType::from_id(GgmlType::F32).unwrap()).unwrap();
        let ids: Vec<u32> = vec![3, 17, 200, 5, 99, 42, 7, 255, 0, 128];
        let Some(theirs) = gguf::testing::transformers_logits("qwen3-gguf", &path, &ids).unwrap() else { return };
        let (worst, largest) = gguf::testing::logits_gap(&theirs, |t| model.next_token_logits(&p, &ids[..=t]).unwrap());
        println!("qwen3 (tied = {tied}) GGUF via transformers: max |Δlogit| = {worst:e}, largest |logit| = {largest}");
        assert!(worst <= 1e-5 * largest, "tied = {tied}: max |Δ| {worst} vs largest {largest}");
    }
}

/// The file reads back as Qwen3 (llama.cpp's `qwen3`, with the per-head
/// q/k norms and heads wider than hidden / heads), bit for bit.
#[test]
fn the_file_loads_back_as_qwen3() {
    let json = qwen3::QWEN3.hf_json(&qwen3::QWEN3.preset("tiny").unwrap());
    let f = qwen3::FAMILY.for_hf_dir(&std::env::temp_dir(), &json).unwrap();
    family::round_trip::assert_gguf_round_trip(&qwen3::FAMILY, &*f, 7);
}
