//! Hugging Face checkpoints: save → load is bit-exact, transformers'
//! sharded and 16-bit files load as the f32 values they encode, named
//! tensors from another loader go through the same checks, and every
//! malformed input is a named error.

mod common;
use common::{fixture, tmpdir};
use engine::{Model, Precision};
use llama::{hf, Llama, LlamaConfig, LlamaError};
use safetensors::tensor::{Dtype, TensorView};
use std::path::Path;

/// The whole error chain, as the binary prints it.
fn chain(e: &LlamaError) -> String {
    let mut s = e.to_string();
    let mut cur: Option<&dyn std::error::Error> = std::error::Error::source(e);
    while let Some(c) = cur {
        s += &format!(": {c}");
        cur = c.source();
    }
    s
}

/// The base model's tensors of `params` as named tensors (HF names, shapes).
fn named(cfg: &LlamaConfig, params: &[f32]) -> Vec<hf::NamedTensor> {
    let model = Llama::new(cfg.clone()).unwrap();
    model.layout().tensors().iter().map(|t| (t.name.clone(), t.shape.clone(), params[t.range()].to_vec())).collect()
}

/// Writes `tensors` as one safetensors file with every tensor in `dtype`
/// (F16 / BF16 values must already be representable), plus `cfg` as config.json.
fn write_dir(dir: &Path, cfg: &LlamaConfig, tensors: &[hf::NamedTensor], dtype: Dtype) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, d)| match dtype {
            Dtype::F16 => d.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
            Dtype::BF16 => d.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
            Dtype::I32 => d.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
            _ => d.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        })
        .collect();
    let views: Vec<_> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(dir.join(hf::WEIGHTS_FILE), safetensors::serialize(views, None).unwrap()).unwrap();
    std::fs::write(dir.join(hf::CONFIG_FILE), serde_json::to_string(&cfg.to_hf_json()).unwrap()).unwrap();
}

#[test]
fn save_then_load_is_bit_exact_for_tied_and_untied_models() {
    for name in ["untied", "tied"] {
        let (cfg, params) = hf::load(&fixture(name)).unwrap();
        let dir = tmpdir(&format!("rt-{name}"));
        hf::save(&dir, &cfg, &params).unwrap();
        let (cfg2, params2) = hf::load(&dir).unwrap();
        assert_eq!(cfg2, cfg);
        assert!(params2.iter().zip(&params).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: bit-exact");
        // The tied model's file holds no lm_head, as transformers writes it.
        let names: Vec<String> =
            hf::read_tensors(&dir.join(hf::WEIGHTS_FILE)).unwrap().into_iter().map(|t| t.0).collect();
        assert_eq!(names.contains(&"lm_head.weight".to_string()), !cfg.tie_word_embeddings);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn transformers_sharded_bf16_checkpoint_loads_as_the_weights_it_encodes() {
    // sharded/ is untied/'s model cast to bfloat16 by torch (round to nearest even).
    let (cfg, sharded) = hf::load(&fixture("sharded")).unwrap();
    let (cfg32, mut want) = hf::load(&fixture("untied")).unwrap();
    assert_eq!(cfg, cfg32);
    assert!(std::fs::read_dir(fixture("sharded")).unwrap().count() >= 4, "config, index and at least two shards");
    Precision::Bf16.round(&mut want);
    assert!(sharded.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn f16_checkpoint_loads_as_the_weights_it_encodes() {
    let (cfg, mut params) = hf::load(&fixture("untied")).unwrap();
    Precision::F16.round(&mut params);
    let dir = tmpdir("f16");
    write_dir(&dir, &cfg, &named(&cfg, &params), Dtype::F16);
    let (_, got) = hf::load(&dir).unwrap();
    assert!(got.iter().zip(&params).all(|(a, b)| a.to_bits() == b.to_bits()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn named_tensors_from_another_loader_build_the_same_model() {
    // What a GGUF reader hands over: an HF-style config.json value and
    // dequantised tensors with HF names, in its own order.
    let (cfg, params) = hf::load(&fixture("tied")).unwrap();
    let text = std::fs::read_to_string(fixture("tied").join(hf::CONFIG_FILE)).unwrap();
    let cfg2 = LlamaConfig::from_hf_json(&serde_json::from_str(&text).unwrap()).unwrap();
    assert_eq!(cfg2, cfg);
    let mut tensors = named(&cfg, &params);
    tensors.reverse();
    // A tied checkpoint may carry the head too, if it equals the embedding.
    let embed = tensors.iter().find(|t| t.0 == "model.embed_tokens.weight").unwrap().clone();
    tensors.push(("lm_head.weight".into(), embed.1, embed.2));
    assert_eq!(hf::from_named_tensors(&cfg2, tensors).unwrap(), params);
}

#[test]
fn missing_extra_duplicate_and_misshaped_tensors_are_named() {
    let (cfg, params) = hf::load(&fixture("untied")).unwrap();
    let base = named(&cfg, &params);
    let load = |edit: &dyn Fn(&mut Vec<hf::NamedTensor>)| {
        let mut t = base.clone();
        edit(&mut t);
        hf::from_named_tensors(&cfg, t).unwrap_err()
    };
    let e = load(&|t| t.retain(|t| t.0 != "model.norm.weight"));
    assert!(matches!(&e, LlamaError::MissingTensor { name } if name == "model.norm.weight"), "{e}");
    let e = load(&|t| t.retain(|t| t.0 != "lm_head.weight"));
    assert!(matches!(&e, LlamaError::MissingTensor { name } if name == "lm_head.weight"), "{e}");
    let e = load(&|t| t.push(("model.layers.2.mlp.up_proj.weight".into(), vec![48, 32], vec![0.0; 48 * 32])));
    assert!(matches!(&e, LlamaError::UnexpectedTensors { names } if names[0].contains("layers.2")), "{e}");
    let e = load(&|t| {
        let q = t.iter_mut().find(|t| t.0.ends_with("0.self_attn.k_proj.weight")).unwrap();
        q.1 = vec![q.1[1], q.1[0]];
    });
    assert!(matches!(&e, LlamaError::ShapeMismatch { got, expected, .. } if got == &[32, 16] && expected == &[16, 32]));
    assert!(e.to_string().contains("model.layers.0.self_attn.k_proj.weight"), "{e}");
    let e = load(&|t| {
        t[3].2.pop();
    });
    assert!(matches!(&e, LlamaError::ShapeMismatch { .. }), "values fewer than the shape: {e}");
    let e = load(&|t| t.push(t[5].clone()));
    assert!(matches!(&e, LlamaError::DuplicateTensor { .. }), "{e}");
    // A tied model whose lm_head differs from its embedding.
    let tied = LlamaConfig { tie_word_embeddings: true, ..cfg.clone() };
    let mut t = base.clone();
    t.iter_mut().find(|t| t.0 == "lm_head.weight").unwrap().2[5] += 1.0;
    let e = hf::from_named_tensors(&tied, t).unwrap_err();
    assert!(matches!(e, LlamaError::TiedHeadMismatch { .. }), "{e}");
}

#[test]
fn malformed_files_and_directories_are_named_errors() {
    let (cfg, params) = hf::load(&fixture("untied")).unwrap();
    // A dtype we do not read.
    let dir = tmpdir("i32");
    write_dir(&dir, &cfg, &named(&cfg, &params), Dtype::I32);
    let e = chain(&hf::load(&dir).unwrap_err());
    assert!(e.contains("model.safetensors") && e.contains("I32") && e.contains("F32, F16 and BF16"), "{e}");
    // A truncated file.
    hf::save(&dir, &cfg, &params).unwrap();
    let w = dir.join(hf::WEIGHTS_FILE);
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
    assert!(chain(&hf::load(&dir).unwrap_err()).contains("truncated or corrupt"));
    // Neither weights file.
    std::fs::remove_file(&w).unwrap();
    let e = chain(&hf::load(&dir).unwrap_err());
    assert!(e.contains("neither model.safetensors nor model.safetensors.index.json"), "{e}");
    // A config that asks for RoPE scaling.
    let mut v = cfg.to_hf_json();
    v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0});
    std::fs::write(dir.join(hf::CONFIG_FILE), v.to_string()).unwrap();
    let e = chain(&hf::load(&dir).unwrap_err());
    assert!(e.contains("config.json") && e.contains("rope_scaling") && e.contains("linear"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_shard_index_that_disagrees_with_its_shards_is_named() {
    let dir = tmpdir("index");
    for f in std::fs::read_dir(fixture("sharded")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let index = dir.join(hf::INDEX_FILE);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let map = v["weight_map"].as_object_mut().unwrap();
    let (first, second) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
    assert_eq!(map["model.embed_tokens.weight"], first);
    map.insert("model.embed_tokens.weight".into(), second.into());
    std::fs::write(&index, v.to_string()).unwrap();
    let e = chain(&hf::load(&dir).unwrap_err());
    assert!(e.contains("model.embed_tokens.weight") && e.contains("does not assign"), "{e}");
    v["weight_map"]["model.embed_tokens.weight"] = "../model.safetensors".into();
    std::fs::write(&index, v.to_string()).unwrap();
    assert!(chain(&hf::load(&dir).unwrap_err()).contains("not a plain file name"));
    std::fs::remove_dir_all(&dir).unwrap();
}
