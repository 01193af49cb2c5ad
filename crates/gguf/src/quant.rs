//! ggml tensor types and dequantisation to f32.
//!
//! Block layouts (little-endian, 32 values per block):
//! - `Q8_0`: f16 scale `d`, then 32 × i8 `q`;            x = d·q
//! - `Q4_0`: f16 scale `d`, then 16 bytes of nibbles;    x = d·(q − 8)
//! - `Q4_1`: f16 scale `d`, f16 minimum `m`, 16 bytes;   x = d·q + m
//!
//! In the 4-bit types byte `j` holds value `j` in its low nibble and value
//! `j + 16` in its high nibble: the low nibbles are the first 16 values of the
//! block, the high nibbles the last 16 (not interleaved pairs).
//!
//! The arithmetic is the reference's to the bit: the f16 fields are widened to
//! f32 first and `d·q` is an exact f32 product (an 11-bit mantissa times an
//! integer of at most 8 bits), so only `+ m` rounds, once.

use crate::error::GgufError;
use half::{bf16, f16};

/// A ggml tensor type: id, name and storage geometry. All types of the format
/// are listed so a file's layout can be checked even where the values cannot
/// be dequantised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    /// The id stored in the file.
    pub id: u32,
    /// ggml's name for it.
    pub name: &'static str,
    /// Values per block (1 for plain types).
    pub block_size: usize,
    /// Bytes per block.
    pub type_size: usize,
}

/// (id, name, values per block, bytes per block) of every type of the format.
const TYPES: &[(u32, &str, usize, usize)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// F32.
    pub const F32: u32 = 0;
    /// F16.
    pub const F16: u32 = 1;
    /// Q4_0.
    pub const Q4_0: u32 = 2;
    /// Q4_1.
    pub const Q4_1: u32 = 3;
    /// Q8_0.
    pub const Q8_0: u32 = 8;
    /// BF16.
    pub const BF16: u32 = 30;

    /// The type of id `id`, if the format defines it.
    pub fn from_id(id: u32) -> Option<Self> {
        TYPES.iter().find(|t| t.0 == id).map(|&(id, name, block_size, type_size)| GgmlType {
            id,
            name,
            block_size,
            type_size,
        })
    }

    /// Whether [`dequantize`] handles it.
    pub fn is_supported(self) -> bool {
        matches!(self.id, Self::F32 | Self::F16 | Self::BF16 | Self::Q8_0 | Self::Q4_0 | Self::Q4_1)
    }

    /// Bytes of `n_elements` values (`None` if not a whole number of blocks,
    /// or on overflow).
    pub fn n_bytes(self, n_elements: u64) -> Option<u64> {
        let block = self.block_size as u64;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(self.type_size as u64)
    }
}

/// The name of type id `id` for messages ("unknown" if the format has none).
pub fn type_name(id: u32) -> &'static str {
    GgmlType::from_id(id).map_or("unknown", |t| t.name)
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises `bytes` (whole blocks of type `ty`) into `out`, which must
/// hold exactly the number of values they encode. `tensor` names the tensor
/// in errors.
pub fn dequantize(tensor: &str, ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), GgufError> {
    if !ty.is_supported() {
        return Err(GgufError::UnsupportedType { tensor: tensor.into(), type_id: ty.id, type_name: ty.name });
    }
    let n_blocks = bytes.len() / ty.type_size;
    assert!(
        bytes.len() == n_blocks * ty.type_size && out.len() == n_blocks * ty.block_size,
        "dequantize({tensor}): {} bytes of {} do not encode {} values",
        bytes.len(),
        ty.name,
        out.len()
    );
    match ty.id {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (x, &q) in o.iter_mut().zip(&b[2..34]) {
                    *x = d * f32::from(q as i8);
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
                let d = f16_at(b, 0);
                let (lo, hi) = o.split_at_mut(16);
                for (j, &q) in b[2..18].iter().enumerate() {
                    lo[j] = d * f32::from((q & 0x0F) as i8 - 8);
                    hi[j] = d * f32::from((q >> 4) as i8 - 8);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let (lo, hi) = o.split_at_mut(16);
                for (j, &q) in b[4..20].iter().enumerate() {
                    lo[j] = d * f32::from(q & 0x0F) + m;
                    hi[j] = d * f32::from(q >> 4) + m;
                }
            }
        }
        _ => unreachable!("is_supported covers every arm"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn deq(id: u32, bytes: &[u8]) -> Vec<f32> {
        let ty = GgmlType::from_id(id).unwrap();
        let mut out = vec![f32::NAN; bytes.len() / ty.type_size * ty.block_size];
        dequantize("t", ty, bytes, &mut out).unwrap();
        out
    }

    /// Q4_0, one block by hand: d = 0.5, byte j = (hi = 15 − j) << 4 | (lo = j),
    /// so value j = 0.5·(j − 8) and value 16 + j = 0.5·(7 − j).
    #[test]
    fn q4_0_low_nibbles_are_the_first_half() {
        let mut b = h(0.5).to_vec();
        b.extend((0..16u8).map(|j| (15 - j) << 4 | j));
        let x = deq(GgmlType::Q4_0, &b);
        assert_eq!(&x[..4], &[-4.0, -3.5, -3.0, -2.5]);
        assert_eq!(x[15], 3.5);
        assert_eq!(&x[16..20], &[3.5, 3.0, 2.5, 2.0]);
        assert_eq!(x[31], -4.0);
    }

    /// Q4_1, two blocks: d = 0.25, m = −1 then d = 2, m = 0.5; byte j = 0x3j's
    /// nibbles (lo j, hi 3).
    #[test]
    fn q4_1_scale_and_minimum() {
        let mut b = Vec::new();
        for (d, m) in [(0.25f32, -1.0f32), (2.0, 0.5)] {
            b.extend(h(d));
            b.extend(h(m));
            b.extend((0..16u8).map(|j| 3 << 4 | j));
        }
        let x = deq(GgmlType::Q4_1, &b);
        assert_eq!(x.len(), 64);
        assert_eq!(&x[..3], &[-1.0, -0.75, -0.5]);
        assert_eq!(x[15], 2.75);
        assert!(x[16..32].iter().all(|&v| v == -0.25), "{:?}", &x[16..32]);
        assert_eq!(&x[32..35], &[0.5, 2.5, 4.5]);
        assert_eq!(x[47], 30.5);
        assert!(x[48..].iter().all(|&v| v == 6.5));
    }

    /// Q8_0: d = 0.125 (exact in f16), q = −128, −1, 0, 1, …, 127.
    #[test]
    fn q8_0_signed_bytes() {
        let mut b = h(0.125).to_vec();
        let q: Vec<i8> = [-128i8, -1, 0, 1, 127].into_iter().chain(5..32).collect();
        b.extend(q.iter().map(|&v| v as u8));
        let x = deq(GgmlType::Q8_0, &b);
        assert_eq!(&x[..5], &[-16.0, -0.125, 0.0, 0.125, 15.875]);
        assert_eq!(x[31], 31.0 * 0.125);
    }

    /// A non-representable f16 scale: the product is taken in f32 after the
    /// scale is widened, as the reference does (0.1 → 0.0999755859375).
    #[test]
    fn f16_scale_is_widened_before_multiplying() {
        let mut b = h(0.1).to_vec();
        b.extend([3u8; 32]);
        let x = deq(GgmlType::Q8_0, &b);
        assert_eq!(f64::from(x[0]), 0.099_975_585_937_5 * 3.0);
    }

    #[test]
    fn plain_types() {
        let f32s: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(deq(GgmlType::F32, &f32s), vec![1.5, -2.0]);
        // f16 0x3C00 = 1, 0xC000 = −2, 0x7BFF = 65504; bf16 0x3FC0 = 1.5, 0xC2F7 = −123.5
        assert_eq!(deq(GgmlType::F16, &[0x00, 0x3C, 0x00, 0xC0, 0xFF, 0x7B]), vec![1.0, -2.0, 65504.0]);
        assert_eq!(deq(GgmlType::BF16, &[0xC0, 0x3F, 0xF7, 0xC2]), vec![1.5, -123.5]);
    }

    #[test]
    fn unsupported_types_are_named() {
        let q4k = GgmlType::from_id(12).unwrap();
        let e = dequantize("blk.0.ffn_up.weight", q4k, &[0; 144], &mut [0.0; 256]).unwrap_err();
        assert!(e.to_string().contains("blk.0.ffn_up.weight") && e.to_string().contains("Q4_K"), "{e}");
        assert_eq!(type_name(99), "unknown");
        assert_eq!(GgmlType::from_id(3).unwrap().n_bytes(64), Some(40));
        assert_eq!(GgmlType::from_id(3).unwrap().n_bytes(33), None);
    }
}
