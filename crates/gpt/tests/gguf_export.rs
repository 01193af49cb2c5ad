//! GPT-2 written as GGUF (llama.cpp's `gpt2` architecture) with the byte
//! tokenizer's metadata: transformers' GGUF loader reads the file back and
//! computes our logits at every position.

use family::{Build, Family, Registration};
use gguf::{GgmlType, GgufFile};

fn family() -> std::sync::Arc<dyn Family> {
    let mut m = config::ModelConfig { family: "gpt2".into(), preset: Some("tiny".into()), ..Default::default() };
    // 1024 positions, as every released GPT-2: transformers' GGUF reader
    // maps `gpt2.context_length` to `n_ctx`, not to `n_positions`, so it
    // builds 1024 positions whatever the file says (llama.cpp reads it).
    for (k, v) in [("n_layer", 2), ("n_embd", 64), ("n_head", 4), ("block_size", 1024)] {
        m.shape.insert(k.into(), toml::Value::Integer(v));
    }
    gpt::FAMILY.for_config(&m, None).unwrap()
}

/// Every parameter drawn (biases and LayerNorm gains too, so a dropped or
/// misplaced one shows).
fn params(n: usize) -> Vec<f32> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.3
        })
        .collect()
}

/// transformers' logits at every position equal ours to 1e-5 of the
/// largest: both f32 with different summation orders (~1e-7 relative per
/// operation through two layers, ~1e-6 measured by `family::reference`);
/// an untransposed Conv1D weight or a misnamed tensor moves them by ~1e-1.
#[test]
fn transformers_reads_the_file_with_our_logits() {
    let f = family();
    let mut model = f.build(Build::default()).unwrap();
    let layout = model.layout().clone();
    let p = params(layout.n_params());
    let mut g = f.gguf_export(&layout, &p).unwrap();
    g.metadata.extend(data::Tokenizer::Byte(data::ByteTokenizer).gguf_metadata().unwrap());
    let dir = std::env::temp_dir().join(format!("macrobatch-gpt-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gpt2.gguf");
    g.write(&path, GgmlType::from_id(GgmlType::F32).unwrap()).unwrap();

    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.get_str("general.architecture").unwrap(), "gpt2");
    let qkv = file.tensor("blk.1.attn_qkv.weight").unwrap();
    assert_eq!(qkv.ne, [64, 192], "[out, in] row-major: ne = [in, out]");
    assert_eq!(file.dequantize("output.weight").unwrap(), file.dequantize("token_embd.weight").unwrap());

    let ids: Vec<u32> = "GGUF, 12 ½ ἀρχή".bytes().map(u32::from).collect();
    let Some(theirs) = gguf::testing::transformers_logits("gpt2-gguf", &path, &ids).unwrap() else { return };
    assert_eq!(theirs.len(), ids.len());
    let (worst, largest) = gguf::testing::logits_gap(&theirs, |t| model.next_token_logits(&p, &ids[..=t]).unwrap());
    println!("gpt2 GGUF via transformers: max |Δlogit| = {worst:e}, largest |logit| = {largest}");
    assert!(worst <= 1e-5 * largest, "max |Δ| {worst} vs largest {largest}");
}
