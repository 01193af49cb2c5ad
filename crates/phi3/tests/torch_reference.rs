//! Logits, loss and every gradient against transformers' Phi3ForCausalLM
//! on the same weights and batch, with a sliding window of 5 keys over
//! sequences of 12 (fixture made by crates/llama/tests/fixtures/make_fixtures.py,
//! which writes it here, the fused weights' gradients as their parts';
//! tolerances as for Llama: crates/llama/tests/torch_reference.rs). The
//! file stores q|k|v and gate|up fused, and the folder we write stores
//! them fused again, with the values read.

#[path = "../../llama/tests/common/mod.rs"]
mod common;

use common::{compare, fixture, tmpdir};
use family::{Build, Registration};
use llama::{hf, Dialect, Llama};

#[test]
fn phi3_sliding_window_matches_transformers() {
    let dir = fixture("phi3");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg = phi3::PHI3.parse_hf_json(&serde_json::from_str(&text).unwrap()).unwrap();
    assert_eq!(cfg.sliding_window, Some(5), "{cfg:?}");
    let params = hf::load_weights_stored_as(&dir, &cfg, cfg.fused_weights()).unwrap();
    compare("phi3", &mut Llama::new(cfg).unwrap(), &params);
}

#[test]
fn files_hold_the_fused_weights_both_ways() {
    let dir = fixture("phi3");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = phi3::PHI3.parse_hf_json(&json).unwrap();
    // Read as Llama's separate projections, the file's fused tensors are unknown.
    let e = hf::load_weights(&dir, &cfg).err().map(|e| format!("{e:?}")).unwrap_or_default();
    assert!(e.contains("qkv_proj") || e.contains("gate_up_proj"), "{e}");
    let params = hf::load_weights_stored_as(&dir, &cfg, cfg.fused_weights()).unwrap();
    // Written by the family and read back: fused names only, the same bits.
    let f = phi3::FAMILY.for_hf_dir(&dir, &json).unwrap();
    let layout = f.build(Build::default()).unwrap().layout().clone();
    let out = tmpdir("phi3-fused");
    f.save_hf(&out, &layout, &params).unwrap();
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8_lossy(&bytes[8..8 + header_len]).to_string();
    for layer in 0..cfg.n_layer {
        for (name, present) in [
            ("self_attn.qkv_proj", true),
            ("mlp.gate_up_proj", true),
            ("self_attn.q_proj", false),
            ("mlp.up_proj", false),
        ] {
            let full = format!("\"model.layers.{layer}.{name}.weight\"");
            assert_eq!(header.contains(&full), present, "{full} in the written file");
        }
    }
    let again = f.load_weights(&out, &layout).unwrap();
    assert!(again.iter().zip(&params).all(|(a, b)| a.to_bits() == b.to_bits()) && again.len() == params.len());
    let _ = std::fs::remove_dir_all(&out);
}
