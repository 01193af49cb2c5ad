//! QLoRA's NormalFloat-4 (Dettmers et al. 2023): blocks of 64 values, each
//! stored as a 4-bit index into [`CODE`] and multiplied by the block's
//! absmax (`x ≈ CODE[q] · absmax`, bitsandbytes' `dDequantizeNF4`).
//!
//! # Layout
//!
//! A block is its absmax (f32, little-endian) then 32 bytes of codes; as in
//! ggml's 4-bit blocks, byte `j` holds value `j` in its low nibble and value
//! `j + 32` in its high nibble (bitsandbytes packs neighbouring pairs
//! instead; the values are the same, only the byte order differs). 36 bytes
//! per 64 values: 4.5 bits per value.
//!
//! # Double quantisation
//!
//! QLoRA §3 quantises the f32 absmax values again, to 8 bits in blocks of
//! 256 after subtracting their mean (bitsandbytes' dynamic 8-bit map, one
//! mean per tensor). Here each row is self-contained, so that rows can be
//! stacked, reordered and used alone: a row's blocks are cut into groups of
//! up to 256, and each group stores its mean `μ` and a symmetric int8 scale
//! `s = max |absmax − μ| / 127` (two f32) at the start of the row; a block
//! stores `q = round((absmax − μ) / s)` as one `i8` followed by its 32 bytes
//! of codes (33 bytes). The absmax used is `μ + s·q` (an f32 multiply, then
//! an add), within `s/2` (plus an f32 rounding) of the true one; the codes
//! themselves are chosen against the true absmax, as bitsandbytes does.
//! Bytes per row: `8·⌈blocks/256⌉ + 33·blocks`, i.e. `4 + 1/8 + 1/(2·cols)`
//! bits per value (the paper's `4 + 8/64 + 32/(64·256) = 4.127` at
//! `cols ≥ 16384`; 4.236 bits for a 576-wide row, vs 4.5 without).

use std::ops::Range;

/// Values per block.
pub const BLOCK: usize = 64;
/// Bytes of a block: f32 absmax and 32 bytes of codes.
pub const BLOCK_BYTES: usize = 4 + BLOCK / 2;
/// Bytes of a double-quantised block: i8 absmax and 32 bytes of codes.
pub const DQ_BLOCK_BYTES: usize = 1 + BLOCK / 2;
/// Blocks per group of double-quantised absmax values.
pub const DQ_GROUP: usize = 256;

/// The NF4 code book, bitsandbytes' table (QLoRA Appendix E), ascending.
#[allow(clippy::excessive_precision)]
pub const CODE: [f32; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// bitsandbytes' `dQuantizeNF4` decision thresholds (midpoints of adjacent
/// codes as it writes them, rounded to f32): a normalised value `x` gets
/// code `i` where `i` thresholds are `< x` (a value exactly on a midpoint
/// takes the lower code).
#[allow(clippy::excessive_precision)]
pub const THRESHOLDS: [f32; 15] = [
    -0.8480964004993439,
    -0.6106329262256622,
    -0.4599952697753906,
    -0.33967943489551544,
    -0.23460740596055984,
    -0.13791173323988914,
    -0.045525018125772476,
    0.03979014977812767,
    0.1202552504837513,
    0.2035212516784668,
    0.2920137718319893,
    0.3893125355243683,
    0.5016634166240692,
    0.6427869200706482,
    0.8614784181118011,
];

/// Header bytes of a double-quantised row of `blocks` blocks.
pub(crate) fn dq_header_bytes(blocks: u128) -> u128 {
    blocks.div_ceil(DQ_GROUP as u128) * 8
}

/// The code of a normalised value (`x·(1/absmax)`).
#[inline]
pub fn code_of(x: f32) -> u8 {
    THRESHOLDS.iter().map(|&t| u8::from(x > t)).sum()
}

/// Quantises one block of 64 finite values into 32 bytes of codes; returns
/// its absmax.
fn quantize_block(x: &[f32], codes: &mut [u8]) -> f32 {
    let absmax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    // bitsandbytes multiplies by the reciprocal; an all-zero block gets the
    // code of 0.
    let r = if absmax > 0.0 { 1.0 / absmax } else { 0.0 };
    for j in 0..BLOCK / 2 {
        codes[j] = code_of(x[j] * r) | code_of(x[j + BLOCK / 2] * r) << 4;
    }
    absmax
}

/// Quantises one row (values finite, a whole number of blocks) into `row`.
pub(crate) fn encode_row(values: &[f32], row: &mut [u8], double_quant: bool) {
    if !double_quant {
        for (b, x) in row.chunks_exact_mut(BLOCK_BYTES).zip(values.chunks_exact(BLOCK)) {
            let absmax = quantize_block(x, &mut b[4..]);
            b[..4].copy_from_slice(&absmax.to_le_bytes());
        }
        return;
    }
    let blocks = values.len() / BLOCK;
    let (header, body) = row.split_at_mut(dq_header_bytes(blocks as u128) as usize);
    let absmax: Vec<f32> = body
        .chunks_exact_mut(DQ_BLOCK_BYTES)
        .zip(values.chunks_exact(BLOCK))
        .map(|(b, x)| quantize_block(x, &mut b[1..]))
        .collect();
    for ((h, a), b) in
        header.chunks_exact_mut(8).zip(absmax.chunks(DQ_GROUP)).zip(body.chunks_mut(DQ_GROUP * DQ_BLOCK_BYTES))
    {
        let mean = (a.iter().map(|&v| f64::from(v)).sum::<f64>() / a.len() as f64) as f32;
        let scale = a.iter().fold(0.0f32, |m, &v| m.max((v - mean).abs())) / 127.0;
        h[..4].copy_from_slice(&mean.to_le_bytes());
        h[4..].copy_from_slice(&scale.to_le_bytes());
        for (&v, blk) in a.iter().zip(b.chunks_exact_mut(DQ_BLOCK_BYTES)) {
            let q = if scale > 0.0 { ((v - mean) / scale).round().clamp(-127.0, 127.0) as i8 } else { 0 };
            blk[0] = q as u8;
        }
    }
}

/// The 16 codes times `absmax` (each product rounded once, as `CODE[q] ·
/// absmax` is).
#[inline(always)]
fn scaled(absmax: f32) -> [f32; 16] {
    CODE.map(|c| c * absmax)
}

/// Decodes 32 bytes of codes at `absmax` into 64 values.
#[inline(always)]
fn decode_codes(codes: &[u8], absmax: f32, out: &mut [f32]) {
    let t = scaled(absmax);
    let (lo, hi) = out.split_at_mut(BLOCK / 2);
    for (j, &q) in codes.iter().enumerate() {
        lo[j] = t[usize::from(q & 0x0F)];
        hi[j] = t[usize::from(q >> 4)];
    }
}

/// Decodes whole blocks (no double quantisation).
pub(crate) fn decode_blocks(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(BLOCK).zip(bytes.chunks_exact(BLOCK_BYTES)) {
        decode_codes(&b[4..], f32::from_le_bytes([b[0], b[1], b[2], b[3]]), o);
    }
}

/// The absmax of block `b` of a double-quantised row of `row_blocks`
/// blocks: `mean + scale·q`.
pub fn dq_absmax(row: &[u8], row_blocks: usize, b: usize) -> f32 {
    let h = &row[b / DQ_GROUP * 8..];
    let mean = f32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let scale = f32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let q = row[dq_header_bytes(row_blocks as u128) as usize + b * DQ_BLOCK_BYTES] as i8;
    mean + scale * f32::from(q)
}

/// Decodes blocks `blocks` of a double-quantised row of `row_blocks` blocks.
pub(crate) fn decode_dq_row(row: &[u8], row_blocks: usize, blocks: Range<usize>, out: &mut [f32]) {
    let start = dq_header_bytes(row_blocks as u128) as usize;
    for (b, o) in blocks.zip(out.chunks_exact_mut(BLOCK)) {
        let at = start + b * DQ_BLOCK_BYTES;
        decode_codes(&row[at + 1..at + DQ_BLOCK_BYTES], dq_absmax(row, row_blocks, b), o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thresholds are the midpoints of adjacent codes (to f32 precision
    /// of the literals bitsandbytes writes), so `code_of` is the nearest code.
    #[test]
    fn thresholds_are_midpoints() {
        for (i, &t) in THRESHOLDS.iter().enumerate() {
            let mid = (f64::from(CODE[i]) + f64::from(CODE[i + 1])) / 2.0;
            assert!((f64::from(t) - mid).abs() < 1e-6, "{i}: {t} vs {mid}");
            assert_eq!(code_of(CODE[i]), i as u8);
        }
        assert_eq!(code_of(1.0), 15);
        assert_eq!(code_of(-1.0), 0);
        assert_eq!(code_of(THRESHOLDS[7]), 7, "a value on a midpoint takes the lower code");
    }
}
