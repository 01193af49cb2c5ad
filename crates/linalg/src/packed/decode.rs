//! The block decoders (one per format, shared with `gguf`) and the
//! quantisers.
//!
//! ggml's block layouts (little-endian, 32 values per block):
//! - `Q8_0`: f16 scale `d`, then 32 × i8 `q`;            x = d·q
//! - `Q4_0`: f16 scale `d`, then 16 bytes of nibbles;    x = d·(q − 8)
//! - `Q4_1`: f16 scale `d`, f16 minimum `m`, 16 bytes;   x = d·q + m
//!
//! In the 4-bit types byte `j` holds value `j` in its low nibble and value
//! `j + 16` in its high nibble: the low nibbles are the first 16 values of the
//! block, the high nibbles the last 16 (not interleaved pairs).
//!
//! The arithmetic is the reference's to the bit: the f16 fields are widened
//! to f32 first (exactly) and `d·q` is an exact f32 product (an 11-bit
//! mantissa times an integer of at most 8 bits), so only `+ m` rounds, once.
//! The loops are compiled for AVX-512 and AVX2 as well (`multiversion`,
//! picked at run time); they are the same IEEE operations in the same order
//! on every path (Rust never fuses a multiply and an add), so the bits do not
//! depend on the CPU.

use super::{nf4, PackError, PackFormat};
use multiversion::multiversion;
use std::ops::Range;

/// f16 bits to f32, exactly (NaN stays NaN with its quiet bit set, as
/// F16C's `vcvtph2ps` and `half` do). Branch-free, so that loops over it
/// vectorise.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    // Normal and subnormal halves: the bits shifted into an f32 are the value
    // times 2⁻¹¹², undone by an exact multiplication by 2¹¹².
    let finite = (f32::from_bits(em << 13) * f32::from_bits(0x7780_0000)).to_bits();
    let man = (em & 0x3ff) << 13;
    let special = 0x7f80_0000 | man | if man != 0 { 0x0040_0000 } else { 0 };
    f32::from_bits(sign | if em >= 0x7c00 { special } else { finite })
}

/// bf16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 to bf16 bits, rounded to nearest even (NaN stays NaN, quiet).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x0040) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// f32 to f16 bits, rounded to nearest even.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Decodes `bytes` (whole blocks of `format`) into `out`, which must hold
/// exactly the values they encode. The one decoder of each format: `gguf`
/// dequantises its tensors with it. Double-quantised NF4 needs its row's
/// header and is refused here (see [`super::PackedMatrix::dequantize_rows`]).
pub fn decode_blocks(format: PackFormat, bytes: &[u8], out: &mut [f32]) -> Result<(), PackError> {
    if format == (PackFormat::Nf4 { double_quant: true }) {
        return Err(PackError::Unsupported { format, what: "decoding blocks without their row" });
    }
    let blocks = bytes.len() / format.block_bytes();
    if blocks * format.block_bytes() != bytes.len() || blocks * format.block() != out.len() {
        return Err(PackError::LengthMismatch {
            what: format!("values in {} bytes of {format}", bytes.len()),
            expected: (bytes.len() / format.block_bytes() * format.block()) as u128,
            got: out.len(),
        });
    }
    decode_whole_blocks(format, bytes, out);
    Ok(())
}

/// [`decode_blocks`] on lengths known to match (not double-quantised NF4).
fn decode_whole_blocks(format: PackFormat, bytes: &[u8], out: &mut [f32]) {
    match format {
        PackFormat::Bf16 => decode_bf16(bytes, out),
        PackFormat::F16 => decode_f16(bytes, out),
        PackFormat::Q8_0 => decode_q8_0(bytes, out),
        PackFormat::Q4_0 => decode_q4_0(bytes, out),
        PackFormat::Q4_1 => decode_q4_1(bytes, out),
        PackFormat::Nf4 { double_quant: false } => nf4::decode_blocks(bytes, out),
        PackFormat::Nf4 { double_quant: true } => unreachable!("needs the row header"),
    }
}

/// Decodes blocks `blocks` of one row of `row_blocks` blocks (`row`: the
/// row's bytes) into `out`.
pub(crate) fn decode_row(format: PackFormat, row: &[u8], row_blocks: usize, blocks: Range<usize>, out: &mut [f32]) {
    if let PackFormat::Nf4 { double_quant: true } = format {
        return nf4::decode_dq_row(row, row_blocks, blocks, out);
    }
    let bb = format.block_bytes();
    decode_whole_blocks(format, &row[blocks.start * bb..blocks.end * bb], out);
}

/// Quantises one row of values into its bytes (`row`: zeroed, the row's
/// size; values finite for the block formats).
pub(crate) fn encode_row(format: PackFormat, values: &[f32], row: &mut [u8]) {
    match format {
        PackFormat::Bf16 => {
            for (o, &v) in row.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
            }
        }
        PackFormat::F16 => {
            for (o, &v) in row.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&f32_to_f16(v).to_le_bytes());
            }
        }
        PackFormat::Q8_0 => {
            row.chunks_exact_mut(34).zip(values.chunks_exact(32)).for_each(|(o, v)| quantize_q8_0(v, o))
        }
        PackFormat::Q4_0 => {
            row.chunks_exact_mut(18).zip(values.chunks_exact(32)).for_each(|(o, v)| quantize_q4_0(v, o))
        }
        PackFormat::Q4_1 => {
            row.chunks_exact_mut(20).zip(values.chunks_exact(32)).for_each(|(o, v)| quantize_q4_1(v, o))
        }
        PackFormat::Nf4 { double_quant } => nf4::encode_row(values, row, double_quant),
    }
}

/// ggml's `quantize_row_q8_0_ref` on one block.
fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (o, &v) in out[2..].iter_mut().zip(x) {
        // C's roundf: halves away from zero, as f32::round.
        *o = (v * id).round() as i8 as u8;
    }
}

/// ggml's `quantize_row_q4_0_ref` on one block.
fn quantize_q4_0(x: &[f32], out: &mut [u8]) {
    // The value of largest magnitude, with its sign (the first one on ties).
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    // C's (int8_t) cast truncates towards zero; the argument is in [0.5, 16.5].
    let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    for j in 0..16 {
        out[2 + j] = q(x[j]) | q(x[16 + j]) << 4;
    }
}

/// ggml's `quantize_row_q4_1_ref` on one block.
fn quantize_q4_1(x: &[f32], out: &mut [u8]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        min = if v < min { v } else { min };
        max = if v > max { v } else { max };
    }
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    out[2..4].copy_from_slice(&f32_to_f16(min).to_le_bytes());
    let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
    for j in 0..16 {
        out[4 + j] = q(x[j]) | q(x[16 + j]) << 4;
    }
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn decode_bf16(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn decode_f16(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn decode_q8_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
        let d = f16_at(b, 0);
        for (x, &q) in o.iter_mut().zip(&b[2..34]) {
            *x = d * f32::from(q as i8);
        }
    }
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn decode_q4_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
        let d = f16_at(b, 0);
        let (lo, hi) = o.split_at_mut(16);
        for (j, &q) in b[2..18].iter().enumerate() {
            lo[j] = d * f32::from((q & 0x0F) as i8 - 8);
            hi[j] = d * f32::from((q >> 4) as i8 - 8);
        }
    }
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn decode_q4_1(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        let (lo, hi) = o.split_at_mut(16);
        for (j, &q) in b[4..20].iter().enumerate() {
            lo[j] = d * f32::from(q & 0x0F) + m;
            hi[j] = d * f32::from(q >> 4) + m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 bit pattern widens as `half` widens it (NaN: both NaN).
    #[test]
    fn f16_matches_half_on_every_pattern() {
        for h in 0..=u16::MAX {
            let (ours, theirs) = (f16_to_f32(h), half::f16::from_bits(h).to_f32());
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}: {ours}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}: {ours} vs {theirs}");
            }
        }
    }

    /// bf16 rounding as `half` rounds (nearest even), on values around every
    /// rounding case.
    #[test]
    fn bf16_rounds_as_half() {
        let mut s = 1u32;
        for _ in 0..100_000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            // Finite upper halves (largest exponent 0xfe), both signs.
            let base = s & 0xff7f_0000;
            for low in [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let v = f32::from_bits(base | low);
                assert_eq!(f32_to_bf16(v), half::bf16::from_f32(v).to_bits(), "{:#010x}", base | low);
            }
        }
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }
}
