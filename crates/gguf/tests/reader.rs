//! The reader on small files built by `gguf::writer`: every value type,
//! both versions, alignment, tensor placement, and the named errors of
//! broken files. A synthetic Llama file checks names, shapes, tying and the
//! Q/K un-permutation end to end.

use gguf::writer::{self, RawTensor};
use gguf::{GgmlType, GgufError, GgufFile, Value, ValueType};
use std::path::PathBuf;

fn tmp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("macrobatch-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn f32_tensor(name: &str, ne: &[u64], values: &[f32]) -> RawTensor {
    RawTensor {
        name: name.into(),
        ne: ne.to_vec(),
        type_id: GgmlType::F32,
        bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn all_values() -> Vec<(&'static str, Value)> {
    vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-100)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-30000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("f32", Value::F32(1e-5)),
        ("bool", Value::Bool(true)),
        ("string", Value::String("ἀρχή <|im_end|>".into())),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f64", Value::F64(-0.25)),
        ("strings", Value::Array(ValueType::String, vec![Value::String("a".into()), Value::String("".into())])),
        ("ints", Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-3)])),
        ("nested", Value::Array(ValueType::Array, vec![Value::Array(ValueType::U8, vec![Value::U8(1)])])),
        ("empty", Value::Array(ValueType::F64, vec![])),
    ]
}

#[test]
fn every_value_type_round_trips_in_both_versions() {
    for version in [2, 3] {
        let meta = all_values();
        let p = tmp(&format!("values-v{version}.gguf"), &writer::to_bytes(version, &meta, &[]));
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.metadata().len(), meta.len());
        for ((k, v), (k2, v2)) in meta.iter().zip(f.metadata()) {
            assert_eq!((*k, v), (k2.as_str(), v2));
        }
        assert_eq!(f.get_u64("u32").unwrap(), 4_000_000_000);
        assert_eq!(f.get_f64("f32").unwrap(), 1e-5, "f32 reads as its shortest decimal");
        assert_eq!(f.get_str_array("strings").unwrap(), vec!["a", ""]);
        assert_eq!(f.get_i64_array_opt("ints").unwrap(), Some(vec![1, -3]));
        assert!(matches!(f.get_u64("i8"), Err(GgufError::WrongType { .. })), "negative is not a u64");
        let e = f.get_str("u8").unwrap_err().to_string();
        assert!(e.contains("`u8`") && e.contains("expected a string"), "{e}");
        assert!(matches!(f.get_u64("absent"), Err(GgufError::MissingKey { .. })));
        assert_eq!(f.get_u64_opt("absent").unwrap(), None);
    }
}

#[test]
fn tensors_are_placed_by_alignment_and_shaped_row_major() {
    for alignment in [None, Some(64u32), Some(8)] {
        let mut meta = vec![("general.architecture", Value::String("test".into()))];
        if let Some(a) = alignment {
            meta.push(("general.alignment", Value::U32(a)));
        }
        let a: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let tensors = [f32_tensor("a", &[3, 2], &a), f32_tensor("b", &[5], &[9.0; 5]), f32_tensor("c", &[1], &[-1.0])];
        let p = tmp(&format!("tensors-{alignment:?}.gguf"), &writer::to_bytes(3, &meta, &tensors));
        let f = GgufFile::open(&p).unwrap();
        let al = alignment.map_or(32, u64::from);
        assert_eq!(f.alignment(), al);
        assert_eq!(f.data_offset() % al, 0);
        let ta = f.tensor("a").unwrap();
        assert_eq!((ta.ne.clone(), ta.shape(), ta.n_elements()), (vec![3, 2], vec![2, 3], 6));
        assert_eq!(f.dequantize("a").unwrap(), a);
        assert_eq!(f.dequantize("b").unwrap(), vec![9.0; 5]);
        assert_eq!(f.dequantize("c").unwrap(), vec![-1.0]);
        assert!(f.tensors().iter().all(|t| t.offset % al == 0));
        assert!(matches!(f.dequantize("zz"), Err(GgufError::MissingTensor { .. })));
    }
}

#[test]
fn quantised_tensor_through_the_file() {
    // one Q4_1 row of 32: d = 1, m = 0.5, byte j = (15 − j) << 4 | j
    let mut bytes = half::f16::from_f32(1.0).to_le_bytes().to_vec();
    bytes.extend(half::f16::from_f32(0.5).to_le_bytes());
    bytes.extend((0..16u8).map(|j| (15 - j) << 4 | j));
    let t = RawTensor { name: "q".into(), ne: vec![32, 1], type_id: GgmlType::Q4_1, bytes };
    let p = tmp("q41.gguf", &writer::to_bytes(3, &[], &[t]));
    let x = GgufFile::open(&p).unwrap().dequantize("q").unwrap();
    let want: Vec<f32> = (0..16).map(|j| j as f32 + 0.5).chain((0..16).map(|j| (15 - j) as f32 + 0.5)).collect();
    assert_eq!(x, want);
}

#[test]
fn broken_files_are_named_errors() {
    let good = writer::to_bytes(3, &all_values(), &[f32_tensor("a", &[4], &[1.0; 4])]);
    let e = GgufFile::open(tmp("magic.gguf", b"GGML\x03\0\0\0")).unwrap_err();
    assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
    let mut v1 = good.clone();
    v1[4] = 1;
    let e = GgufFile::open(tmp("v1.gguf", &v1)).unwrap_err();
    assert!(matches!(e, GgufError::UnsupportedVersion { version: 1, .. }), "{e}");
    // the writer pads after the last tensor too: cut inside its 16 data bytes
    let data_end = GgufFile::open(tmp("good.gguf", &good)).unwrap().data_offset() as usize + 16;
    for cut in [3, 10, 30, good.len() / 2, data_end - 1] {
        let e = GgufFile::open(tmp("cut.gguf", &good[..cut])).unwrap_err();
        assert!(matches!(e, GgufError::Truncated { .. } | GgufError::BadMagic { .. }), "cut at {cut}: {e}");
    }
    let e = GgufFile::open(tmp("short.gguf", &good[..data_end - 1])).unwrap_err().to_string();
    assert!(e.contains("tensor `a`") && e.contains("truncated"), "{e}");
    // an absurd array length must not allocate, just fail
    let mut huge = writer::to_bytes(3, &[("x", Value::Array(ValueType::U64, vec![Value::U64(1)]))], &[]);
    let count_at = 4 + 4 + 8 + 8 + 8 + 1 + 4 + 4;
    huge[count_at..count_at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(matches!(GgufFile::open(tmp("huge.gguf", &huge)), Err(GgufError::Truncated { .. })));
    let bad_align = writer::to_bytes(3, &[("general.alignment", Value::U32(3))], &[]);
    assert!(matches!(GgufFile::open(tmp("align.gguf", &bad_align)), Err(GgufError::Invalid { .. })));
    let q4k = RawTensor { name: "k".into(), ne: vec![256], type_id: 12, bytes: vec![0; 144] };
    let f = GgufFile::open(tmp("q4k.gguf", &writer::to_bytes(3, &[], &[q4k]))).unwrap();
    let e = f.dequantize("k").unwrap_err();
    assert!(matches!(e, GgufError::UnsupportedType { type_id: 12, type_name: "Q4_K", .. }), "{e}");
    let e = GgufFile::open("/nonexistent/model.gguf").unwrap_err().to_string();
    assert!(e.contains("/nonexistent/model.gguf"), "{e}");
}

/// A two-layer Llama with 2 heads, 1 KV head, head dim 4: every tensor F32
/// with distinct values, Q and K written in llama.cpp's permuted row order.
#[test]
fn synthetic_llama_maps_names_shapes_and_unpermutes_q_k() {
    let (hidden, ffn, vocab, n_heads, n_kv, d) = (8u64, 12u64, 10u64, 2usize, 1usize, 4usize);
    let meta = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(2)),
        ("llama.context_length", Value::U32(128)),
        ("llama.embedding_length", Value::U32(hidden as u32)),
        ("llama.feed_forward_length", Value::U32(ffn as u32)),
        ("llama.attention.head_count", Value::U32(n_heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(n_kv as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ];
    let mut seed = 0.0f32;
    let mut next = |n: u64| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed += 1.0;
                seed
            })
            .collect()
    };
    // permute HF rows the way llama.cpp's converter does: row (h, half, i) → (h, i, half)
    let permute = |hf: &[f32], rows: usize, cols: usize, heads: usize| -> Vec<f32> {
        let dd = rows / heads;
        let mut out = vec![0.0; hf.len()];
        for h in 0..heads {
            for i in 0..dd / 2 {
                for half in 0..2 {
                    let (to, from) = (h * dd + 2 * i + half, h * dd + half * dd / 2 + i);
                    out[to * cols..][..cols].copy_from_slice(&hf[from * cols..][..cols]);
                }
            }
        }
        out
    };
    let mut tensors = vec![f32_tensor("token_embd.weight", &[hidden, vocab], &next(hidden * vocab))];
    let mut hf_q = Vec::new();
    let mut hf_k = Vec::new();
    for layer in 0..2 {
        let q = next(hidden * hidden);
        let k = next(hidden * (n_kv * d) as u64);
        let b = |s: &str| format!("blk.{layer}.{s}.weight");
        tensors.push(f32_tensor(&b("attn_norm"), &[hidden], &next(hidden)));
        tensors.push(f32_tensor(&b("attn_q"), &[hidden, hidden], &permute(&q, 8, 8, n_heads)));
        tensors.push(f32_tensor(&b("attn_k"), &[hidden, (n_kv * d) as u64], &permute(&k, n_kv * d, 8, n_kv)));
        tensors.push(f32_tensor(&b("attn_v"), &[hidden, (n_kv * d) as u64], &next(hidden * 4)));
        tensors.push(f32_tensor(&b("attn_output"), &[hidden, hidden], &next(hidden * hidden)));
        tensors.push(f32_tensor(&b("ffn_norm"), &[hidden], &next(hidden)));
        tensors.push(f32_tensor(&b("ffn_gate"), &[hidden, ffn], &next(hidden * ffn)));
        tensors.push(f32_tensor(&b("ffn_up"), &[hidden, ffn], &next(hidden * ffn)));
        tensors.push(f32_tensor(&b("ffn_down"), &[ffn, hidden], &next(hidden * ffn)));
        hf_q.push(q);
        hf_k.push(k);
    }
    tensors.push(f32_tensor("output_norm.weight", &[hidden], &next(hidden)));
    let p = tmp("llama.gguf", &writer::to_bytes(3, &meta, &tensors));
    let (config, hf) = gguf::llama::load(&p).unwrap();
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["num_key_value_heads"], 1);
    assert_eq!(config["head_dim"], 4);
    assert_eq!(config["rms_norm_eps"], 1e-6);
    assert_eq!(config["rope_theta"], 10000.0);
    assert_eq!(config["vocab_size"], 10, "from token_embd when llama.vocab_size is absent");
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["bos_token_id"], 1);
    assert_eq!(config["pad_token_id"], serde_json::Value::Null);
    assert_eq!(hf.len(), tensors.len());
    assert!(hf.iter().all(|(n, _, _)| n != "lm_head.weight"));
    let get = |name: &str| hf.iter().find(|(n, _, _)| n == name).unwrap();
    assert_eq!(get("model.embed_tokens.weight").1, vec![10, 8]);
    assert_eq!(get("model.layers.1.mlp.down_proj.weight").1, vec![8, 12]);
    assert_eq!(get("model.layers.1.mlp.up_proj.weight").1, vec![12, 8]);
    assert_eq!(get("model.layers.0.self_attn.k_proj.weight").1, vec![4, 8]);
    for layer in 0..2 {
        assert_eq!(get(&format!("model.layers.{layer}.self_attn.q_proj.weight")).2, hf_q[layer]);
        assert_eq!(get(&format!("model.layers.{layer}.self_attn.k_proj.weight")).2, hf_k[layer]);
    }

    let mut with_freqs = tensors.clone();
    with_freqs.push(f32_tensor("rope_freqs.weight", &[2], &[1.0, 1.0]));
    let e = gguf::llama::load(tmp("freqs.gguf", &writer::to_bytes(3, &meta, &with_freqs))).unwrap_err().to_string();
    assert!(e.contains("rope_freqs.weight"), "{e}");
    let mut gpt2 = meta.to_vec();
    gpt2[0].1 = Value::String("gpt2".into());
    let e = gguf::llama::load(tmp("arch.gguf", &writer::to_bytes(3, &gpt2, &tensors))).unwrap_err();
    assert!(matches!(e, GgufError::WrongArchitecture { .. }), "{e}");
}
