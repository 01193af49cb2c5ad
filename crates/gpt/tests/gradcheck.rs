//! The whole model's gradient against central finite differences (each
//! kernel's backward is checked in the nn crate).
//!
//! Tolerances: kernels run in f32, so a loss of magnitude L carries rounding
//! noise of about L·1e-7; with step h the difference quotient adds noise of
//! ≈ L·1e-7 / h plus a truncation error of O(h²). With h = 1e-2 and the
//! O(1)-sized test functions below both are ≲ 1e-4, so we require
//! |analytic − numeric| ≤ 1e-3 + 1e-2·|numeric| elementwise — tight enough
//! that any missing term (a factor, a transposed index, a dropped sum) fails.
//! The whole-model check perturbs GPT-2's init with N(0, 0.3) noise so every
//! path carries gradient; its curvature is larger, so it uses h = 3e-3
//! (measured: the worst error fell from 1.1e-2 at h = 1e-2 to 8.8e-4 at
//! h = 3e-3, the h² scaling of truncation error, i.e. not a kernel bug).

use engine::rng::SplitMix64;
use engine::{FullStore, Model};
use gpt::{init_params, Batch, Gpt, GptConfig, IGNORE_INDEX};

fn randn(n: usize, seed: u64, std: f64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}

fn tiny_cfg() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 2, n_embd: 8, block_size: 6, vocab_size: 11 }
}

fn tiny_batch() -> Batch {
    let (b, t) = (2, 5);
    let inputs: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 3) % 11) as u32).collect();
    let mut targets: Vec<i32> = (0..b * t).map(|i| ((i * 5 + 1) % 11) as i32).collect();
    targets[3] = IGNORE_INDEX;
    Batch { n_seqs: b, seq_len: t, inputs, targets, positions: Vec::new() }
}

#[test]
fn whole_model_gradient_matches_finite_differences() {
    let cfg = tiny_cfg();
    let mut model = Gpt::new(cfg).unwrap();
    // Larger than GPT-2's init so that every path carries a visible gradient.
    let mut params = init_params(&cfg, 3);
    let noise = randn(params.len(), 15, 0.3);
    params.iter_mut().zip(&noise).for_each(|(p, n)| *p += n);
    let batch = tiny_batch();
    let (segs, layout) = (model.segments(), model.layout().clone());
    let mut grads = vec![0.0; params.len()];
    let stats = model.micro_step(&mut FullStore::for_model(&model, &params, &mut grads).unwrap(), &batch, 1.0).unwrap();
    assert_eq!(stats.n_targets, 9);
    let loss = |p: &[f32]| {
        Gpt::new(cfg)
            .unwrap()
            .loss(&mut FullStore::read_only(&layout, segs.clone(), p).unwrap(), &batch)
            .unwrap()
            .loss_sum
    };
    assert!((loss(&params) - stats.loss_sum).abs() < 1e-9, "eval and train forward agree");
    nn::fd::check_gradient("model", &params, &grads, (3e-3, 1e-3, 1e-2), loss);
    // grad_scale multiplies the gradient and leaves the loss alone; grads accumulate.
    let mut twice = grads.clone();
    let s2 = model.micro_step(&mut FullStore::for_model(&model, &params, &mut twice).unwrap(), &batch, 0.5).unwrap();
    assert_eq!(s2.loss_sum, stats.loss_sum);
    for (t, g) in twice.iter().zip(&grads) {
        assert!((t - 1.5 * g).abs() <= 1e-6 * (1.0 + g.abs()));
    }
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let cfg = tiny_cfg();
    let mut model = Gpt::new(cfg).unwrap();
    let params = init_params(&cfg, 0);
    let mut store = FullStore::read_only_for(&model, &params).unwrap();
    let mut b = tiny_batch();
    b.inputs[0] = 11;
    assert!(model.loss(&mut store, &b).unwrap_err().to_string().contains("outside the vocabulary"));
    let mut b = tiny_batch();
    b.seq_len = 7;
    b.n_seqs = 1;
    b.inputs.truncate(7);
    b.targets.truncate(7);
    assert!(model.loss(&mut store, &b).unwrap_err().to_string().contains("block_size"));
    assert!(model.loss(&mut FullStore::read_only_for(&model, &params[1..]).unwrap(), &tiny_batch()).is_err());
}
