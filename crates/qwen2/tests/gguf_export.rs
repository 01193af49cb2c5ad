//! Qwen2 written as GGUF (llama.cpp's `qwen2` architecture: Llama's names,
//! q/k/v biases, Q and K rows as Hugging Face has them): transformers' GGUF
//! loader reads the file and computes our logits at every position, tied
//! and untied.

use family::{Build, Registration};
use gguf::GgmlType;
use llama::Dialect;

/// Tolerance as `family::reference`'s: 1e-5 of the largest logit (both f32,
/// different summation orders; a wrong permutation, bias or name moves
/// logits by ~1e-1).
#[test]
fn transformers_reads_the_file_with_our_logits() {
    let dir = std::env::temp_dir().join(format!("macrobatch-qwen2-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for tied in [true, false] {
        let mut json = qwen2::QWEN2.hf_json(&qwen2::QWEN2.preset("tiny").unwrap());
        json["tie_word_embeddings"] = tied.into();
        let f = qwen2::FAMILY.for_hf_dir(&dir, &json).unwrap();
        let mut model = f.build(Build::default()).unwrap();
        let layout = model.layout().clone();
        let p = gguf::testing::uniform_params(layout.n_params(), 1 + tied as u64);
        let m = f.gguf_export(&layout, &p).unwrap();
        assert!(m.tensors.iter().any(|t| t.name == "blk.0.attn_q.bias"));
        assert_eq!(m.tensors.iter().any(|t| t.name == "output.weight"), !tied);
        let path = dir.join(format!("qwen2-{tied}.gguf"));
        m.write(&path, GgmlType::from_id(GgmlType::F32).unwrap()).unwrap();
        let ids: Vec<u32> = vec![3, 17, 200, 5, 99, 42, 7, 255, 0, 128];
        let Some(theirs) = gguf::testing::transformers_logits("qwen2-gguf", &path, &ids).unwrap() else { return };
        let (worst, largest) = gguf::testing::logits_gap(&theirs, |t| model.next_token_logits(&p, &ids[..=t]).unwrap());
        println!("qwen2 (tied = {tied}) GGUF via transformers: max |Δlogit| = {worst:e}, largest |logit| = {largest}");
        assert!(worst <= 1e-5 * largest, "tied = {tied}: max |Δ| {worst} vs largest {largest}");
    }
}

/// The file reads back as Qwen2 (llama.cpp's `qwen2`, with the q/k/v
/// biases), shape and every parameter bit for bit, tied and untied.
#[test]
fn the_file_loads_back_as_qwen2() {
    for tied in [true, false] {
        let mut json = qwen2::QWEN2.hf_json(&qwen2::QWEN2.preset("tiny").unwrap());
        json["tie_word_embeddings"] = tied.into();
        let f = qwen2::FAMILY.for_hf_dir(&std::env::temp_dir(), &json).unwrap();
        family::round_trip::assert_gguf_round_trip(&qwen2::FAMILY, &*f, 5 + tied as u64);
    }
}
