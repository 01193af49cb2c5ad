//! ZeRO partitioning of the flat buffer.
//!
//! Each segment `j` (length `n_j`) is cut into `W` pieces of `s_j = ⌈n_j/W⌉`
//! elements; rank `r` owns piece `r` of every segment (the last pieces may be
//! short or empty — padding). A rank's *shard* is its pieces back to back,
//! each padded to `s_j`: `S = Σ s_j ≈ N/W` elements. Cutting per segment
//! (DeepSpeed cuts per tensor) lets ZeRO-3 gather one segment with one
//! all-gather, and reduce-scatter one segment's gradient with one call.
//!
//! Invariant: for every segment, the `W` pieces tile `[start, start + W·s_j)`,
//! which covers the segment; so every element has exactly one owner.

use crate::layout::ParamLayout;
use std::ops::Range;

/// How the optimizer state, gradients and parameters are partitioned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ZeroConfig {
    /// 0: replicated; 1: optimizer state; 2: + gradients; 3: + parameters.
    pub stage: u8,
    /// Stage 2 only: reduce-scatter each segment's gradient after every
    /// micro-step (DeepSpeed's way: gradient memory N/W, K× the bytes)
    /// instead of accumulating locally and reducing once at the boundary.
    pub reduce_every_micro_step: bool,
}

/// The partition of a model's segments over `world_size` ranks, seen from `rank`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The model's segments (back to back from 0).
    pub segments: Vec<Range<usize>>,
    /// Piece length `s_j` of each segment.
    pub piece: Vec<usize>,
    /// Offset of each segment's piece inside the shard.
    pub offset: Vec<usize>,
    /// This rank.
    pub rank: usize,
    /// Ranks.
    pub world_size: usize,
}

impl Partition {
    /// Partitions `segments` over `world_size` ranks.
    pub fn new(segments: Vec<Range<usize>>, rank: usize, world_size: usize) -> Self {
        let piece: Vec<usize> = segments.iter().map(|r| r.len().div_ceil(world_size)).collect();
        let offset = piece.iter().scan(0, |acc, &p| Some(std::mem::replace(acc, *acc + p))).collect();
        Self { segments, piece, offset, rank, world_size }
    }

    /// Elements of this rank's shard (padding included).
    pub fn shard_len(&self) -> usize {
        self.piece.iter().sum()
    }

    /// The flat-buffer range rank `rank` owns of segment `seg` (may be short or empty).
    pub fn owned(&self, seg: usize, rank: usize) -> Range<usize> {
        let r = &self.segments[seg];
        let start = (r.start + rank * self.piece[seg]).min(r.end);
        let end = (r.start + (rank + 1) * self.piece[seg]).min(r.end);
        start..end
    }

    /// The shard range holding this rank's piece of segment `seg`.
    pub fn shard_range(&self, seg: usize) -> Range<usize> {
        self.offset[seg]..self.offset[seg] + self.piece[seg]
    }

    /// Copies this rank's pieces of a full buffer into a shard (padding zero).
    pub fn gather_own(&self, full: &[f32], shard: &mut [f32]) {
        for seg in 0..self.segments.len() {
            let own = self.owned(seg, self.rank);
            let dst = &mut shard[self.shard_range(seg)];
            dst[..own.len()].copy_from_slice(&full[own.clone()]);
            dst[own.len()..].fill(0.0);
        }
    }

    /// The layout the optimizer sees for this rank's shard: the pieces of
    /// the model's tensors (with their weight-decay flags) and the padding.
    pub fn shard_layout(&self, layout: &ParamLayout) -> ParamLayout {
        let mut out = ParamLayout::new();
        for seg in 0..self.segments.len() {
            let own = self.owned(seg, self.rank);
            for t in layout.tensors() {
                let tr = t.range();
                let (a, b) = (tr.start.max(own.start), tr.end.min(own.end));
                if a < b {
                    out.push(format!("{}[{}..{}]", t.name, a - tr.start, b - tr.start), &[b - a], t.decay);
                }
            }
            let pad = self.piece[seg] - own.len();
            if pad > 0 {
                out.push(format!("padding.{seg}"), &[pad], false);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every element of every segment has exactly one owner, and shards
        /// are the same length on every rank.
        #[test]
        fn pieces_tile_every_segment(lens in proptest::collection::vec(0usize..50, 1..6), world in 1usize..6) {
            let mut segs = Vec::new();
            let mut at = 0;
            for l in lens {
                segs.push(at..at + l);
                at += l;
            }
            let mut owners = vec![0u32; at];
            for rank in 0..world {
                let p = Partition::new(segs.clone(), rank, world);
                prop_assert_eq!(p.shard_len(), Partition::new(segs.clone(), 0, world).shard_len());
                for seg in 0..segs.len() {
                    for i in p.owned(seg, rank) {
                        owners[i] += 1;
                    }
                }
                let mut layout = ParamLayout::new();
                layout.push("all", &[at], true);
                prop_assert_eq!(p.shard_layout(&layout).n_params(), p.shard_len());
            }
            prop_assert!(owners.iter().all(|&n| n == 1));
        }
    }
}
