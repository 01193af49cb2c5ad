//! Where a rank's buffers sit in the whole model's tensors, for sharded
//! checkpoints: a contiguous range of a rank's parameter or
//! gradient-space buffer (its ZeRO share, or everything it holds) maps to
//! [`Run`]s of whole-tensor elements — one per tensor it touches, or with
//! a tensor-parallel split up to three per tensor (a partial row, whole
//! rows, a partial row), since a split tensor's piece is strided in the
//! whole tensor.
//!
//! Invariant: a map's tensors tile its buffer space back to back in order;
//! the values of a range's runs are back to back in the buffer from the
//! range's own offset, in run order.

use crate::layout::ParamLayout;
use crate::tensor::{Shard, TensorShards, TpRank};
use std::ops::Range;

/// `count` rows of `len` elements of whole tensor `tensor`, `stride` apart
/// from element `start` (row-major, flattened); a rank's values of them
/// lie back to back in its buffer from `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Index of the tensor in the whole model's layout.
    pub tensor: usize,
    /// First element.
    pub start: usize,
    /// Elements per row.
    pub len: usize,
    /// Elements from one row's start to the next's.
    pub stride: usize,
    /// Rows.
    pub count: usize,
    /// Where the values start in the rank's buffer.
    pub at: usize,
}

impl Run {
    /// Elements in all.
    pub fn numel(&self) -> usize {
        self.len * self.count
    }

    /// The whole-tensor elements of row `k`.
    pub fn row(&self, k: usize) -> Range<usize> {
        let s = self.start + k * self.stride;
        s..s + self.len
    }
}

/// One tensor of a rank's buffer space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalTensor {
    /// Its elements in the rank's parameter (or gradient-space) buffer.
    pub span: Range<usize>,
    /// Index of the whole tensor in the whole model's layout.
    pub whole: usize,
    /// How the rank's values relate to the whole tensor's.
    pub shard: Shard,
    /// Whether this rank is the one that writes it (one copy of each
    /// value model-wide: its pipeline stage owns it, and among tensor ranks
    /// holding the same values the first).
    pub writes: bool,
}

/// A rank's buffer space (parameters, or the trainable tensors back to
/// back) mapped onto the whole model's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceMap {
    tensors: Vec<LocalTensor>,
    tp: TpRank,
}

impl PieceMap {
    /// The map of a rank of tensor group `tp` whose buffer holds `tensors`
    /// back to back in order.
    pub fn new(tensors: Vec<LocalTensor>, tp: TpRank) -> Self {
        Self { tensors, tp }
    }

    /// The whole model's own buffer space (no split): every parameter, or
    /// with `grad_space` the trainable tensors back to back.
    pub fn whole(layout: &ParamLayout, grad_space: bool) -> Self {
        let tensors = TensorShards::spans(layout, grad_space)
            .into_iter()
            .enumerate()
            .filter_map(|(whole, span)| {
                Some(LocalTensor { span: span?, whole, shard: Shard::Replicated, writes: true })
            })
            .collect();
        Self { tensors, tp: TpRank::default() }
    }

    /// The tensors, in buffer order.
    pub fn tensors(&self) -> &[LocalTensor] {
        &self.tensors
    }

    /// The runs of buffer range `range`, whose values lie from `at` in the
    /// rank's buffer; with `writers_only` those of the tensors this rank
    /// writes alone (the others are skipped, their buffer positions too).
    pub fn runs(&self, range: Range<usize>, at: usize, writers_only: bool) -> Vec<Run> {
        let mut out = Vec::new();
        let first = self.tensors.partition_point(|t| t.span.end <= range.start);
        for t in self.tensors[first..].iter().take_while(|t| t.span.start < range.end) {
            let (s, e) = (range.start.max(t.span.start), range.end.min(t.span.end));
            if s >= e || (writers_only && !t.writes) {
                continue;
            }
            let at = at + (s - range.start);
            let (s, e) = (s - t.span.start, e - t.span.start);
            match t.shard {
                Shard::Replicated | Shard::Partial => {
                    out.push(Run { tensor: t.whole, start: s, len: e - s, stride: e - s, count: 1, at })
                }
                Shard::Split { dim, inner, parts, .. } => {
                    let r = self.tp.range(dim, parts);
                    let (w, stride) = (r.len() * inner, dim * inner);
                    let whole_of = |o: usize, c: usize| o * stride + r.start * inner + c;
                    let mut pos = s;
                    while pos < e {
                        let (o, c) = (pos / w, pos % w);
                        let run = if c != 0 || e - pos < w {
                            let len = (w - c).min(e - pos);
                            Run { tensor: t.whole, start: whole_of(o, c), len, stride, count: 1, at: at + pos - s }
                        } else {
                            let count = (e - pos) / w;
                            Run { tensor: t.whole, start: whole_of(o, 0), len: w, stride, count, at: at + pos - s }
                        };
                        pos += run.numel();
                        out.push(run);
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every position of a split rank's buffer maps to the whole-tensor
    /// element [`TensorShards::take`] put there, for any cut of the buffer
    /// into ranges: the runs are the inverse of the split.
    #[test]
    fn runs_invert_the_tensor_split_for_any_range() {
        let mut full = ParamLayout::new();
        full.push("a", &[6, 4], true); // column-parallel: rows split
        full.push("b", &[3, 8], true); // row-parallel: columns split (strided)
        full.push("c", &[5], true); // replicated
        full.push("d", &[2, 4, 6], true); // heads: the middle axis
        let shards = [
            Shard::Split { outer: 1, dim: 6, inner: 4, parts: 2 },
            Shard::Split { outer: 3, dim: 8, inner: 1, parts: 2 },
            Shard::Replicated,
            Shard::Split { outer: 2, dim: 4, inner: 6, parts: 2 },
        ];
        let offsets: Vec<usize> = full.tensors().iter().map(|t| t.offset).collect();
        // Each whole element's value is its own flat index.
        let whole: Vec<f32> = (0..full.n_params()).map(|i| i as f32).collect();
        for rank in 0..2 {
            let tp = TpRank::new(rank, 2);
            let mut local = ParamLayout::new();
            let mut tensors = Vec::new();
            let mut taken = Vec::new();
            for (i, (t, s)) in full.tensors().iter().zip(&shards).enumerate() {
                let before = taken.len();
                TensorShards::take_tensor(*s, tp, &whole[t.range()], &mut taken);
                local.push(t.name.clone(), &[taken.len() - before], true);
                tensors.push(LocalTensor { span: before..taken.len(), whole: i, shard: *s, writes: s.counted_by(tp) });
            }
            let map = PieceMap::new(tensors, tp);
            let n = taken.len();
            for cut in [1, 3, 5, 7, n] {
                let mut seen = vec![false; n];
                for a in (0..n).step_by(cut) {
                    let b = (a + cut).min(n);
                    for run in map.runs(a..b, 100 + a, false) {
                        for k in 0..run.count {
                            for (j, e) in run.row(k).enumerate() {
                                let pos = run.at - 100 + k * run.len + j;
                                assert!((a..b).contains(&pos), "rank {rank} cut {cut}: {run:?}");
                                assert!(!seen[pos], "rank {rank} cut {cut}: position {pos} twice");
                                seen[pos] = true;
                                assert_eq!(
                                    taken[pos],
                                    (offsets[run.tensor] + e) as f32,
                                    "rank {rank} cut {cut} {run:?}"
                                );
                            }
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s), "rank {rank} cut {cut}: a position was not mapped");
            }
            // Only the first rank writes the replicated tensor.
            let writes: usize = map.runs(0..n, 0, true).iter().filter(|r| r.tensor == 2).map(Run::numel).sum();
            assert_eq!(writes, if rank == 0 { 5 } else { 0 });
        }
    }
}
