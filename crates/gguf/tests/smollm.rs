//! The real SmolLM2-135M-Instruct GGUF (Q4_1 + Q8_0 + F32) against what
//! `transformers` makes of the same file (fixtures/make_reference.py, whose
//! docstring has the command). Skipped with a message when the file is absent,
//! failed instead under `MACROBATCH_REQUIRE_GGUF=1`.

use gguf::testing::smollm2_or_skip;
use serde_json::Value as Json;
use sha2::{Digest, Sha256};

fn reference() -> Json {
    let text = include_str!("fixtures/smollm2_reference.json");
    serde_json::from_str(text).expect("the committed reference parses")
}

/// Every tensor is bit-identical to transformers' (SHA-256 over the f32
/// bytes); on a mismatch the first 64 values and the sums say where.
#[test]
fn smollm2_tensors_equal_transformers_bit_for_bit() {
    let Some(path) = smollm2_or_skip("smollm2_tensors_equal_transformers_bit_for_bit") else { return };
    let reference = reference();
    let (config, tensors) = gguf::llama::load(&path).unwrap();

    for (key, want) in reference["config"].as_object().unwrap() {
        assert_eq!(&config[key], want, "config.{key}");
    }
    assert_eq!(config["rms_norm_eps"], 1e-5);
    assert_eq!(config["rope_theta"], reference["rope_theta"]);
    assert_eq!(config["model_type"], "llama");

    let want = reference["tensors"].as_object().unwrap();
    assert_eq!(tensors.len(), want.len(), "tensor count");
    let mut mismatches = Vec::new();
    for (name, shape, values) in &tensors {
        let w = &want[name.as_str()];
        let want_shape: Vec<usize> = serde_json::from_value(w["shape"].clone()).unwrap();
        assert_eq!(shape, &want_shape, "{name} shape");
        let mut h = Sha256::new();
        for v in values {
            h.update(v.to_le_bytes());
        }
        let digest: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if digest != w["sha256"].as_str().unwrap() {
            let sum: f64 = values.iter().map(|&v| f64::from(v)).sum();
            let first: Vec<f32> = values.iter().take(8).copied().collect();
            mismatches.push(format!("{name}: sum {sum} vs {}, first {first:?}", w["sum"]));
        }
        if let Some(first64) = w.get("first64") {
            let first64: Vec<f32> = serde_json::from_value(first64.clone()).unwrap();
            assert_eq!(&values[..64], &first64[..], "{name}: first 64 values");
        }
    }
    assert!(mismatches.is_empty(), "{} tensors differ:\n{}", mismatches.len(), mismatches.join("\n"));
}

#[test]
fn smollm2_metadata_and_layout() {
    let Some(path) = smollm2_or_skip("smollm2_metadata_and_layout") else { return };
    let f = gguf::GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.tensors().len(), 272);
    let count = |id: u32| f.tensors().iter().filter(|t| t.type_id == id).count();
    assert_eq!((count(gguf::GgmlType::Q4_1), count(gguf::GgmlType::Q8_0), count(gguf::GgmlType::F32)), (210, 1, 61));
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(f.get_str_array("tokenizer.ggml.merges").unwrap().len(), 48900);
    assert_eq!(f.get_bool_opt("tokenizer.ggml.add_bos_token").unwrap(), Some(false));
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!((embd.ne.clone(), embd.shape()), (vec![576, 49152], vec![49152, 576]));
}
