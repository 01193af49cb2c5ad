//! Shared by the Llama crate's integration tests: fixture paths, the
//! PyTorch reference files, comparisons and temporary directories.
#![allow(dead_code)]

pub mod pipeline;
pub mod suite;

use engine::{FullStore, Model};
pub use llama::TokenBatch;
use llama::{hf, Llama};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A fixture directory made by tests/fixtures/make_fixtures.py.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A fresh, empty temporary directory for this test.
pub fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("macrobatch-llama-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A fixture's `reference.safetensors` (logits, loss, loss_sum, grad.*) by name.
pub fn reference(name: &str) -> HashMap<String, Vec<f32>> {
    hf::read_tensors(&fixture(name).join("reference.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(n, _, d)| (n, d))
        .collect()
}

/// A fixture's `batch.json` as a TokenBatch.
pub fn batch(name: &str) -> TokenBatch {
    let text = std::fs::read_to_string(fixture(name).join("batch.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = |key: &str| -> Vec<Vec<i64>> { serde_json::from_value(v[key].clone()).unwrap() };
    let (ids, targets) = (rows("input_ids"), rows("targets"));
    TokenBatch {
        n_seqs: ids.len(),
        seq_len: ids[0].len(),
        inputs: ids.concat().into_iter().map(|x| x as u32).collect(),
        targets: targets.concat().into_iter().map(|x| x as i32).collect(),
        positions: Vec::new(),
    }
}

/// max |got − want| / max |want|: the error relative to the tensor's scale
/// (element-wise relative errors are meaningless where values cross zero).
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs())).max(1e-30);
    got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// The summed loss and its gradient (trainable tensors back to back, as
/// the store lays them out) from one micro-step with seed 1.
pub fn loss_and_grad(model: &mut Llama, params: &[f32], batch: &TokenBatch) -> (f64, Vec<f32>) {
    let mut g = vec![0.0; model.layout().n_trainable()];
    let mut store = FullStore::for_model(model, params, &mut g).unwrap();
    let stats = model.micro_step(&mut store, batch, 1.0).unwrap();
    (stats.loss_sum, g)
}

/// The trainable tensors' gradients by name, cut from a gradient buffer.
pub fn grads_by_name<'a>(model: &Llama, g: &'a [f32]) -> Vec<(String, &'a [f32])> {
    let mut at = 0;
    model
        .layout()
        .tensors()
        .iter()
        .filter(|t| t.trainable)
        .map(|t| {
            at += t.numel();
            (t.name.clone(), &g[at - t.numel()..at])
        })
        .collect()
}

/// The tolerance of the reference comparisons (the test files' headers say why).
pub const TOL: f32 = 1e-5;

/// Compares logits, mean loss and every trainable gradient of `model` with
/// fixture `name`'s reference; returns the largest relative error seen.
pub fn compare(name: &str, model: &mut Llama, params: &[f32]) -> f32 {
    let (want, b) = (reference(name), batch(name));
    let logits = model.logits(params, &b).unwrap();
    let mut worst = rel_err(&logits, &want["logits"]);
    assert!(worst <= TOL, "{name}: logits differ by {worst:e} of their scale");
    let (loss_sum, g) = loss_and_grad(model, params, &b);
    let loss = loss_sum / b.n_targets() as f64;
    let loss_err = ((loss - want["loss"][0] as f64) / want["loss"][0] as f64).abs() as f32;
    assert!(loss_err <= TOL, "{name}: loss {loss} vs {} (relative {loss_err:e})", want["loss"][0]);
    let mut n_grads = 0;
    for (tensor, got) in grads_by_name(model, &g) {
        let w = want.get(&format!("grad.{tensor}")).unwrap_or_else(|| panic!("{name}: no reference for {tensor}"));
        let e = rel_err(got, w);
        assert!(e <= TOL, "{name}: gradient of {tensor} differs by {e:e} of its scale");
        worst = worst.max(e);
        n_grads += 1;
    }
    assert_eq!(
        n_grads,
        want.keys().filter(|k| k.starts_with("grad.")).count(),
        "{name}: every reference gradient compared"
    );
    println!("{name}: loss {loss:.7} (relative error {loss_err:.1e}); largest error of logits and {n_grads} gradients: {worst:.1e} of scale");
    worst.max(loss_err)
}

/// Generation with a key/value cache on `cfg` (its context crossed by a
/// 48-token run) against generation without one
/// (`family::generation::check_kv_cache`): the same greedy tokens, each
/// step's logits within `tolerance` of its largest. Returns the largest
/// relative difference seen.
pub fn cached_generation_matches(cfg: &llama::LlamaConfig, params: &[f32], tolerance: f32) -> f32 {
    use family::{Erased, LanguageModel};
    let prompt = |len: usize| (0..len).map(|i| (i * 37 % 251) as u32).collect::<Vec<_>>();
    let make = || -> family::Result<Box<dyn LanguageModel>> { Ok(Box::new(Erased(Llama::new(cfg.clone())?))) };
    let runs = [(prompt(5), 15), (prompt(6), 42), (prompt(30), 12)];
    let seen = family::generation::check_kv_cache(&make, params, &runs, cfg.max_position_embeddings, tolerance)
        .unwrap_or_else(|e| panic!("{e}"));
    println!("largest relative logit difference {:e}", seen.rel);
    assert!(seen.distinct >= 6, "only {} distinct tokens generated: the check would see little", seen.distinct);
    seen.rel
}
