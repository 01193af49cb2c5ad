//! Compute precisions and the conversions between f32 and 16-bit storage.
//!
//! Kernels compute in f32 (GEMMs accumulate in f32); what a low precision
//! changes is what is *stored*: the model's parameter copy, the activations
//! saved for backward, and (f16) the activation gradients between blocks.
//! Storing rounds to nearest-even; f16 overflows to ±inf like the hardware
//! type, which is what the dynamic loss scaler watches for.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use multiversion::multiversion;
use rayon::prelude::*;

/// The compute precision of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// bfloat16 storage (8-bit exponent: no loss scaling needed).
    Bf16,
    /// IEEE half storage (5-bit exponent, max 65504: needs loss scaling).
    F16,
}

const CHUNK: usize = 1 << 14;
/// Elements up to which a conversion runs on the calling thread: a saved
/// activation of a small micro-batch (100 × 576 values) converts in a few
/// microseconds, less than handing its chunks to the pool costs.
const SERIAL: usize = 1 << 17;
/// Elements per f16 rounding task (its 16-bit staging lives on the stack).
const ROUND_CHUNK: usize = 4096;

/// f32 → bf16 bits, round to nearest even; NaN stays NaN.
#[inline(always)]
fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

#[inline(always)]
fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

// The bf16 loops are compiled for AVX-512 and AVX2 too and picked at run
// time: integer and bit operations only, so every path gives the same bits.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn encode_bf16(s: &[f32], d: &mut [u16]) {
    d.iter_mut().zip(s).for_each(|(d, &x)| *d = to_bf16(x));
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn decode_bf16(s: &[u16], d: &mut [f32]) {
    d.iter_mut().zip(s).for_each(|(d, &h)| *d = from_bf16(h));
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn round_bf16(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = from_bf16(to_bf16(*v)));
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        })
    }
}

impl Precision {
    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            _ => 2,
        }
    }

    /// Whether values are stored in 16 bits.
    pub fn is_low(self) -> bool {
        self != Precision::F32
    }

    /// Encodes `src` into 16-bit storage (`dst.len() == src.len()`).
    pub fn encode(self, src: &[f32], dst: &mut [u16]) {
        crate::profile::timed(crate::profile::Kind::Convert, || {
            let one = |(d, s): (&mut [u16], &[f32])| match self {
                Precision::Bf16 => encode_bf16(s, d),
                // half's slice conversions use the CPU's F16C instructions when present.
                Precision::F16 => d.reinterpret_cast_mut::<half::f16>().convert_from_f32_slice(s),
                Precision::F32 => unreachable!("f32 is not stored in 16 bits"),
            };
            match src.len() <= SERIAL {
                true => one((dst, src)),
                false => dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(one),
            }
        })
    }

    /// Decodes 16-bit storage into f32.
    pub fn decode(self, src: &[u16], dst: &mut [f32]) {
        crate::profile::timed(crate::profile::Kind::Convert, || {
            let one = |(d, s): (&mut [f32], &[u16])| match self {
                Precision::Bf16 => decode_bf16(s, d),
                Precision::F16 => s.reinterpret_cast::<half::f16>().convert_to_f32_slice(d),
                Precision::F32 => unreachable!("f32 is not stored in 16 bits"),
            };
            match src.len() <= SERIAL {
                true => one((dst, src)),
                false => dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(one),
            }
        })
    }

    /// Rounds values in place to what this precision can store (identity for f32).
    pub fn round(self, x: &mut [f32]) {
        let f16 = |c: &mut [f32]| {
            let mut tmp = [half::f16::ZERO; ROUND_CHUNK];
            let tmp = &mut tmp[..c.len()];
            tmp.convert_from_f32_slice(c);
            tmp.convert_to_f32_slice(c);
        };
        match (self, x.len() <= SERIAL) {
            (Precision::F32, _) => {}
            (Precision::Bf16, true) => round_bf16(x),
            (Precision::Bf16, false) => x.par_chunks_mut(CHUNK).for_each(round_bf16),
            (Precision::F16, true) => x.chunks_mut(ROUND_CHUNK).for_each(f16),
            (Precision::F16, false) => x.par_chunks_mut(ROUND_CHUNK).for_each(f16),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_the_formats() {
        // bf16 keeps 8 significant bits: 1 + 2^-8 rounds to even (1.0), 1 + 3·2^-8 up to 1 + 2^-6.
        let mut v = vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 3.0e38, -2.5, f32::INFINITY];
        Precision::Bf16.round(&mut v);
        // Near 3e38 bf16 steps by 2^120: 3e38 / 2^120 = 225.7 → 226 · 2^120 = 3.0040553e38.
        assert_eq!(v[..4], [1.0, 1.0 + 1.0 / 64.0, 3.004_055_3e38, -2.5]);
        assert!(v[4].is_infinite());
        // f16: max 65504; 65520 and above overflow to inf; 1/3 has 11 significant bits.
        let mut h = vec![65504.0, 65520.0, -1.0e6, 1.0 / 3.0];
        Precision::F16.round(&mut h);
        assert_eq!(h[0], 65504.0);
        assert!(h[1].is_infinite() && h[2] == f32::NEG_INFINITY);
        assert_eq!(h[3], 0.333_251_95);
        let mut bits = vec![0u16; 4];
        let mut back = vec![0.0f32; 4];
        for p in [Precision::Bf16, Precision::F16] {
            let src = [0.1f32, -7.25, 1e-3, 42.0];
            p.encode(&src, &mut bits);
            p.decode(&bits, &mut back);
            let mut rounded = src.to_vec();
            p.round(&mut rounded);
            assert_eq!(back, rounded, "{p:?}: encode+decode equals rounding");
        }
    }
}
