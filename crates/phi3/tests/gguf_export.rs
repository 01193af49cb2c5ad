//! Phi-3 written as GGUF (llama.cpp's `phi3` architecture: q|k|v as one
//! `attn_qkv`, gate|up as one `ffn_up`, rows as Hugging Face has them, the
//! window as `phi3.attention.sliding_window`): transformers' GGUF loader
//! reads the file and computes our logits at every position.

use family::{Build, Registration};
use gguf::GgmlType;
use llama::Dialect;

/// Tolerance as `family::reference`'s: 1e-5 of the largest logit (both f32,
/// different summation orders; a wrong fused order — up before gate, v
/// before k — moves logits by ~1e-1).
#[test]
fn transformers_reads_the_fused_file_with_our_logits() {
    let dir = std::env::temp_dir().join(format!("macrobatch-phi3-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Phi-3's own vocabulary width: transformers' Phi3Config defaults
    // pad_token_id to 32000 when the file names none (a file without a
    // tokenizer names none), and refuses a smaller embedding.
    let cfg = llama::LlamaConfig { vocab_size: 32064, ..phi3::PHI3.preset("tiny").unwrap() };
    let json = phi3::PHI3.hf_json(&cfg);
    let f = phi3::FAMILY.for_hf_dir(&dir, &json).unwrap();
    let mut model = f.build(Build::default()).unwrap();
    let layout = model.layout().clone();
    let p = gguf::testing::uniform_params(layout.n_params(), 3);
    let m = f.gguf_export(&layout, &p).unwrap();
    // GGUF dimensions, fastest first: a row-major [rows, cols] is [cols, rows].
    let ne = |name: &str| m.tensors.iter().find(|t| t.name == name).map(|t| t.ne.clone());
    let (c, ff) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    assert_eq!(ne("blk.0.attn_qkv.weight"), Some(vec![c, (cfg.q_dim() + 2 * cfg.kv_dim()) as u64]));
    assert_eq!(ne("blk.1.ffn_up.weight"), Some(vec![c, 2 * ff]));
    assert_eq!(ne("blk.0.attn_q.weight"), None);
    assert_eq!(ne("blk.0.ffn_gate.weight"), None);
    let window = m.metadata.iter().find(|(k, _)| k == "phi3.attention.sliding_window");
    assert!(matches!(window, Some((_, gguf::Value::U32(32)))), "{window:?}");
    let path = dir.join("phi3.gguf");
    m.write(&path, GgmlType::from_id(GgmlType::F32).unwrap()).unwrap();
    // Shorter than the window: transformers' GGUF reader (5.25) maps no
    // window key for phi3, and llama.cpp reads it but attends to every key.
    let ids: Vec<u32> = vec![3, 17, 200, 5, 31999, 42, 7, 32063, 0, 128];
    assert!(ids.len() < 32);
    let Some(theirs) = gguf::testing::transformers_logits("phi3-gguf", &path, &ids).unwrap() else { return };
    let (worst, largest) = gguf::testing::logits_gap(&theirs, |t| model.next_token_logits(&p, &ids[..=t]).unwrap());
    println!("phi3 GGUF via transformers: max |Δlogit| = {worst:e}, largest |logit| = {largest}");
    assert!(worst <= 1e-5 * largest, "max |Δ| {worst} vs largest {largest}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The file reads back as Phi-3 (llama.cpp's `phi3`: `attn_qkv` and
/// `ffn_up` cut back into their parts), bit for bit.
#[test]
fn the_file_loads_back_as_phi3() {
    let json = phi3::PHI3.hf_json(&phi3::PHI3.preset("tiny").unwrap());
    let f = phi3::FAMILY.for_hf_dir(&std::env::temp_dir(), &json).unwrap();
    family::round_trip::assert_gguf_round_trip(&phi3::FAMILY, &*f, 9);
}
