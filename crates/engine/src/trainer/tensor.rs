//! Tensor parallelism at the step boundary: the gradients each rank holds
//! only a part of ([`Shard::Partial`]) summed over the tensor-parallel
//! group, and the global norm counting a split tensor's slices once each
//! and a replicated tensor once (not once per rank).

use super::clip::sum_of_squares;
use super::Trainer;
use crate::tensor::Shard;
use crate::zero::Reduction;
use comm::{CommError, Communicator};
use std::ops::Range;

/// The tensor-parallel group of a step.
pub(crate) struct TpGroup<'a> {
    /// The ranks of this (stage, data rank), one per slice.
    pub(crate) comm: &'a mut dyn Communicator,
    /// Per tensor of the trainer's layout.
    pub(crate) shards: &'a [Shard],
}

impl Trainer {
    /// The gradient ranges of this trainer's trainable tensors whose shard
    /// matches `keep`, with their segments (segment `skip` left out).
    fn tensor_grad_ranges(
        &self,
        keep: impl Fn(&Shard) -> bool,
        shards: &[Shard],
        skip: Option<usize>,
    ) -> Vec<(usize, Range<usize>)> {
        let (space, keep) = (&self.part.space, &keep);
        (0..self.part.n_segments())
            .filter(|&j| Some(j) != skip)
            .flat_map(|j| {
                let g0 = space.grad_segments[j].start;
                space.tensors[j].iter().filter_map(move |t| {
                    let g = t.grad_rel?;
                    keep(&shards[t.idx]).then(|| (j, g0 + g..g0 + g + t.rel.len()))
                })
            })
            .collect()
    }

    /// Before the data-parallel reduction: the partial gradients summed
    /// over the tensor-parallel group, in one all-reduce (every rank gets
    /// the same bits, so the replicated tensors stay equal after the update).
    pub(super) fn sum_partial_gradients(&mut self, tp: Option<&mut TpGroup<'_>>) -> Result<(), CommError> {
        let Some(tp) = tp else { return Ok(()) };
        let runs: Vec<Range<usize>> =
            self.tensor_grad_ranges(|s| *s == Shard::Partial, tp.shards, None).into_iter().map(|(_, r)| r).collect();
        if runs.is_empty() {
            return Ok(());
        }
        let mut buf: Vec<f32> = runs.iter().flat_map(|r| self.grads[r.clone()].iter().copied()).collect();
        tp.comm.all_reduce_sum(&mut buf)?;
        let mut at = 0;
        for r in runs {
            self.grads[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
            at += r.len();
        }
        Ok(())
    }

    /// Σ g² of this rank's gradient (its shard at ZeRO-1; segment `skip`
    /// left out — a tied embedding's second copy) with the split tensors'
    /// squares summed over the tensor-parallel group and the replicated
    /// ones counted once: the same value on every rank of the group.
    pub(super) fn tensor_parallel_sum_of_squares(
        &self,
        tp: &mut TpGroup<'_>,
        skip: Option<usize>,
    ) -> Result<f64, CommError> {
        let owned = |r: Range<usize>, j: usize| -> Range<usize> {
            if self.stage.reduction() == Reduction::AllReduce {
                return r;
            }
            let o = self.part.grad_owned(j, self.part.rank);
            r.start.max(o.start)..r.end.min(o.end).max(r.start.max(o.start))
        };
        let sq = |keep: fn(&Shard) -> bool| -> f64 {
            self.tensor_grad_ranges(keep, tp.shards, skip)
                .into_iter()
                .map(|(j, r)| sum_of_squares(&self.grads[owned(r, j)]))
                .sum()
        };
        let mut split = [sq(|s| !s.is_replicated())];
        let replicated = sq(Shard::is_replicated);
        tp.comm.all_reduce_sum_f64(&mut split)?;
        Ok(split[0] + replicated)
    }
}
