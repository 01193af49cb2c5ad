//! Elementwise functions: `fast_exp`/`fast_tanh`, the tanh-GELU of GPT-2's
//! MLP, the SwiGLU of Llama's and the GeGLU (tanh-GELU gate) of Gemma's.
//!
//! The loops are compiled for AVX-512 and AVX2 as well as the baseline and
//! picked at run time (`multiversion`): the same IEEE operations in the same
//! order (Rust never contracts `a·b + c` into an FMA by itself), so every
//! path gives the same bits, only wider.

use crate::assert_len;
use multiversion::multiversion;
use rayon::prelude::*;

const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2/π)

/// `e^x` for f32 without a libm call, so loops over it vectorise: Cody–Waite
/// range reduction `x = n·ln2 + r` and Cephes' degree-6 polynomial for `e^r`
/// (max relative error ≈ 2 ulp on [-87, 88]; tested against `f32::exp`).
/// Inputs are clamped to [-87.3, 88.7]. A result below `f32::MIN_POSITIVE`
/// (2⁻¹²⁶ ≈ 1.18e-38), and every input below -87.3, gives exactly 0: a
/// denormal result, or the clamp's 1.2e-38, made every product it entered
/// a denormal one, which Intel cores finish in microcode at ~100× the
/// cost — a trained model's peaked attention (most probabilities e^-100 or
/// less) ran 4× slower than a random one's. Flushed, each such term moves a
/// sum of order 1 by less than 2⁻¹²⁶.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding and subtracting rounds to an integer
    let below = x < -87.3;
    let x = x.clamp(-87.3, 88.7);
    let y = x * LOG2E + ROUND;
    let n = y - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5; // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32
    let er = p * r * r + r + 1.0;
    // 2ⁿ by building the exponent bits; n ∈ [-126, 128] after the clamp.
    // `y` is ROUND + n exactly (its ulp is 1), so n is the difference of
    // the bit patterns: integer lanes, where `n as i32` (a saturating
    // conversion) made the compiler convert lane by lane.
    let ni = (y.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let two_n = f32::from_bits(((ni + 127).clamp(0, 255) as u32) << 23);
    let e = er * two_n;
    if below || e < f32::MIN_POSITIVE {
        0.0
    } else {
        e
    }
}

/// `tanh(x) = 1 − 2/(e^{2x} + 1)` on [`fast_exp`]: absolute error ≤ 3e-7
/// (relative accuracy near 0 is not needed: GELU multiplies by x).
#[inline(always)]
pub fn fast_tanh(x: f32) -> f32 {
    1.0 - 2.0 / (fast_exp(2.0 * x) + 1.0)
}

/// GELU, tanh approximation (`gelu_new` in Hugging Face).
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    engine::profile::timed(engine::profile::Kind::Activation, || {
        assert_len("gelu_forward", "out", out.len(), &[inp.len()]);
        out.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(o, x)| gelu_forward_chunk(o, x));
    })
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn gelu_forward_chunk(o: &mut [f32], x: &[f32]) {
    for (o, &x) in o.iter_mut().zip(x) {
        *o = gelu(x);
    }
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    let cube = 0.044715 * x * x * x;
    0.5 * x * (1.0 + fast_tanh(GELU_SCALE * (x + cube)))
}

/// The derivative of [`gelu`].
#[inline(always)]
fn gelu_grad(x: f32) -> f32 {
    let cube = 0.044715 * x * x * x;
    let th = fast_tanh(GELU_SCALE * (x + cube));
    let sech2 = 1.0 - th * th;
    0.5 * (1.0 + th) + 0.5 * x * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x)
}

/// In place: `d ← d · gelu'(inp)`.
pub fn gelu_backward_inplace(d: &mut [f32], inp: &[f32]) {
    engine::profile::timed(engine::profile::Kind::Activation, || {
        assert_len("gelu_backward_inplace", "d", d.len(), &[inp.len()]);
        d.par_chunks_mut(4096).zip(inp.par_chunks(4096)).for_each(|(d, x)| gelu_backward_chunk(d, x));
    })
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn gelu_backward_chunk(d: &mut [f32], x: &[f32]) {
    for (d, &x) in d.iter_mut().zip(x) {
        *d *= gelu_grad(x);
    }
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fast_exp(-x))
}

/// SwiGLU: `m = silu(g) · u` where rows of `gu` are `[g: f | u: f]`
/// (gate_proj's and up_proj's outputs side by side), `m` `[n, f]`.
pub fn swiglu_forward(m: &mut [f32], gu: &[f32], f: usize) {
    engine::profile::timed(engine::profile::Kind::Activation, || {
        let n = m.len() / f.max(1);
        assert_len("swiglu_forward", "m", m.len(), &[n, f]);
        assert_len("swiglu_forward", "gu", gu.len(), &[n, 2, f]);
        m.par_chunks_mut(f).zip(gu.par_chunks(2 * f)).for_each(|(m, gu)| {
            let (g, u) = gu.split_at(f);
            for i in 0..f {
                m[i] = g[i] * sigmoid(g[i]) * u[i];
            }
        });
    })
}

/// Backward of [`swiglu_forward`]: overwrites `dgu` `[n, 2f]` with
/// `dg = dm·u·σ(g)·(1 + g·(1 − σ(g)))` and `du = dm·silu(g)`.
pub fn swiglu_backward(dgu: &mut [f32], dm: &[f32], gu: &[f32], f: usize) {
    engine::profile::timed(engine::profile::Kind::Activation, || {
        let n = dm.len() / f.max(1);
        assert_len("swiglu_backward", "dm", dm.len(), &[n, f]);
        assert_len("swiglu_backward", "gu", gu.len(), &[n, 2, f]);
        assert_len("swiglu_backward", "dgu", dgu.len(), &[n, 2, f]);
        dgu.par_chunks_mut(2 * f).zip(gu.par_chunks(2 * f)).zip(dm.par_chunks(f)).for_each(|((dgu, gu), dm)| {
            let (g, u) = gu.split_at(f);
            let (dg, du) = dgu.split_at_mut(f);
            for i in 0..f {
                let sg = sigmoid(g[i]);
                dg[i] = dm[i] * u[i] * sg * (1.0 + g[i] * (1.0 - sg));
                du[i] = dm[i] * g[i] * sg;
            }
        });
    })
}

/// The gated MLP's activation: `m = act(g) · u` over rows `[g: f | u: f]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Glu {
    /// `silu(g) · u` (Llama, Qwen, Mistral, Phi-3: `hidden_act = "silu"`).
    #[default]
    Silu,
    /// `gelu_tanh(g) · u` (Gemma: `hidden_activation = "gelu_pytorch_tanh"`).
    GeluTanh,
}

impl Glu {
    /// `m = act(g) · u`, as [`swiglu_forward`].
    pub fn forward(self, m: &mut [f32], gu: &[f32], f: usize) {
        match self {
            Glu::Silu => swiglu_forward(m, gu, f),
            Glu::GeluTanh => geglu_forward(m, gu, f),
        }
    }

    /// The gradient of [`Glu::forward`], as [`swiglu_backward`].
    pub fn backward(self, dgu: &mut [f32], dm: &[f32], gu: &[f32], f: usize) {
        match self {
            Glu::Silu => swiglu_backward(dgu, dm, gu, f),
            Glu::GeluTanh => geglu_backward(dgu, dm, gu, f),
        }
    }
}

/// GeGLU: `m = gelu_tanh(g) · u` where rows of `gu` are `[g: f | u: f]`.
pub fn geglu_forward(m: &mut [f32], gu: &[f32], f: usize) {
    engine::profile::timed(engine::profile::Kind::Activation, || {
        let n = m.len() / f.max(1);
        assert_len("geglu_forward", "m", m.len(), &[n, f]);
        assert_len("geglu_forward", "gu", gu.len(), &[n, 2, f]);
        m.par_chunks_mut(f).zip(gu.par_chunks(2 * f)).for_each(|(m, gu)| {
            let (g, u) = gu.split_at(f);
            for i in 0..f {
                m[i] = gelu(g[i]) * u[i];
            }
        });
    })
}

/// Backward of [`geglu_forward`]: `dgu` (overwritten) from `dm`.
pub fn geglu_backward(dgu: &mut [f32], dm: &[f32], gu: &[f32], f: usize) {
    engine::profile::timed(engine::profile::Kind::Activation, || {
        let n = dm.len() / f.max(1);
        assert_len("geglu_backward", "dm", dm.len(), &[n, f]);
        assert_len("geglu_backward", "gu", gu.len(), &[n, 2, f]);
        assert_len("geglu_backward", "dgu", dgu.len(), &[n, 2, f]);
        dgu.par_chunks_mut(2 * f).zip(gu.par_chunks(2 * f)).zip(dm.par_chunks(f)).for_each(|((dgu, gu), dm)| {
            let (g, u) = gu.split_at(f);
            let (dg, du) = dgu.split_at_mut(f);
            for i in 0..f {
                dg[i] = dm[i] * u[i] * gelu_grad(g[i]);
                du[i] = dm[i] * gelu(g[i]);
            }
        });
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_fd, randn};

    /// The exponent's bits as they were first built (`n as i32`, which the
    /// compiler converts lane by lane): the integer-lane form gives the
    /// same bits for every input, so no result anywhere changed.
    #[test]
    fn fast_exp_builds_the_same_bits_as_the_float_to_int_form() {
        let reference = |x0: f32| {
            let x = x0.clamp(-87.3, 88.7);
            let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
            let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
            let p = 1.987_569_1e-4;
            let p = p * r + 1.398_199_9e-3;
            let p = p * r + 8.333_452e-3;
            let p = p * r + 4.166_579_6e-2;
            let p = p * r + 1.666_666_5e-1;
            let p = p * r + 0.5;
            let e = (p * r * r + r + 1.0) * f32::from_bits(((n as i32 + 127).clamp(0, 255) as u32) << 23);
            if e < f32::MIN_POSITIVE || x0 < -87.3 {
                0.0
            } else {
                e
            }
        };
        // One f32 in 97 of [-100, 100] by bit pattern (2.2 billion values
        // span the range; this visits ~23 million), the clamp's edges,
        // infinities.
        let (lo, hi) = (100f32.to_bits(), (-100f32).to_bits());
        let positives = (0..=lo).step_by(97).map(f32::from_bits);
        let negatives = ((1u32 << 31)..=hi).step_by(97).map(f32::from_bits);
        let edges = [-87.3f32, 88.7, -87.4, 88.8, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::NAN];
        for x in positives.chain(negatives).chain(edges) {
            let e = fast_exp(x);
            assert_eq!(e.to_bits(), reference(x).to_bits(), "x = {x:e}");
            // Never a denormal: 0, or a normal number (or NaN for NaN).
            assert!(!e.is_subnormal(), "x = {x:e}: {e:e}");
        }
        // Walking down from -87.2, the first 0 is the first input the
        // clamp raises (e^x there is within 4% of 2⁻¹²⁶).
        let mut x = -87.2f32;
        while fast_exp(x) != 0.0 {
            x = f32::from_bits(x.to_bits() + 1);
        }
        assert!(x < -87.3 && (x as f64).exp() < 1.25e-38, "flushed at {x:e}: e^x = {:e}", (x as f64).exp());
        assert_eq!(fast_exp(-87.4), 0.0);
    }

    #[test]
    fn fast_exp_and_tanh_match_libm() {
        let (mut worst_exp, mut worst_tanh) = (0.0f64, 0.0f64);
        let mut x = -87.0f32;
        while x < 88.0 {
            let rel = ((fast_exp(x) as f64 - (x as f64).exp()) / (x as f64).exp()).abs();
            worst_exp = worst_exp.max(rel);
            x += 0.0137;
        }
        let mut x = -12.0f32;
        while x < 12.0 {
            worst_tanh = worst_tanh.max((fast_tanh(x) as f64 - (x as f64).tanh()).abs());
            x += 0.000_731;
        }
        // 2.5e-7 ≈ 2 ulp relative for exp; 3e-7 absolute for tanh.
        assert!(worst_exp < 2.5e-7, "exp relative error {worst_exp:e}");
        assert!(worst_tanh < 3e-7, "tanh absolute error {worst_tanh:e}");
        assert_eq!(fast_exp(-1000.0), 0.0);
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert!(fast_exp(-87.3) >= f32::MIN_POSITIVE, "e^-87.3 ≈ 1.25e-38 is normal");
        assert_eq!(fast_tanh(50.0), 1.0);
        assert_eq!(fast_tanh(-50.0), -1.0);
    }

    #[test]
    fn swiglu_backward_matches_central_differences() {
        let (n, f) = (3, 5);
        let (gu, dm) = (randn(n * 2 * f, 7), randn(n * f, 8));
        let fwd = |gu: &[f32]| {
            let mut m = vec![0.0; n * f];
            swiglu_forward(&mut m, gu, f);
            m
        };
        let mut dgu = vec![0.0; n * 2 * f];
        swiglu_backward(&mut dgu, &dm, &gu, f);
        check_fd("swiglu dgu", &fwd, &gu, &dm, &dgu);
    }

    /// GeGLU's backward against central differences, and its forward
    /// against the tanh-GELU written out in f64 (fast_tanh's 3e-7 absolute
    /// error times |x·u| ≤ ~10 here, well inside 1e-5).
    #[test]
    fn geglu_backward_matches_central_differences() {
        let (n, f) = (3, 5);
        let (gu, dm) = (randn(n * 2 * f, 9), randn(n * f, 10));
        let fwd = |gu: &[f32]| {
            let mut m = vec![0.0; n * f];
            Glu::GeluTanh.forward(&mut m, gu, f);
            m
        };
        let m = fwd(&gu);
        for (r, (m, gu)) in m.chunks(f).zip(gu.chunks(2 * f)).enumerate() {
            for i in 0..f {
                let (g, u) = (gu[i] as f64, gu[f + i] as f64);
                let want =
                    0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3))).tanh()) * u;
                assert!((m[i] as f64 - want).abs() < 1e-5, "row {r}, {i}: {} vs {want}", m[i]);
            }
        }
        let mut dgu = vec![0.0; n * 2 * f];
        Glu::GeluTanh.backward(&mut dgu, &dm, &gu, f);
        check_fd("geglu dgu", &fwd, &gu, &dm, &dgu);
    }

    #[test]
    fn gelu_backward_matches_central_differences() {
        let (x, dout) = (randn(40, 9), randn(40, 10));
        let fwd = |x: &[f32]| {
            let mut o = vec![0.0; x.len()];
            gelu_forward(&mut o, x);
            o
        };
        let mut d = dout.clone();
        gelu_backward_inplace(&mut d, &x);
        check_fd("gelu", &fwd, &x, &dout, &d);
    }
}
