//! A saved activation tensor: what a model's forward keeps for its backward,
//! in f32 (read in place) or in 16 bits (decoded on demand), shared by every
//! model family so the storage scheme is written once.

use crate::precision::Precision;

/// One saved activation tensor: f32 (read in place by backward) or 16
/// bits (decoded on demand).
#[derive(Debug)]
pub enum SavedTensor {
    /// Kept in f32 (read in place).
    F32(Vec<f32>),
    /// Kept as 16-bit codes of the storage precision.
    Low(Vec<u16>),
    /// Not kept (selective recomputation): the forward still rounds it to
    /// the storage precision, as if kept, and backward recomputes it.
    Dropped,
}

impl Default for SavedTensor {
    fn default() -> Self {
        SavedTensor::F32(Vec::new())
    }
}

impl SavedTensor {
    /// `n` values in `precision`'s storage.
    pub fn new(precision: Precision, n: usize) -> Self {
        if precision.is_low() {
            SavedTensor::Low(vec![0; n])
        } else {
            SavedTensor::F32(vec![0.0; n])
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            SavedTensor::F32(v) => 4 * v.len(),
            SavedTensor::Low(v) => 2 * v.len(),
            SavedTensor::Dropped => 0,
        }
    }

    /// Whether the tensor is dropped, to be recomputed.
    pub fn is_dropped(&self) -> bool {
        matches!(self, SavedTensor::Dropped)
    }

    /// Saves `v` — rounded first to the storage precision, in place, so the
    /// rest of the forward pass reads exactly what backward will — by copy.
    pub fn keep_copy(&mut self, v: &mut [f32], precision: Precision) {
        precision.round(v);
        match self {
            SavedTensor::F32(dst) => dst.copy_from_slice(v),
            SavedTensor::Low(dst) => precision.encode(v, dst),
            SavedTensor::Dropped => {}
        }
    }

    /// Saves the working buffer `v`: in f32 by swapping it in (no copy; `v`
    /// gets the old buffer of the same length back, to be overwritten), in
    /// 16 bits by rounding and encoding it. Read the tensor afterwards with
    /// [`SavedTensor::cur`].
    pub fn keep(&mut self, v: &mut Vec<f32>, precision: Precision) {
        match self {
            SavedTensor::F32(dst) => std::mem::swap(dst, v),
            SavedTensor::Low(dst) => {
                precision.round(v);
                precision.encode(v, dst);
            }
            SavedTensor::Dropped => precision.round(v),
        }
    }

    /// [`SavedTensor::keep`] of `v`'s first `n` values (a working buffer
    /// sized for a larger tensor: copied when it is longer than `n`).
    pub fn keep_prefix(&mut self, v: &mut Vec<f32>, n: usize, precision: Precision) {
        if v.len() == n {
            self.keep(v, precision);
        } else {
            self.keep_copy(&mut v[..n], precision);
        }
    }

    /// The tensor just kept from `v`, as the rest of the forward reads it.
    pub fn cur<'a>(&'a self, v: &'a [f32]) -> &'a [f32] {
        match self {
            SavedTensor::F32(t) => t,
            SavedTensor::Low(_) | SavedTensor::Dropped => v,
        }
    }

    /// The tensor as f32: itself, or decoded into `tmp` (a dropped tensor
    /// reads as empty: its reader recomputes it).
    pub fn read<'a>(&'a self, precision: Precision, tmp: &'a mut [f32]) -> &'a [f32] {
        match self {
            SavedTensor::F32(v) => v,
            SavedTensor::Low(v) => {
                precision.decode(v, &mut tmp[..v.len()]);
                &tmp[..v.len()]
            }
            SavedTensor::Dropped => &[],
        }
    }
}
