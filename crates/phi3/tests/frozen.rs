//! A Phi-3 base packs into its seven projections from its fused weights
//! (`qkv_proj`, `gate_up_proj`; llama.cpp's `attn_qkv`, `ffn_up`): QLoRA
//! reads Phi-3 files as it reads the Llama block's.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use engine::Model;
use family::{Build, Family};
use llama::{Dialect, FrozenBase, FrozenFormat, Llama, LlamaFamily, Proj};
use nn::linear::PackFormat;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// From a `Phi3ForCausalLM` folder (f32, packed as bf16) every projection
/// equals `FrozenBase::quantize` of the same parameters, bit for bit; from
/// a GGUF file in Q8_0 kept as its own blocks (`"source"`), every
/// projection dequantises to its rows of the file's fused tensor, bit for
/// bit (a slice of whole rows of blocks is the same blocks). A wrong row
/// cut would hand q's rows to k, or the gate's to up.
#[test]
fn fused_weights_pack_into_their_projections() {
    let cfg = phi3::PHI3.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    let plain = Llama::new(cfg.clone()).unwrap_or_else(|e| panic!("{e}"));
    let params = plain.init_params(4);
    let dir = common::tmpdir("phi3-frozen");
    let fam = LlamaFamily::new(&phi3::PHI3, cfg.clone(), None).unwrap_or_else(|e| panic!("{e}"));
    fam.save_hf(&dir, plain.layout(), &params).unwrap_or_else(|e| panic!("{e}"));
    let how = (&phi3::PHI3 as &dyn Dialect, &cfg);
    let bf16 = FrozenFormat::Pack(PackFormat::Bf16);
    let (from_folder, _) = llama::frozen_load::load(how, &dir, (bf16, false), None).unwrap_or_else(|e| panic!("{e}"));
    let want = FrozenBase::quantize(&cfg, &params, PackFormat::Bf16).unwrap_or_else(|e| panic!("{e}"));
    for layer in 0..cfg.n_layer {
        for pr in Proj::ALL {
            let (got, want) = (from_folder.dequantize(&cfg, layer, pr), want.dequantize(&cfg, layer, pr));
            assert!(bits(&got) == bits(&want), "layer {layer} {}: packed from the folder", pr.name());
        }
    }
    // The GGUF file: its fused tensors kept as their Q8_0 blocks.
    let layout = fam.build(Build::default()).unwrap_or_else(|e| panic!("{e}")).layout().clone();
    let path = dir.join("phi3.gguf");
    let q8 = gguf::GgmlType::from_id(gguf::GgmlType::Q8_0).expect("Q8_0 is a ggml type");
    fam.gguf_export(&layout, &params).unwrap_or_else(|e| panic!("{e}")).write(&path, q8).unwrap();
    let (kept, _) =
        llama::frozen_load::load(how, &path, (FrozenFormat::Source, false), None).unwrap_or_else(|e| panic!("{e}"));
    assert!(kept.format_names().contains("q8_0"), "{}", kept.format_names());
    let file = llama::import::open(&phi3::PHI3, gguf::GgufFile::open(&path).unwrap()).unwrap().1;
    for layer in 0..cfg.n_layer {
        for (fused, parts) in [("attn_qkv", &[Proj::Q, Proj::K, Proj::V][..]), ("ffn_up", &[Proj::Gate, Proj::Up])] {
            let (_, _, whole) = file.tensor(&format!("blk.{layer}.{fused}.weight")).unwrap();
            let got: Vec<f32> = parts.iter().flat_map(|&pr| kept.dequantize(&cfg, layer, pr)).collect();
            assert!(bits(&got) == bits(&whole), "layer {layer} {fused}: the parts are the file's rows");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
