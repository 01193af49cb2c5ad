//! Tensor parallelism at the step boundary: the gradients each rank holds
//! only a part of ([`Shard::Partial`]) summed over the tensor-parallel
//! group, and the global norm counting a split tensor's slices once each
//! and a replicated tensor once (not once per rank).

use super::clip::sum_of_squares;
use super::Trainer;
use crate::tensor::{Shard, TensorShards, TpRank};
use crate::zero::Reduction;
use comm::{CommError, Communicator};
use std::ops::Range;

/// The tensor-parallel group of a step.
pub(crate) struct TpGroup<'a> {
    /// The ranks of this (stage, data rank), one per slice.
    pub(crate) comm: &'a mut dyn Communicator,
    /// Per tensor of the trainer's layout.
    pub(crate) shards: &'a [Shard],
    /// This rank.
    pub(crate) tp: TpRank,
}

impl Trainer {
    /// The gradient ranges of this trainer's trainable tensors whose shard
    /// matches `keep`, with their segments (segment `skip` left out).
    fn tensor_grad_ranges(
        &self,
        keep: impl Fn(&Shard) -> bool,
        shards: &[Shard],
        skip: Option<usize>,
    ) -> Vec<(usize, Range<usize>, Shard)> {
        let (space, keep) = (&self.part.space, &keep);
        (0..self.part.n_segments())
            .filter(|&j| Some(j) != skip)
            .flat_map(|j| {
                let g0 = space.grad_segments[j].start;
                space.tensors[j].iter().filter_map(move |t| {
                    let g = t.grad_rel?;
                    keep(&shards[t.idx]).then(|| (j, g0 + g..g0 + g + t.rel.len(), shards[t.idx]))
                })
            })
            .collect()
    }

    /// Before the data-parallel reduction: the gradients each rank holds
    /// a part of summed over the tensor-parallel group, in one all-reduce
    /// (every rank gets the same bits, so the copies stay equal after the
    /// update). A piece held by several ranks is summed over them by
    /// placing it in a zero buffer of the whole tensor.
    pub(super) fn sum_partial_gradients(&mut self, tp: Option<&mut TpGroup<'_>>) -> Result<(), CommError> {
        let Some(tp) = tp else { return Ok(()) };
        let me = tp.tp;
        let runs: Vec<(Range<usize>, Shard)> = self
            .tensor_grad_ranges(|s| s.partial_gradient(me), tp.shards, None)
            .into_iter()
            .map(|(_, r, s)| (r, s))
            .collect();
        if runs.is_empty() {
            return Ok(());
        }
        // Where each run sits in the packed buffer: the whole tensor for a shared piece.
        // A run's length in the packed buffer: the whole tensor for a shared piece.
        let whole = |s: &Shard, n: usize| match *s {
            Shard::Split { parts, .. } => n * parts,
            _ => n,
        };
        let total: usize = runs.iter().map(|(r, s)| whole(s, r.len())).sum();
        let mut buf = vec![0.0f32; total];
        let mut at = 0;
        for (r, s) in &runs {
            let len = whole(s, r.len());
            TensorShards::place_tensor(*s, me, &self.grads[r.clone()], &mut buf[at..at + len]);
            at += len;
        }
        tp.comm.all_reduce_sum(&mut buf)?;
        let mut at = 0;
        for (r, s) in runs {
            let len = whole(&s, r.len());
            let mut mine = Vec::with_capacity(r.len());
            TensorShards::take_tensor(s, me, &buf[at..at + len], &mut mine);
            self.grads[r].copy_from_slice(&mine);
            at += len;
        }
        Ok(())
    }

    /// Σ g² of the tensor-parallel group's gradient (this rank's shard at
    /// ZeRO-1; segment `skip` left out — a tied embedding's second copy):
    /// every piece counted by one rank ([`Shard::counted_by`]), summed over
    /// the group — the same value on every rank of it.
    pub(super) fn tensor_parallel_sum_of_squares(
        &self,
        tp: &mut TpGroup<'_>,
        skip: Option<usize>,
    ) -> Result<f64, CommError> {
        let owned = |r: Range<usize>, j: usize| -> Range<usize> {
            if self.zero_stage.reduction() == Reduction::AllReduce {
                return r;
            }
            let o = self.part.grad_owned(j, self.part.rank);
            r.start.max(o.start)..r.end.min(o.end).max(r.start.max(o.start))
        };
        let me = tp.tp;
        let mut sq = [self
            .tensor_grad_ranges(|s| s.counted_by(me), tp.shards, skip)
            .into_iter()
            .map(|(j, r, _)| sum_of_squares(&self.grads[owned(r, j)]))
            .sum::<f64>()];
        tp.comm.all_reduce_sum_f64(&mut sq)?;
        Ok(sq[0])
    }
}
