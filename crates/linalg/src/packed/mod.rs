//! Frozen matrices kept in a packed format (bf16, f16, ggml's Q8_0 / Q4_0 /
//! Q4_1 blocks, QLoRA's NF4) and the two GEMMs a frozen weight takes part in,
//! which dequantise it one panel at a time (`gemm`).
//!
//! # Storage
//!
//! A [`PackedMatrix`] is `rows × cols`, row-major: each row is
//! [`PackFormat::row_bytes`] bytes and the rows lie back to back, so a row
//! (or a range of rows) is a plain byte range and stacking or reordering rows
//! copies bytes. Within a row, `cols / block` blocks follow each other:
//! - `Bf16` / `F16`: one little-endian `u16` per value (block 1).
//! - `Q8_0`, `Q4_0`, `Q4_1`: ggml's blocks of 32 values, byte for byte as in a
//!   GGUF file (see [`decode`]).
//! - `Nf4`: blocks of 64 values, each an f32 absmax (little-endian) and 32
//!   bytes of 4-bit codes; with double quantisation the absmax of each block
//!   is one `i8` and the row starts with one `(mean, scale)` f32 pair per
//!   group of up to 256 blocks (see [`nf4`]).
//!
//! # Numerics
//!
//! Every decoder is the reference's arithmetic to the bit (ggml's for the
//! GGUF types, bitsandbytes' `code · absmax` for NF4), and the same function
//! serves `gguf::quant::dequantize`, [`PackedMatrix::dequantize`] and the
//! GEMMs' panels, so a packed frozen weight multiplies exactly the values a
//! full f32 dequantisation would hold.

pub mod decode;
mod gemm;
pub mod nf4;
#[cfg(target_arch = "x86_64")]
mod simd;

pub use decode::decode_blocks;
pub use gemm::{gemm_dy_w, gemm_x_wt};

use rayon::prelude::*;
use std::ops::Range;

/// How a frozen matrix's values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackFormat {
    /// bfloat16 (rounded to nearest even).
    Bf16,
    /// IEEE half precision (rounded to nearest even).
    F16,
    /// ggml's Q8_0: blocks of 32 `i8` with an f16 scale.
    Q8_0,
    /// ggml's Q4_0: blocks of 32 4-bit values with an f16 scale, offset 8.
    Q4_0,
    /// ggml's Q4_1: blocks of 32 4-bit values with an f16 scale and minimum.
    Q4_1,
    /// QLoRA's NormalFloat-4: blocks of 64 codes of the NF4 table times the
    /// block's absmax; `double_quant` stores the absmax values in 8 bits.
    Nf4 {
        /// Quantise the per-block absmax values to `i8` (QLoRA §3).
        double_quant: bool,
    },
}

impl PackFormat {
    /// Every format, for tests and reports.
    pub const ALL: [PackFormat; 7] = [
        PackFormat::Bf16,
        PackFormat::F16,
        PackFormat::Q8_0,
        PackFormat::Q4_0,
        PackFormat::Q4_1,
        PackFormat::Nf4 { double_quant: false },
        PackFormat::Nf4 { double_quant: true },
    ];

    /// Values per block along a row (1 for Bf16/F16, 32 for ggml types, 64
    /// for NF4).
    pub fn block(self) -> usize {
        match self {
            PackFormat::Bf16 | PackFormat::F16 => 1,
            PackFormat::Q8_0 | PackFormat::Q4_0 | PackFormat::Q4_1 => 32,
            PackFormat::Nf4 { .. } => nf4::BLOCK,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            PackFormat::Bf16 | PackFormat::F16 => 2,
            PackFormat::Q8_0 => 34,
            PackFormat::Q4_0 => 18,
            PackFormat::Q4_1 => 20,
            PackFormat::Nf4 { double_quant: false } => nf4::BLOCK_BYTES,
            PackFormat::Nf4 { double_quant: true } => nf4::DQ_BLOCK_BYTES,
        }
    }

    /// A short name ("bf16", "f16", "q8_0", "q4_0", "q4_1", "nf4", "nf4-dq").
    pub fn name(self) -> &'static str {
        match self {
            PackFormat::Bf16 => "bf16",
            PackFormat::F16 => "f16",
            PackFormat::Q8_0 => "q8_0",
            PackFormat::Q4_0 => "q4_0",
            PackFormat::Q4_1 => "q4_1",
            PackFormat::Nf4 { double_quant: false } => "nf4",
            PackFormat::Nf4 { double_quant: true } => "nf4-dq",
        }
    }

    /// The format named `name` (as [`PackFormat::name`] writes it).
    pub fn from_name(name: &str) -> Option<PackFormat> {
        PackFormat::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Bytes of one row of `cols` values (`cols` rounded up to whole blocks).
    pub fn row_bytes(self, cols: usize) -> u128 {
        let blocks = (cols as u128).div_ceil(self.block() as u128);
        let header = match self {
            PackFormat::Nf4 { double_quant: true } => nf4::dq_header_bytes(blocks),
            _ => 0,
        };
        header + blocks * self.block_bytes() as u128
    }

    /// Exact bytes a `rows × cols` matrix takes in this format (what memory
    /// plans count); `cols` is rounded up to whole blocks.
    pub fn bytes_for(self, rows: usize, cols: usize) -> u128 {
        rows as u128 * self.row_bytes(cols)
    }

    /// Stored bits per value of a `cols`-wide row (for reports).
    pub fn bits_per_value(self, cols: usize) -> f64 {
        self.row_bytes(cols) as f64 * 8.0 / cols.max(1) as f64
    }
}

impl std::fmt::Display for PackFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a packed matrix could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// The values or bytes given are not the matrix's size.
    #[error("{what}: expected {expected}, got {got}")]
    LengthMismatch {
        /// What was counted ("values", "bytes of q4_1", ...).
        what: String,
        /// The size the shape needs.
        expected: u128,
        /// The size given.
        got: usize,
    },
    /// A row is not a whole number of the format's blocks.
    #[error("{format}: {cols} columns are not a multiple of the block of {block}")]
    NotBlockMultiple {
        /// The format.
        format: PackFormat,
        /// Columns of the matrix.
        cols: usize,
        /// Values per block.
        block: usize,
    },
    /// The format cannot do what was asked.
    #[error("{format}: {what} is not supported")]
    Unsupported {
        /// The format.
        format: PackFormat,
        /// What was asked.
        what: &'static str,
    },
    /// A value a block quantiser cannot represent (NaN or ±∞).
    #[error("{format}: value {index} is {value}, which a block quantiser cannot represent")]
    NonFinite {
        /// The format.
        format: PackFormat,
        /// Index of the value (row-major).
        index: usize,
        /// The value.
        value: f32,
    },
    /// Matrices to stack differ in format or columns.
    #[error("cannot stack a {got_format} matrix of {got_cols} columns onto {format} of {cols}")]
    Mismatch {
        /// The first part's format.
        format: PackFormat,
        /// The first part's columns.
        cols: usize,
        /// The offending part's format.
        got_format: PackFormat,
        /// The offending part's columns.
        got_cols: usize,
    },
    /// Nothing to stack.
    #[error("no matrices to stack")]
    Empty,
    /// A row order that is not a permutation of the rows.
    #[error("row order is not a permutation of {rows} rows: {why}")]
    NotAPermutation {
        /// Rows of the matrix.
        rows: usize,
        /// What is wrong.
        why: String,
    },
    /// The shape's size does not fit in memory.
    #[error("a {rows} × {cols} matrix is too large")]
    TooLarge {
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
    },
}

/// A `rows × cols` row-major matrix in a packed format (each row's blocks
/// contiguous, rows back to back).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    format: PackFormat,
    row_bytes: usize,
    data: Vec<u8>,
}

impl PackedMatrix {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The storage format.
    pub fn format(&self) -> PackFormat {
        self.format
    }

    /// The stored bytes (row-major, [`PackFormat::row_bytes`] per row).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Checks the shape against the format and returns the bytes of a row.
    fn row_bytes_of(rows: usize, cols: usize, format: PackFormat) -> Result<usize, PackError> {
        if !cols.is_multiple_of(format.block()) {
            return Err(PackError::NotBlockMultiple { format, cols, block: format.block() });
        }
        let row_bytes = usize::try_from(format.row_bytes(cols)).map_err(|_| PackError::TooLarge { rows, cols })?;
        row_bytes.checked_mul(rows).ok_or(PackError::TooLarge { rows, cols })?;
        rows.checked_mul(cols).ok_or(PackError::TooLarge { rows, cols })?;
        Ok(row_bytes)
    }

    /// Quantises / rounds f32 values: Bf16/F16 round to nearest even; Nf4 is
    /// QLoRA's quantiser (absmax per block of 64, nearest code of the NF4
    /// table); Q8_0/Q4_0/Q4_1 are ggml's reference quantisers
    /// (`quantize_row_q8_0_ref` etc.). The block formats refuse NaN and ±∞.
    /// Rows are quantised in parallel on the rayon pool.
    pub fn quantize(rows: usize, cols: usize, values: &[f32], format: PackFormat) -> Result<Self, PackError> {
        let row_bytes = Self::row_bytes_of(rows, cols, format)?;
        if values.len() as u128 != rows as u128 * cols as u128 {
            return Err(PackError::LengthMismatch {
                what: "values".into(),
                expected: rows as u128 * cols as u128,
                got: values.len(),
            });
        }
        if format.block() > 1 {
            if let Some(index) = values.iter().position(|v| !v.is_finite()) {
                return Err(PackError::NonFinite { format, index, value: values[index] });
            }
        }
        let mut data = vec![0u8; row_bytes * rows];
        if cols > 0 {
            // Rows are independent: the bytes do not depend on the threads.
            data.par_chunks_exact_mut(row_bytes)
                .zip(values.par_chunks_exact(cols))
                .for_each(|(row, v)| decode::encode_row(format, v, row));
        }
        Ok(PackedMatrix { rows, cols, format, row_bytes, data })
    }

    /// A GGUF tensor's raw bytes kept as they are (F16/BF16/Q8_0/Q4_0/Q4_1;
    /// NF4 in this module's layout), length checked.
    pub fn from_raw(rows: usize, cols: usize, format: PackFormat, bytes: Vec<u8>) -> Result<Self, PackError> {
        let row_bytes = Self::row_bytes_of(rows, cols, format)?;
        if bytes.len() as u128 != format.bytes_for(rows, cols) {
            return Err(PackError::LengthMismatch {
                what: format!("bytes of {format}"),
                expected: format.bytes_for(rows, cols),
                got: bytes.len(),
            });
        }
        Ok(PackedMatrix { rows, cols, format, row_bytes, data: bytes })
    }

    /// Rows stacked (q|k|v, gate|up): same format and cols, else an error.
    pub fn concat_rows(parts: Vec<PackedMatrix>) -> Result<Self, PackError> {
        let first = parts.first().ok_or(PackError::Empty)?;
        let (format, cols, row_bytes) = (first.format, first.cols, first.row_bytes);
        if let Some(p) = parts.iter().find(|p| p.format != format || p.cols != cols) {
            return Err(PackError::Mismatch { format, cols, got_format: p.format, got_cols: p.cols });
        }
        let rows = parts.iter().try_fold(0usize, |acc, p| acc.checked_add(p.rows));
        let rows = rows.ok_or(PackError::TooLarge { rows: usize::MAX, cols })?;
        Self::row_bytes_of(rows, cols, format)?;
        let mut data = Vec::with_capacity(rows * row_bytes);
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        Ok(PackedMatrix { rows, cols, format, row_bytes, data })
    }

    /// The rows in the given order: row `i` of the result is row `order[i]`
    /// (llama.cpp's Q/K row permutation is undone on whole rows). `order`
    /// must be a permutation of `0..rows`.
    pub fn permute_rows(&self, order: &[usize]) -> Result<Self, PackError> {
        let bad = |why: String| PackError::NotAPermutation { rows: self.rows, why };
        if order.len() != self.rows {
            return Err(bad(format!("{} indices given", order.len())));
        }
        let mut seen = vec![false; self.rows];
        for &r in order {
            match seen.get_mut(r) {
                None => return Err(bad(format!("index {r} out of range"))),
                Some(true) => return Err(bad(format!("index {r} repeated"))),
                Some(s) => *s = true,
            }
        }
        let mut data = Vec::with_capacity(self.data.len());
        for &r in order {
            data.extend_from_slice(self.row(r));
        }
        Ok(PackedMatrix { data, ..*self })
    }

    /// Bytes held (what memory accounting counts).
    pub fn stored_bytes(&self) -> usize {
        self.data.len()
    }

    /// The bytes of row `r`.
    fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Dequantises rows `rows` into `out` (`rows.len() * cols` values).
    ///
    /// # Panics
    /// If the rows are out of range or `out` is not their size.
    pub fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        self.dequantize_block(rows, 0..self.cols, out);
    }

    /// Dequantises columns `cols` (a multiple of the block at both ends) of
    /// rows `rows` into `out` (row stride `cols.len()`).
    ///
    /// # Panics
    /// If a range is out of bounds or not block-aligned, or `out` is not
    /// `rows.len() * cols.len()` values.
    pub fn dequantize_block(&self, rows: Range<usize>, cols: Range<usize>, out: &mut [f32]) {
        let block = self.format.block();
        assert!(rows.start <= rows.end && rows.end <= self.rows, "rows {rows:?} out of 0..{}", self.rows);
        assert!(cols.start <= cols.end && cols.end <= self.cols, "columns {cols:?} out of 0..{}", self.cols);
        assert!(
            cols.start.is_multiple_of(block) && cols.end.is_multiple_of(block),
            "columns {cols:?} are not aligned to the block of {block}"
        );
        let width = cols.len();
        assert_eq!(out.len(), rows.len() * width, "output of {} values for {rows:?} × {cols:?}", out.len());
        if width == 0 {
            return;
        }
        for (r, o) in rows.zip(out.chunks_exact_mut(width)) {
            decode::decode_row(self.format, self.row(r), self.cols / block, cols.start / block..cols.end / block, o);
        }
    }

    /// The whole matrix in f32 (exports, tests).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        self.dequantize_rows(0..self.rows, &mut out);
        out
    }
}
