//! Where Adafactor's statistics live: each tensor's shape and place in the
//! statistics buffer, this rank's runs of it, and walks over a factored
//! tensor's row segments.

use std::ops::Range;

/// One tensor's place in the statistics.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TensorState {
    /// Elements.
    pub(super) n: usize,
    /// Last dimension C (1 for an unfactored tensor).
    pub(super) cols: usize,
    /// Second-to-last dimension R (0: unfactored).
    pub(super) rows: usize,
    /// Its second-moment statistics in `v`: L·R row means then L·C column
    /// means (L = the product of the leading dimensions), or one per element.
    pub(super) stats: Range<usize>,
    /// Its first element's offset among every tensor's elements (where a
    /// checkpoint holds its statistics).
    pub(super) offset: usize,
}

impl TensorState {
    pub(super) fn factored(&self) -> bool {
        self.rows > 0
    }

    /// Rows of all leading indices together (L·R), and L·C columns.
    pub(super) fn all_rows(&self) -> usize {
        self.stats.len() - self.all_cols()
    }

    pub(super) fn all_cols(&self) -> usize {
        if self.factored() {
            self.n / self.rows
        } else {
            0
        }
    }
}

/// One run of this rank's state: a part of one tensor.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct RunState {
    pub(super) state: Range<usize>,
    pub(super) tensor: usize,
    /// Index of its first element in the tensor.
    pub(super) at: usize,
}

/// Second-moment values kept for tensors of these shapes.
pub fn second_moment_len(shapes: &[Vec<usize>]) -> usize {
    shapes.iter().map(|s| stats_len(s)).sum()
}

/// A tensor's last two dimensions (R, C) when its second moment is
/// factored: two or more dimensions, neither of the last two 1. A matrix
/// with a dimension of 1 keeps one statistic per element instead, which is
/// transformers' factored update in exact arithmetic: with R = 1 every row
/// factor is `x / x = 1` and the column statistics are the elements'
/// (the same bits, unless a squared gradient overflows f32); with C = 1 the
/// row statistics are the elements' and the column statistic their running
/// mean, which cancels in `row/mean(row) · col` up to rounding.
pub(super) fn factored_dims(shape: &[usize]) -> Option<(usize, usize)> {
    match shape.len() {
        0 | 1 => None,
        d => (shape[d - 2] > 1 && shape[d - 1] > 1).then(|| (shape[d - 2], shape[d - 1])),
    }
}

/// Statistics kept for a tensor of `shape`: never more than its elements,
/// so a checkpoint holds them inside the tensor's own range.
pub(super) fn stats_len(shape: &[usize]) -> usize {
    let n: usize = shape.iter().product();
    match factored_dims(shape) {
        Some((r, c)) => n / (r * c) * (r + c),
        None => n,
    }
}

/// Calls `f(k, row, cols)` for each row segment of elements `at..at + n`
/// of a factored tensor: `k` the segment's first element from `at`, `row`
/// its row among all leading indices (L·R), `cols` its column statistics'
/// indices (L·C).
#[inline(always)]
pub(super) fn row_segments(ts: &TensorState, at: usize, n: usize, mut f: impl FnMut(usize, usize, Range<usize>)) {
    let (r, c) = (ts.rows, ts.cols);
    let (mut e, end) = (at, at + n);
    while e < end {
        let (row, c0) = (e / c, e % c);
        let c1 = c.min(c0 + (end - e));
        let base = row / r * c;
        f(e - at, row, base + c0..base + c1);
        e += c1 - c0;
    }
}
