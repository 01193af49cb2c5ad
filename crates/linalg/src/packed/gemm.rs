//! The GEMMs of a frozen weight: forward `x·Wᵀ` and the input gradient
//! `dy·W`, reading a [`PackedMatrix`] one panel at a time.
//!
//! The output's columns are cut into panels (`gemm_x_wt`: panels of W's
//! rows; `gemm_dy_w`: panels of W's columns, whole blocks), never the summed
//! dimension. Each panel is dequantised into a buffer of the thread that
//! runs it (at most [`PANEL_BYTES`], or [`MIN_PANEL`] output columns, of
//! f32) and multiplied by the f32 GEMM ([`crate::gemm_raw`]). Every panel
//! but a whole small output has at least [`MIN_PANEL`] columns, and more
//! than 256 elements of output (`rows × columns`), and starts on a multiple
//! of 16, as the `split` backend's blocks do: the `gemm` crate then takes
//! the path it takes for the whole product (not its small-matrix or
//! "horizontal" paths, below 64 × 64 and 256 elements, which sum in
//! another order) and blocks the summed dimension exactly as for the whole,
//! so the result is bit-identical to `gemm_into` on the dequantised matrix,
//! whatever the panel count and so the thread count (tested).

use super::PackedMatrix;
use crate::{gemm_raw, last_index, with_buf, GemmDims, GemmOut, Par, Strided};
use rayon::prelude::*;
use std::cell::Cell;
use std::ops::Range;

/// Fewest output columns in a panel (when there are more than this many):
/// as [`crate::backend`]'s `MIN_SPLIT`, above the `gemm` crate's
/// small-matrix path.
pub const MIN_PANEL: usize = 128;

/// Outputs (`rows × columns`) up to which the `gemm` crate takes its
/// "horizontal" path for a row-major `lhs` and a column-major `rhs`.
const SMALL_OUTPUT: usize = 256;

/// Bytes of f32 a panel's buffer aims at (it has at least [`MIN_PANEL`]
/// columns however long the summed dimension).
pub const PANEL_BYTES: usize = 1 << 20;

thread_local! {
    static PANEL: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// `dst[n × out]` (at `o.offset`, row stride `o.rs`) `= (o.accumulate ? dst
/// : 0) + alpha · x[n × in] · Wᵀ`, W = rows `w_rows` of `w` (out =
/// `w_rows.len()`, in = `w.cols()`).
///
/// # Panics
/// If `w_rows` is out of range, or `x` or the destination block is out of
/// bounds, or destination rows overlap (`o.rs < out` with `n > 1`).
#[allow(clippy::too_many_arguments)]
pub fn gemm_x_wt(
    n: usize,
    dst: &mut [f32],
    o: GemmOut,
    x: Strided<'_>,
    w: &PackedMatrix,
    w_rows: Range<usize>,
    alpha: f32,
    par: Par,
) {
    assert!(w_rows.start <= w_rows.end && w_rows.end <= w.rows(), "rows {w_rows:?} of a {}-row matrix", w.rows());
    let k = w.cols();
    let r0 = w_rows.start;
    let job = Job { n, k, len: w_rows.len(), unit: 16, o, lhs: x, alpha, par };
    job.run(dst, |p, buf| {
        w.dequantize_rows(r0 + p.start..r0 + p.end, buf);
        Strided { data: buf, offset: 0, rs: 1, cs: k }
    });
}

/// `dst[n × in] = (o.accumulate ? dst : 0) + alpha · dy[n × out] · W`, W =
/// rows `w_rows` of `w` (out = `w_rows.len()`, in = `w.cols()`).
///
/// # Panics
/// As [`gemm_x_wt`] (`o.rs < in` with `n > 1` for overlapping rows).
#[allow(clippy::too_many_arguments)]
pub fn gemm_dy_w(
    n: usize,
    dst: &mut [f32],
    o: GemmOut,
    dy: Strided<'_>,
    w: &PackedMatrix,
    w_rows: Range<usize>,
    alpha: f32,
    par: Par,
) {
    assert!(w_rows.start <= w_rows.end && w_rows.end <= w.rows(), "rows {w_rows:?} of a {}-row matrix", w.rows());
    let unit = w.format().block().max(16);
    let job = Job { n, k: w_rows.len(), len: w.cols(), unit, o, lhs: dy, alpha, par };
    job.run(dst, |p, buf| {
        w.dequantize_block(w_rows.clone(), p.clone(), buf);
        Strided::rows(buf, p.len())
    });
}

/// `dst[n × len] = (accumulate ? dst : 0) + alpha · lhs[n × k] · B`, B's
/// columns produced a panel at a time.
struct Job<'a> {
    n: usize,
    k: usize,
    len: usize,
    /// Panels start on multiples of this (16, or the format's block).
    unit: usize,
    o: GemmOut,
    lhs: Strided<'a>,
    alpha: f32,
    par: Par,
}

/// The destination shared by the panels' tasks (disjoint columns each).
#[derive(Clone, Copy)]
struct Dst(*mut f32);
// SAFETY: the tasks write disjoint column panels of the checked block.
unsafe impl Send for Dst {}
// SAFETY: as above.
unsafe impl Sync for Dst {}

impl Dst {
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

impl Job<'_> {
    /// Runs the panels; `fill(panel, buf)` dequantises the panel's `k ×
    /// panel.len()` values into `buf` and returns B's view of them.
    fn run<F>(&self, dst: &mut [f32], fill: F)
    where
        F: for<'b> Fn(Range<usize>, &'b mut [f32]) -> Strided<'b> + Sync,
    {
        let (n, len, o) = (self.n, self.len, self.o);
        if n == 0 || len == 0 {
            return;
        }
        assert!(last_index(o.offset, n, o.rs, len, 1).is_some_and(|l| l < dst.len()), "gemm dst out of bounds");
        assert!(n == 1 || o.rs >= len, "gemm dst rows overlap: row stride {} < {len} columns", o.rs);
        let threads = rayon::current_num_threads();
        let pool = self.par.pool && threads > 1;
        let min = MIN_PANEL.max((SMALL_OUTPUT / n + 1).next_multiple_of(self.unit));
        let panels = panels(len, self.k, self.unit, min, if pool { threads } else { 1 });
        let dst = Dst(dst.as_mut_ptr());
        let one = |p: Range<usize>, par: Par| {
            with_buf(&PANEL, p.len() * self.k, |buf| {
                let width = p.len();
                let out = GemmOut { offset: o.offset + p.start, ..o };
                let rhs = fill(p, buf);
                // SAFETY: the panel's columns lie inside the block checked
                // above, which `dst` borrows exclusively; panels are disjoint.
                unsafe {
                    gemm_raw(GemmDims { m: n, n: width, k: self.k }, dst.ptr(), out, self.lhs, rhs, self.alpha, par)
                }
            })
        };
        let single = Par { pool: false, ..self.par };
        if pool && panels.len() >= threads {
            panels.into_par_iter().for_each(|p| one(p, single));
        } else {
            for p in panels {
                one(p, if pool { self.par } else { single });
            }
        }
    }
}

/// Cuts `len` output columns into panels: as many as a buffer of
/// [`PANEL_BYTES`] per panel needs, rounded up to a multiple of `threads`,
/// but none under `min` columns (a multiple of `unit`); each starts on a
/// multiple of `unit` (a power of two ≥ 16), the units shared out evenly
/// and the last panel taking the rest.
pub(crate) fn panels(len: usize, k: usize, unit: usize, min: usize, threads: usize) -> Vec<Range<usize>> {
    let max_cols = (PANEL_BYTES / (4 * k.max(1))).max(min);
    let count = len.div_ceil(max_cols).div_ceil(threads) * threads;
    let most = len / min;
    let count = if most >= threads { count.min(most / threads * threads) } else { count.min(most) }.max(1);
    let (per, extra) = (len / unit / count, len / unit % count);
    let mut start = 0;
    (0..count)
        .map(|t| {
            let size = if t + 1 == count { len - start } else { (per + usize::from(t < extra)) * unit };
            start += size;
            start - size..start
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Panels tile the columns, start on the unit, hold ≥ `min` columns
    /// (or are the whole), and their count is a multiple of the threads
    /// where the columns allow it.
    #[test]
    fn panels_tile_the_output() {
        for len in [1, 64, 127, 128, 200, 255, 256, 576, 960, 1536, 3072, 5000] {
            for k in [1, 576, 1536, 8192] {
                for unit in [16, 32, 64] {
                    for (threads, min) in [(1, 128), (2, 128), (3, 128), (8, 128), (2, 320), (3, 384)] {
                        let p = panels(len, k, unit, min, threads);
                        assert_eq!(p.first().map(|r| r.start), Some(0));
                        assert_eq!(p.last().map(|r| r.end), Some(len));
                        assert!(p.windows(2).all(|w| w[0].end == w[1].start));
                        assert!(p.iter().all(|r| r.start % unit == 0), "{len} {unit}: {p:?}");
                        assert!(p.len() == 1 || p.iter().all(|r| r.len() >= min), "{len} {unit}: {p:?}");
                        if len / min >= threads {
                            assert_eq!(p.len() % threads, 0, "{len} {k} {threads}: {p:?}");
                        }
                    }
                }
            }
        }
    }
}
