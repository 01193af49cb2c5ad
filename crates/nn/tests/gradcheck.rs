//! The GPT-2 kernels' backward passes (LayerNorm, `Conv1D` linear layers,
//! GELU, multi-head attention, the fused cross-entropy) against central
//! finite differences.
//!
//! Tolerances: kernels run in f32, so a loss of magnitude L carries rounding
//! noise of about L·1e-7; with step h the difference quotient adds noise of
//! ≈ L·1e-7 / h plus a truncation error of O(h²). With h = 1e-2 and the
//! O(1)-sized test functions below both are ≲ 1e-4, so we require
//! |analytic − numeric| ≤ 1e-3 + 1e-2·|numeric| elementwise — tight enough
//! that any missing term (a factor, a transposed index, a dropped sum) fails.

use engine::rng::SplitMix64;
use nn::attention::{attention_backward, attention_forward, AttnShape};
use nn::fd::dot;
use nn::linear::{conv1d_backward, conv1d_forward, LinearShape};
use nn::norm::{layernorm_backward, layernorm_forward, NormSaved};
use nn::{Operands, ParamGrad};

const IGNORE_INDEX: i32 = -100;

const H: f32 = 1e-2;

fn randn(n: usize, seed: u64, std: f64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}

/// Central differences of `f` at `x`, compared with `analytic`.
fn check(what: &str, x: &[f32], analytic: &[f32], f: impl Fn(&[f32]) -> f64) {
    nn::fd::check_gradient(what, x, analytic, (H, 1e-3, 1e-2), f);
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
        layernorm_forward(&mut o, &mut m, &mut s, x, w, b, c);
        (o, m, s)
    };
    let (_, m, s) = fwd(&x, &w, &b);
    let (mut dx, mut dw, mut db) = (vec![0.0; rows * c], vec![0.0; c], vec![0.0; c]);
    let saved = NormSaved { inp: &x, mean: &m, rstd: &s };
    let grad = |buf, accumulate| Some(ParamGrad { buf, accumulate });
    layernorm_backward(&mut dx, grad(&mut dw, true), grad(&mut db, true), &r, saved, &w);
    // Overwrite mode (a step's first micro-step) gives the same values over garbage.
    let (mut dx2, mut dw2, mut db2) = (vec![0.0; rows * c], vec![9.0; c], vec![-9.0; c]);
    layernorm_backward(&mut dx2, grad(&mut dw2, false), grad(&mut db2, false), &r, saved, &w);
    assert_eq!((&dw2, &db2), (&dw, &db));
    check("ln dx", &x, &dx, |x| dot(&fwd(x, &w, &b).0, &r));
    check("ln dw", &w, &dw, |w| dot(&fwd(&x, w, &b).0, &r));
    check("ln db", &b, &db, |b| dot(&fwd(&x, &w, b).0, &r));
}

#[test]
fn conv1d_backward_matches_finite_differences() {
    let (rows, ic, oc) = (5, 6, 7);
    let x = randn(rows * ic, 5, 1.0);
    let w = randn(ic * oc, 6, 0.5);
    let b = randn(oc, 7, 1.0);
    let res = randn(rows * oc, 8, 1.0);
    let r = randn(rows * oc, 9, 1.0);
    let fwd = |x: &[f32], w: &[f32], b: &[f32]| {
        let mut o = vec![0.0; rows * oc];
        conv1d_forward(&mut o, x, w, Some(b), Some(&res), LinearShape::new(rows, ic, oc, Operands::F32));
        o
    };
    // Residual passes through unchanged.
    let plain = {
        let mut o = vec![0.0; rows * oc];
        conv1d_forward(&mut o, &x, &w, None, None, LinearShape::new(rows, ic, oc, Operands::F32));
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
        let (gw, gb) = (ParamGrad { buf: &mut dw[..], accumulate }, ParamGrad { buf: &mut db[..], accumulate });
        conv1d_backward(&mut dx, Some(gw), Some(gb), &r, &x, &w, LinearShape::new(rows, ic, oc, Operands::F32));
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
        nn::act::gelu_forward(&mut o, x);
        o
    };
    // gelu_new(1) = 0.5·(1 + tanh(√(2/π)·1.044715)) = 0.841192 (torch: F.gelu(t, approximate="tanh")).
    assert!((fwd(&[1.0])[0] - 0.841_192).abs() < 1e-6);
    let mut d = r.clone();
    nn::act::gelu_backward_inplace(&mut d, &x);
    check("gelu", &x, &d, |x| dot(&fwd(x), &r));
}

#[test]
fn attention_backward_matches_finite_differences() {
    // Multi-head attention (GPT-2's): a key/value head per query head.
    let s = AttnShape { b: 2, t: 5, n_head: 2, n_kv_head: 2, head_dim: 4, ops: Operands::F32 };
    let c = s.q_dim();
    let qkv = randn(s.b * s.t * 3 * c, 12, 1.0);
    let r = randn(s.b * s.t * c, 13, 1.0);
    let att_len = s.att_len();
    let fwd = |qkv: &[f32]| {
        let (mut o, mut a, mut heads) = (vec![0.0; s.b * s.t * c], vec![0.0; att_len], vec![0.0; s.b * s.t * c]);
        attention_forward(&mut o, &mut a, &mut heads, qkv, s);
        (o, a)
    };
    let (out, att) = fwd(&qkv);
    // Position 0 attends only to itself: its output is its own value vector.
    for h in 0..s.n_head {
        let hd = s.head_dim;
        for i in 0..hd {
            assert!((out[h * hd + i] - qkv[2 * c + h * hd + i]).abs() < 1e-6);
        }
    }
    let (mut dqkv, mut datt, mut heads) = (vec![3.0; qkv.len()], vec![0.0; att_len], vec![0.0; qkv.len()]);
    attention_backward(&mut dqkv, &mut datt, &mut heads, &r, (&qkv, &att), s);
    check("attn dqkv", &qkv, &dqkv, |q| dot(&fwd(q).0, &r));
}

#[test]
fn cross_entropy_backward_matches_finite_differences() {
    let (rows, v) = (4, 9);
    let logits = randn(rows * v, 14, 2.0);
    let targets = [3, IGNORE_INDEX, 0, 8];
    let loss = |l: &[f32]| {
        let (mut l, mut losses) = (l.to_vec(), vec![0.0; rows]);
        nn::loss::softmax_cross_entropy(&mut l, &mut losses, &targets, v, None);
        losses.iter().map(|&x| x as f64).sum::<f64>()
    };
    let mut d = logits.clone();
    let mut losses = vec![0.0; rows];
    nn::loss::softmax_cross_entropy(&mut d, &mut losses, &targets, v, Some(1.0));
    assert_eq!(losses[1], 0.0);
    check("ce dlogits", &logits, &d, loss);
    // With uniform logits the loss is ln(v) exactly.
    let mut u = vec![0.5; v];
    let mut one = vec![0.0];
    nn::loss::softmax_cross_entropy(&mut u, &mut one, &[2], v, None);
    assert!((one[0] - (v as f32).ln()).abs() < 1e-6);
}
