//! PEFT's own check of adapters we save (scripts/peft_variants_check.py),
//! shared by the Llama-block families' tests that have `nn` at hand.
#![allow(dead_code)]

use engine::rng::SplitMix64;
use engine::ParamLayout;
use std::path::{Path, PathBuf};

/// Moves every adapter of `layout` off its initial values so that each
/// acts: `lora_B` drawn N(0, `b_sd`²), DoRA's magnitudes scaled by
/// 1 + N(0, `m_sd`²).
pub fn move_adapters(layout: &ParamLayout, params: &mut [f32], rng: &mut SplitMix64, (b_sd, m_sd): (f64, f64)) {
    for t in layout.tensors().iter().filter(|t| llama::lora::is_adapter(&t.name)) {
        let p = &mut params[t.range()];
        if t.name.contains("lora_B") {
            p.iter_mut().for_each(|x| *x = (rng.normal() * b_sd) as f32);
        } else if t.name.ends_with("lora_magnitude_vector") {
            p.iter_mut().for_each(|x| *x *= 1.0 + (rng.normal() * m_sd) as f32);
        }
    }
}

/// Writes what we computed into `dir` (`input_ids` `[b, t]`, the base's
/// logits and each adapter's, `[b·t, v]`) and runs
/// scripts/peft_variants_check.py on `base` (a GGUF file or a Hugging Face
/// folder) with each adapter folder: panics with its output unless PEFT
/// computes every one of our logits.
pub fn check_with_peft(
    dir: &Path,
    base: &Path,
    (b, t, v): (usize, usize, usize),
    (inputs, base_logits): (&[u32], &[f32]),
    adapted: &[(PathBuf, Vec<f32>)],
) {
    let ids: Vec<f32> = inputs.iter().map(|&x| x as f32).collect();
    let mut out: Vec<(String, Vec<usize>, &[f32])> =
        vec![("input_ids".into(), vec![b, t], &ids), ("base_logits".into(), vec![b * t, v], base_logits)];
    for (i, (_, logits)) in adapted.iter().enumerate() {
        out.push((format!("logits.{i}"), vec![b * t, v], logits));
    }
    let expected = dir.join("expected.safetensors");
    nn::io::write_safetensors(&expected, &out, &[]).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/peft_variants_check.py");
    let dirs = adapted.iter().map(|(d, _)| d);
    let o = std::process::Command::new("python3").arg(script).arg(base).arg(&expected).args(dirs).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    println!("{stdout}");
    assert!(o.status.success(), "peft_variants_check.py failed:\n{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
}

/// `b` sequences of `t` tokens drawn below `vocab`, no targets: a batch
/// whose logits are compared.
pub fn random_batch(rng: &mut SplitMix64, (b, t): (usize, usize), vocab: usize) -> engine::TokenBatch {
    let inputs: Vec<u32> = (0..b * t).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
    engine::TokenBatch { n_seqs: b, seq_len: t, inputs, targets: vec![-100; b * t], positions: Vec::new() }
}
