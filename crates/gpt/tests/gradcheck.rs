//! Every kernel's backward, and the whole model's gradient, against central
//! finite differences.
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
use gpt::kernels::{self, AttnShape};
use gpt::{init_params, Batch, Gpt, GptConfig, IGNORE_INDEX};

const H: f32 = 1e-2;

fn randn(n: usize, seed: u64, std: f64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Central differences of `f` at `x`, compared with `analytic`.
fn check(what: &str, x: &[f32], analytic: &[f32], f: impl Fn(&[f32]) -> f64) {
    check_with_step(what, x, analytic, H, f)
}

fn check_with_step(what: &str, x: &[f32], analytic: &[f32], h: f32, f: impl Fn(&[f32]) -> f64) {
    assert_eq!(x.len(), analytic.len());
    let mut worst = (0.0f64, 0usize);
    let mut xs = x.to_vec();
    for i in 0..x.len() {
        let orig = xs[i];
        xs[i] = orig + h;
        let up = f(&xs);
        let hi = xs[i];
        xs[i] = orig - h;
        let down = f(&xs);
        let lo = xs[i];
        xs[i] = orig;
        let numeric = (up - down) / (hi - lo) as f64;
        let err = (analytic[i] as f64 - numeric).abs();
        let allowed = 1e-3 + 1e-2 * numeric.abs();
        assert!(err <= allowed, "{what}[{i}]: analytic {} vs numeric {numeric} (err {err:.2e})", analytic[i]);
        if err > worst.0 {
            worst = (err, i);
        }
    }
    eprintln!("{what}: {} elements, worst abs error {:.2e} at {}", x.len(), worst.0, worst.1);
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let (rows, c) = (3, 8);
    let x = randn(rows * c, 1, 1.0);
    let w = randn(c, 2, 1.0);
    let b = randn(c, 3, 1.0);
    let r = randn(rows * c, 4, 1.0);
    let fwd = |x: &[f32], w: &[f32], b: &[f32]| {
        let (mut o, mut m, mut s) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
        kernels::layernorm_forward(&mut o, &mut m, &mut s, x, w, b, c);
        (o, m, s)
    };
    let (_, m, s) = fwd(&x, &w, &b);
    let (mut dx, mut dw, mut db) = (vec![0.0; rows * c], vec![0.0; c], vec![0.0; c]);
    kernels::layernorm_backward(&mut dx, Some((&mut dw, true)), Some((&mut db, true)), &r, &x, &m, &s, &w, c);
    // Overwrite mode (a step's first micro-step) gives the same values over garbage.
    let (mut dx2, mut dw2, mut db2) = (vec![0.0; rows * c], vec![9.0; c], vec![-9.0; c]);
    kernels::layernorm_backward(&mut dx2, Some((&mut dw2, false)), Some((&mut db2, false)), &r, &x, &m, &s, &w, c);
    assert_eq!((&dw2, &db2), (&dw, &db));
    check("ln dx", &x, &dx, |x| dot(&fwd(x, &w, &b).0, &r));
    check("ln dw", &w, &dw, |w| dot(&fwd(&x, w, &b).0, &r));
    check("ln db", &b, &db, |b| dot(&fwd(&x, &w, b).0, &r));
}

#[test]
fn matmul_backward_matches_finite_differences() {
    let (rows, ic, oc) = (5, 6, 7);
    let x = randn(rows * ic, 5, 1.0);
    let w = randn(ic * oc, 6, 0.5);
    let b = randn(oc, 7, 1.0);
    let res = randn(rows * oc, 8, 1.0);
    let r = randn(rows * oc, 9, 1.0);
    let fwd = |x: &[f32], w: &[f32], b: &[f32]| {
        let mut o = vec![0.0; rows * oc];
        kernels::matmul_forward(&mut o, x, w, Some(b), Some(&res), rows, ic, oc, kernels::Operands::F32);
        o
    };
    // Residual passes through unchanged.
    let plain = {
        let mut o = vec![0.0; rows * oc];
        kernels::matmul_forward(&mut o, &x, &w, None, None, rows, ic, oc, kernels::Operands::F32);
        o
    };
    let full = fwd(&x, &w, &b);
    for i in 0..rows * oc {
        assert!((full[i] - plain[i] - res[i] - b[i % oc]).abs() < 1e-5);
    }
    // Backward into buffers pre-filled with `fill_dx` / `fill_p`, adding into
    // the parameter gradients or overwriting them.
    let bwd = |fill_dx: f32, fill_p: f32, accumulate: bool| {
        let (mut dx, mut dw, mut db) = (vec![fill_dx; rows * ic], vec![fill_p; ic * oc], vec![fill_p; oc]);
        let (gw, gb) = (Some((&mut dw[..], accumulate)), Some((&mut db[..], accumulate)));
        kernels::matmul_backward(&mut dx, gw, gb, &r, &x, &w, rows, ic, oc, kernels::Operands::F32);
        (dx, dw, db)
    };
    let (dx, dw, db) = bwd(7.0, 0.0, true);
    let (dx2, dw2, db2) = bwd(0.0, 5.0, false);
    assert_eq!((&dx2, &dw2, &db2), (&dx, &dw, &db), "overwrite mode ignores what was there");
    check("mm dx", &x, &dx, |x| dot(&fwd(x, &w, &b), &r));
    check("mm dw", &w, &dw, |w| dot(&fwd(&x, w, &b), &r));
    check("mm db", &b, &db, |b| dot(&fwd(&x, &w, b), &r));
}

#[test]
fn gelu_backward_matches_finite_differences() {
    let x = randn(64, 10, 2.0);
    let r = randn(64, 11, 1.0);
    let fwd = |x: &[f32]| {
        let mut o = vec![0.0; x.len()];
        kernels::gelu_forward(&mut o, x);
        o
    };
    // gelu_new(1) = 0.5·(1 + tanh(√(2/π)·1.044715)) = 0.841192 (torch: F.gelu(t, approximate="tanh")).
    assert!((fwd(&[1.0])[0] - 0.841_192).abs() < 1e-6);
    let mut d = r.clone();
    kernels::gelu_backward_inplace(&mut d, &x);
    check("gelu", &x, &d, |x| dot(&fwd(x), &r));
}

#[test]
fn attention_backward_matches_finite_differences() {
    let s = AttnShape { b: 2, t: 5, c: 8, n_head: 2, ops: kernels::Operands::F32 };
    let qkv = randn(s.b * s.t * 3 * s.c, 12, 1.0);
    let r = randn(s.b * s.t * s.c, 13, 1.0);
    let att_len = s.b * s.n_head * s.t * s.t;
    let fwd = |qkv: &[f32]| {
        let (mut o, mut a) = (vec![0.0; s.b * s.t * s.c], vec![0.0; att_len]);
        kernels::attention_forward(&mut o, &mut a, qkv, s);
        (o, a)
    };
    let (out, att) = fwd(&qkv);
    // Position 0 attends only to itself: its output is its own value vector.
    for h in 0..s.n_head {
        let hd = s.c / s.n_head;
        for i in 0..hd {
            assert!((out[h * hd + i] - qkv[2 * s.c + h * hd + i]).abs() < 1e-6);
        }
    }
    let (mut dqkv, mut datt) = (vec![3.0; qkv.len()], vec![0.0; att_len]);
    kernels::attention_backward(&mut dqkv, &mut datt, &r, &qkv, &att, s);
    check("attn dqkv", &qkv, &dqkv, |q| dot(&fwd(q).0, &r));
}

#[test]
fn cross_entropy_backward_matches_finite_differences() {
    let (rows, v) = (4, 9);
    let logits = randn(rows * v, 14, 2.0);
    let targets = [3, IGNORE_INDEX, 0, 8];
    let loss = |l: &[f32]| {
        let (mut l, mut losses) = (l.to_vec(), vec![0.0; rows]);
        kernels::softmax_cross_entropy(&mut l, &mut losses, &targets, v, None);
        losses.iter().map(|&x| x as f64).sum::<f64>()
    };
    let mut d = logits.clone();
    let mut losses = vec![0.0; rows];
    kernels::softmax_cross_entropy(&mut d, &mut losses, &targets, v, Some(1.0));
    assert_eq!(losses[1], 0.0);
    check("ce dlogits", &logits, &d, loss);
    // With uniform logits the loss is ln(v) exactly.
    let mut u = vec![0.5; v];
    let mut one = vec![0.0];
    kernels::softmax_cross_entropy(&mut u, &mut one, &[2], v, None);
    assert!((one[0] - (v as f32).ln()).abs() < 1e-6);
}

fn tiny_cfg() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 2, n_embd: 8, block_size: 6, vocab_size: 11 }
}

fn tiny_batch() -> Batch {
    let (b, t) = (2, 5);
    let inputs: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 3) % 11) as u32).collect();
    let mut targets: Vec<i32> = (0..b * t).map(|i| ((i * 5 + 1) % 11) as i32).collect();
    targets[3] = IGNORE_INDEX;
    Batch { n_seqs: b, seq_len: t, inputs, targets }
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
    check_with_step("model", &params, &grads, 3e-3, loss);
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
