//! This rank's partial sums of Adafactor's statistics: cut into parallel
//! tasks of whole pieces, merged per tensor (exact sums: the grouping does
//! not change the bits), and added over the ranks in one collective.

use super::super::exact::{SumF32, SumSq};
use super::super::{slices_mut, Piece};
use super::geometry::{row_segments, TensorState};
use super::AdafactorConfig;
use crate::error::EngineError;
use rayon::prelude::*;
use std::ops::Range;

/// One tensor's partial sums on this rank.
#[derive(Default)]
pub(super) struct Partial {
    /// Σ (g·gs)² + eps1 over each row (factored).
    pub(super) rows: Vec<SumF32>,
    /// Each element's (g·gs)² + eps1 (unfactored; 0 where another rank holds it).
    pub(super) elems: Vec<f32>,
    /// Σ over each column (factored).
    pub(super) cols: Vec<SumF32>,
    /// Σ p² (with `scale_parameter`).
    pub(super) sq: SumSq,
}

impl Partial {
    /// Adds one task's sums (sized on first use).
    pub(super) fn absorb(&mut self, ts: &TensorState, task: TaskSums) {
        if ts.factored() {
            if self.rows.is_empty() {
                self.rows = vec![SumF32::default(); ts.all_rows()];
                self.cols = vec![SumF32::default(); ts.all_cols()];
            }
            for (a, b) in self.rows[task.row0..].iter_mut().zip(&task.rows) {
                a.merge(b);
            }
            for (a, b) in self.cols.iter_mut().zip(&task.cols) {
                a.merge(b);
            }
        } else {
            if self.elems.is_empty() {
                self.elems = vec![0.0; ts.n];
            }
            self.elems[task.row0..task.row0 + task.elems.len()].copy_from_slice(&task.elems);
        }
        self.sq.merge(&task.sq);
    }
}

/// Elements one parallel task of the statistics covers (whole pieces).
const TASK_ELEMS: usize = 1 << 19;

/// One task's sums: rows from `row0` (unfactored: elements from `row0`),
/// every column, Σ p².
pub(super) struct TaskSums {
    row0: usize,
    rows: Vec<SumF32>,
    elems: Vec<f32>,
    cols: Vec<SumF32>,
    sq: SumSq,
}

/// This rank's pieces of each tensor cut into tasks of about
/// [`TASK_ELEMS`]: (tensor, range of its entries in `mine`).
pub(super) fn tasks(mine: &[Vec<(usize, usize)>], pieces: &[Piece<'_>]) -> Vec<(usize, Range<usize>)> {
    let mut out = Vec::new();
    for (t, own) in mine.iter().enumerate() {
        let (mut start, mut n) = (0, 0);
        for (k, &(i, _)) in own.iter().enumerate() {
            n += pieces[i].grads.len();
            if n >= TASK_ELEMS || k + 1 == own.len() {
                out.push((t, start..k + 1));
                (start, n) = (k + 1, 0);
            }
        }
    }
    out
}

/// Σ (g·gs)² + eps1 per row and column (or per element), and Σ p² with
/// `scale_parameter`, over `own` — consecutive pieces of one tensor.
pub(super) fn task_sums(
    ts: &TensorState,
    own: &[(usize, usize)],
    pieces: &[Piece<'_>],
    gs: f32,
    cfg: &AdafactorConfig,
) -> TaskSums {
    let first = own.first().map_or(0, |&(_, at)| at);
    let end = own.last().map_or(0, |&(i, at)| at + pieces[i].grads.len());
    let mut out = TaskSums { row0: first, rows: Vec::new(), elems: Vec::new(), cols: Vec::new(), sq: SumSq::default() };
    if ts.factored() && end > first {
        out.row0 = first / ts.cols;
        out.rows = vec![SumF32::default(); (end - 1) / ts.cols + 1 - out.row0];
        out.cols = vec![SumF32::default(); ts.all_cols()];
    } else {
        out.elems = vec![0.0; end - first];
    }
    for &(i, at) in own {
        let p = &pieces[i];
        if cfg.scale_parameter {
            out.sq.merge(&SumSq::of_squares(p.params));
        }
        if ts.factored() {
            // Row segment by segment: each row's terms in a local sum,
            // added to the row's at the segment's end.
            let g = p.grads;
            row_segments(ts, at, g.len(), |k, row, cols| {
                let mut acc = SumF32::default();
                let n = cols.len();
                for (c, &g) in out.cols[cols].iter_mut().zip(&g[k..k + n]) {
                    let gi = g * gs;
                    let u = gi * gi + cfg.eps1;
                    acc.add(u);
                    c.add(u);
                }
                out.rows[row - out.row0].merge(&acc);
            });
        } else {
            for (e, &g) in out.elems[at - first..at - first + p.grads.len()].iter_mut().zip(p.grads) {
                let gi = g * gs;
                *e = gi * gi + cfg.eps1;
            }
        }
    }
    out
}

/// Adds every rank's partial sums of `tensors`, in place (one collective).
pub(super) fn sum_over_ranks(
    tensors: &[TensorState],
    partials: &mut [Partial],
    scale_parameter: bool,
    reduce: &mut (dyn FnMut(&mut [f64]) -> Result<(), EngineError> + '_),
) -> Result<(), EngineError> {
    let (fw, sw) = (SumF32::WIRE, SumSq::WIRE);
    let sq_len = if scale_parameter { sw } else { 0 };
    let mut ranges = Vec::with_capacity(tensors.len());
    let mut at = 0;
    for ts in tensors {
        let l = if ts.factored() { ts.stats.len() * fw } else { ts.n } + sq_len;
        ranges.push(at..at + l);
        at += l;
    }
    let mut buf = vec![0.0f64; at];
    slices_mut(&mut buf, &ranges).into_par_iter().zip(&*partials).for_each(|(b, part)| {
        let (stats, sq) = b.split_at_mut(b.len() - sq_len);
        for (s, out) in part.rows.iter().chain(&part.cols).zip(stats.chunks_mut(fw)) {
            s.write(out);
        }
        for (&u, out) in part.elems.iter().zip(stats.iter_mut()) {
            *out = u as f64;
        }
        if scale_parameter {
            part.sq.write(sq);
        }
    });
    reduce(&mut buf)?;
    for ((ts, part), r) in tensors.iter().zip(partials.iter_mut()).zip(ranges) {
        let (stats, sq) = buf[r.clone()].split_at(r.len() - sq_len);
        if ts.factored() {
            let sums: Vec<SumF32> = stats.chunks(fw).map(SumF32::read).collect();
            let (r, c) = sums.split_at(ts.all_rows());
            part.rows = r.to_vec();
            part.cols = c.to_vec();
        } else {
            // One rank holds each element, the others add zeros: exact.
            part.elems = stats.iter().map(|&u| u as f32).collect();
        }
        if scale_parameter {
            part.sq = SumSq::read(sq);
        }
    }
    Ok(())
}

/// The f64 values of `n` sums (zeros when this rank had none).
pub(super) fn sums(s: &[SumF32], n: usize) -> impl Iterator<Item = f64> + '_ {
    s.iter().map(SumF32::get).chain(std::iter::repeat(0.0)).take(n)
}
