//! AVX2 (+F16C) block decoders, taken when the CPU has them (detected at
//! run time). They are the portable decoders' operations lane by lane —
//! integer to f32 conversions (exact), one f32 multiply, Q4_1's one add,
//! NF4's table lookups (copies) and F16C's exact widening — so they give the
//! same bits (tested against the portable ones).

use super::decode::f16_le;
use std::arch::x86_64::*;

/// Whether this CPU has AVX2 and F16C.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

/// 8 f32 to `out[at..at + 8]`.
#[inline(always)]
unsafe fn store(out: &mut [f32], at: usize, v: __m256) {
    assert!(at + 8 <= out.len());
    _mm256_storeu_ps(out.as_mut_ptr().add(at), v);
}

/// 16 bytes at `b[at..]`.
#[inline(always)]
unsafe fn load16(b: &[u8], at: usize) -> __m128i {
    assert!(at + 16 <= b.len());
    _mm_loadu_si128(b.as_ptr().add(at).cast())
}

/// The low and high nibbles of 16 bytes, as 16 bytes each.
#[inline(always)]
unsafe fn nibbles(q: __m128i) -> (__m128i, __m128i) {
    let mask = _mm_set1_epi8(0x0F);
    (_mm_and_si128(q, mask), _mm_and_si128(_mm_srli_epi16::<4>(q), mask))
}

/// Bytes 0..8 and 8..16 of `x` widened to two vectors of 8 i32.
#[inline(always)]
unsafe fn widen(x: __m128i) -> (__m256i, __m256i) {
    (_mm256_cvtepu8_epi32(x), _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(x)))
}

/// bf16 values.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn bf16(bytes: &[u8], out: &mut [f32]) {
    let n8 = out.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        let h = _mm256_cvtepu16_epi32(load16(bytes, 2 * i));
        store(out, i, _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)));
    }
    super::decode::decode_bf16(&bytes[2 * n8..], &mut out[n8..]);
}

/// f16 values (F16C).
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn f16(bytes: &[u8], out: &mut [f32]) {
    let n8 = out.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        store(out, i, _mm256_cvtph_ps(load16(bytes, 2 * i)));
    }
    super::decode::decode_f16(&bytes[2 * n8..], &mut out[n8..]);
}

/// Q8_0 blocks.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn q8_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
        let d = _mm256_set1_ps(f16_le(b, 0));
        for (c, at) in [(0, 2), (16, 18)] {
            let q = load16(b, at);
            let (x0, x1) = (_mm256_cvtepi8_epi32(q), _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q)));
            store(o, c, _mm256_mul_ps(d, _mm256_cvtepi32_ps(x0)));
            store(o, c + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(x1)));
        }
    }
}

/// Q4_0 blocks.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn q4_0(bytes: &[u8], out: &mut [f32]) {
    let eight = _mm256_set1_epi32(8);
    for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
        let d = _mm256_set1_ps(f16_le(b, 0));
        let (lo, hi) = nibbles(load16(b, 2));
        for (c, half) in [(0, lo), (16, hi)] {
            let (x0, x1) = widen(half);
            store(o, c, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(x0, eight))));
            store(o, c + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(x1, eight))));
        }
    }
}

/// Q4_1 blocks.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn q4_1(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
        let (d, m) = (_mm256_set1_ps(f16_le(b, 0)), _mm256_set1_ps(f16_le(b, 2)));
        let (lo, hi) = nibbles(load16(b, 4));
        for (c, half) in [(0, lo), (16, hi)] {
            let (x0, x1) = widen(half);
            store(o, c, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(x0)), m));
            store(o, c + 8, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(x1)), m));
        }
    }
}

/// 32 bytes of NF4 codes at the 16 scaled codes `t` into 64 values.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(crate) unsafe fn nf4_codes(codes: &[u8], t: &[f32; 16], out: &mut [f32]) {
    let (t0, t1) = (_mm256_loadu_ps(t.as_ptr()), _mm256_loadu_ps(t.as_ptr().add(8)));
    // Entry idx of the 16: the low 3 bits pick within a half, bit 3 the half.
    let lookup = |idx: __m256i| {
        let (a, b) = (_mm256_permutevar8x32_ps(t0, idx), _mm256_permutevar8x32_ps(t1, idx));
        _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)))
    };
    for at in [0, 16] {
        let (lo, hi) = nibbles(load16(codes, at));
        for (c, half) in [(at, lo), (32 + at, hi)] {
            let (x0, x1) = widen(half);
            store(out, c, lookup(x0));
            store(out, c + 8, lookup(x1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{decode, nf4, PackFormat, PackedMatrix};

    /// The AVX2 decoders give the portable decoders' bits on random bytes
    /// (every f16/bf16 pattern class, NaN included; any nibbles and scales).
    #[test]
    fn avx2_decoders_match_the_portable_ones() {
        if !super::available() {
            eprintln!("no AVX2/F16C: nothing to compare");
            return;
        }
        let mut x = 0x1234_5678_9abc_def0u64;
        let bytes: Vec<u8> = (0..64 * 36 * 3)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        for format in PackFormat::ALL {
            let cols = 192;
            let row = format.row_bytes(cols) as usize;
            let m = PackedMatrix::from_raw(3, cols, format, bytes[..3 * row].to_vec()).unwrap();
            let fast = m.dequantize();
            let mut slow = vec![0.0f32; 3 * cols];
            for (r, o) in slow.chunks_exact_mut(cols).enumerate() {
                let b = &bytes[r * row..(r + 1) * row];
                match format {
                    PackFormat::Nf4 { double_quant: true } => nf4::decode_dq_row_portable(b, 3, 0..3, o),
                    _ => decode::portable(format, b, o),
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&slow), "{format}");
        }
    }
}
