//! Gemma 2 written as GGUF (llama.cpp's `gemma2` architecture: gains stored
//! as `1 + w`, the post norms as `post_attention_norm` / `post_ffw_norm`,
//! the MLP's pre norm as `ffn_norm`, the caps and the window as its keys,
//! Q and K rows as Hugging Face has them, the head tied): transformers'
//! GGUF loader reads the file and computes our logits at every position;
//! what llama.cpp would compute otherwise is refused with the reason.

use family::{Build, Registration};
use gguf::GgmlType;
use llama::Dialect;

/// Tolerance as `family::reference`'s: 1e-5 of the largest logit (both f32,
/// different summation orders; a gain without its 1, a swapped norm or a
/// wrong name moves logits by ~1e-1).
#[test]
fn transformers_reads_the_file_with_our_logits() {
    let dir = std::env::temp_dir().join(format!("macrobatch-gemma2-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut json = gemma2::GEMMA2.hf_json(&gemma2::GEMMA2.preset("tiny").unwrap());
    // transformers' GGUF reader (5.25) maps no key for the score scale or
    // the caps and takes Gemma2Config's defaults (256; 50 and 30, which the
    // preset has); llama.cpp scales by 1/√head_dim. Heads of 256 agree with both.
    json["head_dim"] = 256.into();
    json["query_pre_attn_scalar"] = 256.into();
    json["sliding_window"] = 4.into();
    let f = gemma2::FAMILY.for_hf_dir(&dir, &json).unwrap();
    let mut model = f.build(Build::default()).unwrap();
    let layout = model.layout().clone();
    let p = gguf::testing::uniform_params(layout.n_params(), 3);
    let m = f.gguf_export(&layout, &p).unwrap();
    for name in ["blk.1.post_attention_norm.weight", "blk.1.ffn_norm.weight", "blk.1.post_ffw_norm.weight"] {
        assert!(m.tensors.iter().any(|t| t.name == name), "{name}");
    }
    assert!(!m.tensors.iter().any(|t| t.name == "output.weight"), "the head is tied");
    let key = |k: &str| m.metadata.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert!(matches!(key("gemma2.attn_logit_softcapping"), Some(gguf::Value::F32(50.0))));
    assert!(matches!(key("gemma2.attention.sliding_window"), Some(gguf::Value::U32(4))));
    let path = dir.join("gemma2.gguf");
    m.write(&path, GgmlType::from_id(GgmlType::F32).unwrap()).unwrap();
    let ids: Vec<u32> = vec![3, 17, 200, 5, 99, 42, 7, 255, 0, 128];
    let Some(theirs) = gguf::testing::transformers_logits("gemma2-gguf", &path, &ids).unwrap() else { return };
    let (worst, largest) = gguf::testing::logits_gap(&theirs, |t| model.next_token_logits(&p, &ids[..=t]).unwrap());
    println!("gemma2 GGUF via transformers: max |Δlogit| = {worst:e}, largest |logit| = {largest}");
    assert!(worst <= 1e-5 * largest, "max |Δ| {worst} vs largest {largest}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The tiny preset scales scores by 24^-½ where its heads are 16 wide:
/// llama.cpp would compute something else, so the file is refused.
#[test]
fn a_scale_llama_cpp_does_not_use_is_refused() {
    let f = gemma2::FAMILY.for_config(&config::ModelConfig { family: "gemma2".into(), ..Default::default() }, None);
    let f = f.unwrap_or_else(|e| panic!("{e}"));
    let model = f.build(Build::default()).unwrap();
    let layout = model.layout().clone();
    let p = vec![0.0; layout.n_params()];
    let e = f.gguf_export(&layout, &p).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("query_pre_attn_scalar") && e.contains("1/√16"), "{e}");
}

/// The file reads back as Gemma 2 (llama.cpp's `gemma2`: gains `1 + w`
/// back to `w`, the four norms by their names, caps and window from its
/// keys, windows on the even layers), bit for bit. The tiny preset's score
/// scale is not llama.cpp's, so the heads' width is the scale here.
#[test]
fn the_file_loads_back_as_gemma2() {
    let mut json = gemma2::GEMMA2.hf_json(&gemma2::GEMMA2.preset("tiny").unwrap());
    json["query_pre_attn_scalar"] = 16.into();
    let f = gemma2::FAMILY.for_hf_dir(&std::env::temp_dir(), &json).unwrap();
    family::round_trip::assert_gguf_round_trip(&gemma2::FAMILY, &*f, 11);
}
