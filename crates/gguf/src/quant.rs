//! ggml tensor types and dequantisation to f32.
//!
//! The block decoders of F16, BF16, Q8_0, Q4_0 and Q4_1 are `linalg`'s
//! ([`linalg::packed::decode_blocks`], where the block layouts are
//! described): one decoder per format, shared with the packed frozen
//! weights, so a GGUF tensor kept in its own blocks multiplies exactly the
//! values [`dequantize`] gives. They are the reference's arithmetic to the
//! bit (the f16 fields widened to f32 exactly, `d·q` an exact product, only
//! Q4_1's `+ m` rounding, once).

use crate::error::GgufError;
use linalg::packed::{decode_blocks, PackFormat};

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
        self.id == Self::F32 || self.pack_format().is_some()
    }

    /// The packed format that holds this type's blocks byte for byte (F16,
    /// BF16, Q8_0, Q4_0, Q4_1), for keeping a frozen tensor as stored.
    pub fn pack_format(self) -> Option<PackFormat> {
        match self.id {
            Self::F16 => Some(PackFormat::F16),
            Self::BF16 => Some(PackFormat::Bf16),
            Self::Q8_0 => Some(PackFormat::Q8_0),
            Self::Q4_0 => Some(PackFormat::Q4_0),
            Self::Q4_1 => Some(PackFormat::Q4_1),
            _ => None,
        }
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
    match ty.pack_format() {
        None => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Some(format) => {
            if let Err(e) = decode_blocks(format, bytes, out) {
                // The lengths were checked above, and these formats' blocks
                // decode without their row.
                unreachable!("dequantize({tensor}): {e}");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deq(id: u32, bytes: &[u8]) -> Vec<f32> {
        let ty = GgmlType::from_id(id).unwrap();
        let mut out = vec![f32::NAN; bytes.len() / ty.type_size * ty.block_size];
        dequantize("t", ty, bytes, &mut out).unwrap();
        out
    }

    /// F32 is read here; the other types go through `linalg`'s decoders
    /// (tested there block by block; all of SmolLM2 in `tests/`).
    #[test]
    fn plain_types() {
        let f32s: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(deq(GgmlType::F32, &f32s), vec![1.5, -2.0]);
        // f16 0x3C00 = 1, 0xC000 = −2, 0x7BFF = 65504; bf16 0x3FC0 = 1.5, 0xC2F7 = −123.5
        assert_eq!(deq(GgmlType::F16, &[0x00, 0x3C, 0x00, 0xC0, 0xFF, 0x7B]), vec![1.0, -2.0, 65504.0]);
        assert_eq!(deq(GgmlType::BF16, &[0xC0, 0x3F, 0xF7, 0xC2]), vec![1.5, -123.5]);
        // Q4_1: d = 2, m = 0.5, byte j = (3 << 4) | j.
        let q4_1: Vec<u8> = [0x00, 0x40, 0x00, 0x38].into_iter().chain((0..16u8).map(|j| (3 << 4) | j)).collect();
        let x = deq(GgmlType::Q4_1, &q4_1);
        assert_eq!(&x[..3], &[0.5, 2.5, 4.5]);
        assert!(x[16..].iter().all(|&v| v == 6.5));
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
