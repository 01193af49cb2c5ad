//! f32 values to a tensor's stored bytes: F32, and through `linalg`'s
//! quantisers (the same functions that pack frozen weights) F16, BF16, Q8_0
//! and Q4_0 — ggml's reference row quantisers to the bit:
//! - F16: IEEE half, rounded to nearest even (the `half` crate);
//! - BF16: as ggml's `ggml_compute_fp32_to_bf16`: rounded to nearest even,
//!   NaN kept NaN with its quiet bit set;
//! - Q8_0 (`quantize_row_q8_0_ref`): per block of 32, `d = amax / 127`,
//!   `q = roundf(x / d)` (halves away from zero), `d` stored as f16;
//! - Q4_0 (`quantize_row_q4_0_ref`): `max` the value of largest magnitude
//!   (signed, the first on ties), `d = max / −8`, `q = min(15, (int8)(x / d + 8.5))`,
//!   byte `j` holding element `j` in its low nibble and `j + 16` in its high
//!   one.
//!
//! [`crate::quant::dequantize`] decodes all of them.

use crate::error::GgufError;
use crate::quant::GgmlType;
use linalg::packed::{PackFormat, PackedMatrix};

/// The largest run of blocks quantised as one row: the work is cut into
/// rows of at most this many blocks (a divisor of the block count), which
/// `linalg` quantises in parallel; blocks are independent, so the bytes do
/// not depend on the cut.
const ROW_BLOCKS: usize = 4096;

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The types [`quantize`] writes.
pub const ENCODABLE: [u32; 5] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0];

/// `values` stored as `ty`: the bytes a GGUF tensor of that type holds.
/// Errors when `ty` is not one of [`ENCODABLE`], when the length is not a
/// whole number of `ty`'s blocks, or (block formats) on NaN or ±∞.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>, GgufError> {
    let format = match ty.id {
        GgmlType::F32 => return Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        GgmlType::F16 => PackFormat::F16,
        GgmlType::BF16 => PackFormat::Bf16,
        GgmlType::Q8_0 => PackFormat::Q8_0,
        GgmlType::Q4_0 => PackFormat::Q4_0,
        _ => {
            return Err(GgufError::Encode(format!(
                "writing {} tensors is not supported (F32, F16, BF16, Q8_0, Q4_0 are)",
                ty.name
            )))
        }
    };
    if !values.len().is_multiple_of(ty.block_size) {
        return Err(GgufError::Encode(format!(
            "{} values are not a whole number of {} blocks of {}",
            values.len(),
            ty.name,
            ty.block_size
        )));
    }
    let blocks = values.len() / ty.block_size;
    if blocks == 0 {
        return Ok(Vec::new());
    }
    let cols = gcd(blocks, ROW_BLOCKS) * ty.block_size;
    let packed = PackedMatrix::quantize(values.len() / cols, cols, values, format)
        .map_err(|e| GgufError::Encode(e.to_string()))?;
    Ok(packed.bytes().to_vec())
}

/// The type a tensor is stored in when a file is written as `requested`,
/// by llama.cpp's converter's rule (`convert_hf_to_gguf.py`): one-dimensional
/// tensors, norms, biases (names not ending in `.weight`) and
/// `position_embd.weight` stay F32; a block type whose block does not
/// divide the rows (`ne[0]`) falls back to F16; every other tensor takes
/// `requested`.
pub fn storage_type(requested: GgmlType, name: &str, ne: &[u64]) -> GgmlType {
    let known = |id| GgmlType::from_id(id).expect("F32 and F16 are in the type table");
    let always_f32 = ne.iter().filter(|&&d| d > 1).count() <= 1
        || name.ends_with("_norm.weight")
        || !name.ends_with(".weight")
        || name == "position_embd.weight";
    if always_f32 {
        return known(GgmlType::F32);
    }
    if requested.block_size > 1 && !ne.first().is_some_and(|&d| d.is_multiple_of(requested.block_size as u64)) {
        return known(GgmlType::F16);
    }
    requested
}

/// llama.cpp's `general.file_type` (`LLAMA_FTYPE_*`) of a file written as
/// `ty` ("mostly" that type), if [`quantize`] writes it.
pub fn file_type(ty: GgmlType) -> Option<u32> {
    match ty.id {
        GgmlType::F32 => Some(0),
        GgmlType::F16 => Some(1),
        GgmlType::Q4_0 => Some(2),
        GgmlType::Q8_0 => Some(7),
        GgmlType::BF16 => Some(32),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize;

    fn ty(id: u32) -> GgmlType {
        GgmlType::from_id(id).unwrap()
    }

    /// A deterministic spread of values: several magnitudes and signs,
    /// exact zeros and a zero block.
    fn values(n: usize) -> Vec<f32> {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        (0..n)
            .map(|i| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                if (64..96).contains(&i) || i % 97 == 0 {
                    0.0
                } else {
                    u * [1.0, 1e-3, 40.0][(i / 32) % 3]
                }
            })
            .collect()
    }

    fn round_trip(id: u32, x: &[f32]) -> Vec<f32> {
        let bytes = quantize(ty(id), x).unwrap();
        assert_eq!(bytes.len() as u64, ty(id).n_bytes(x.len() as u64).unwrap());
        let mut out = vec![f32::NAN; x.len()];
        dequantize("t", ty(id), &bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn plain_types_round_trip_within_their_rounding() {
        let x = values(32 * 40);
        assert_eq!(round_trip(GgmlType::F32, &x), x);
        // f16 / bf16 round to nearest: half an ulp, 2⁻¹¹ / 2⁻⁸ relative
        // (f16 values here are normal: |x| ≥ 2⁻¹⁴ or 0… or subnormal with an
        // absolute error of at most 2⁻²⁵).
        for (id, rel) in [(GgmlType::F16, 2f32.powi(-11)), (GgmlType::BF16, 2f32.powi(-8))] {
            for (a, b) in x.iter().zip(round_trip(id, &x)) {
                assert!((a - b).abs() <= a.abs() * rel + 2f32.powi(-25), "{id}: {a} -> {b}");
            }
        }
        let nan = quantize(ty(GgmlType::BF16), &[f32::from_bits(0x7f80_0001)]).unwrap();
        assert_eq!(u16::from_le_bytes([nan[0], nan[1]]), 0x7fc0, "a signalling NaN is kept NaN, quiet");
    }

    /// Q8_0: q = round(x/d) is within 1/2 of x/d, so |x − d·q| ≤ d/2 — plus
    /// the f16 rounding of d itself, δ = max(d·2⁻¹¹, 2⁻²⁵) (half an ulp;
    /// 2⁻²⁵ where d is an f16 subnormal), which moves d·q by at most
    /// |q|·δ ≤ 127·δ. Q4_0: the same half step plus 8·δ, except near −max,
    /// where x/d reaches +8 and the clamp at 15 decodes 7·d: one step, d.
    #[test]
    fn block_types_round_trip_within_half_a_step() {
        let x = values(32 * 60);
        for id in [GgmlType::Q8_0, GgmlType::Q4_0] {
            let bytes = quantize(ty(id), &x).unwrap();
            let y = round_trip(id, &x);
            for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let bb = &bytes[b * ty(id).type_size..];
                let d = linalg::packed::decode::f16_to_f32(u16::from_le_bytes([bb[0], bb[1]])).abs();
                let delta = (d * 2f32.powi(-11)).max(2f32.powi(-25));
                let max = xb.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                for (&a, &c) in xb.iter().zip(yb) {
                    let bound = match id {
                        GgmlType::Q8_0 => d / 2.0 + 127.0 * delta,
                        _ if (a + max).abs() * 8.0 <= max.abs() => d + 8.0 * delta,
                        _ => d / 2.0 + 8.0 * delta,
                    };
                    // 1e-4 relative: the f32 rounding of 1/d and x·(1/d).
                    assert!((a - c).abs() <= bound * 1.0001, "{id} block {b}: {a} -> {c}, d = {d}");
                }
                if xb.iter().all(|&v| v == 0.0) {
                    assert!(yb.iter().all(|&v| v == 0.0));
                }
            }
        }
    }

    #[test]
    fn q4_0_nibble_order_and_scale_sign() {
        // max = −8 (largest magnitude, negative): d = 1, x/d + 8.5 = x + 8.5.
        let mut x = [0.0f32; 32];
        x[0] = -8.0;
        x[16] = 7.0;
        x[1] = 3.0;
        let b = quantize(ty(GgmlType::Q4_0), &x).unwrap();
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), 0x3c00, "d = −8 / −8 = 1");
        assert_eq!(b[2], 15 << 4, "element 0 → 0 (low nibble), element 16 → 15 (high nibble)");
        assert_eq!(b[3], 11 | 8 << 4, "element 1 → 3 + 8, element 17 → 8");
    }

    #[test]
    fn storage_types_follow_llama_cpp() {
        let q8 = ty(GgmlType::Q8_0);
        let id = |name: &str, ne: &[u64]| storage_type(q8, name, ne).id;
        assert_eq!(id("blk.0.attn_q.weight", &[64, 64]), GgmlType::Q8_0);
        assert_eq!(id("blk.0.attn_norm.weight", &[64]), GgmlType::F32);
        assert_eq!(id("blk.0.attn_qkv.bias", &[192]), GgmlType::F32);
        assert_eq!(id("output_norm.weight", &[64, 1]), GgmlType::F32, "a [64, 1] tensor is one-dimensional");
        assert_eq!(id("position_embd.weight", &[64, 1024]), GgmlType::F32);
        assert_eq!(id("blk.0.ffn_down.weight", &[48, 64]), GgmlType::F16, "48 is not a multiple of 32");
        assert_eq!(storage_type(ty(GgmlType::BF16), "blk.0.ffn_down.weight", &[48, 64]).id, GgmlType::BF16);
        assert_eq!(file_type(q8), Some(7));
        assert_eq!(file_type(ty(GgmlType::Q4_1)), None);
    }

    #[test]
    fn bad_lengths_and_types_are_errors() {
        let e = quantize(ty(GgmlType::Q8_0), &[1.0; 33]).unwrap_err().to_string();
        assert!(e.contains("33") && e.contains("Q8_0"), "{e}");
        let e = quantize(ty(GgmlType::Q4_1), &[1.0; 32]).unwrap_err().to_string();
        assert!(e.contains("Q4_1"), "{e}");
        assert!(quantize(ty(GgmlType::Q4_0), &[f32::INFINITY; 32]).is_err());
        assert!(quantize(ty(GgmlType::Q8_0), &[]).unwrap().is_empty());
    }
}
