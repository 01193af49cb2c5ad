//! Per-segment reduction (ZeRO-3, `reduce_every_micro_step`): each
//! segment's reduce-scatter in `done` goes to the thread instead of
//! blocking, in every micro-step; its result is added into the shard
//! accumulator in the order started (so each element's sum keeps its
//! order). ZeRO-3 also gathers the segment the model will ask for next (the
//! previous micro-step's order of requests; nothing in the first) while the
//! current one computes; a gather is a copy, so a prefetch changes no bit.

use super::{Flight, Job, Overlap};
use crate::error::EngineError;
use crate::zero::Partition;

impl Overlap {
    /// Whether this overlap reduces per segment (in every micro-step).
    pub(crate) fn per_segment(&self) -> bool {
        self.per_segment
    }

    /// A micro-step begins: the requests of the last one predict this one's.
    pub(crate) fn next_micro_step(&mut self) {
        if !self.seen.is_empty() {
            self.seen_before = std::mem::take(&mut self.seen);
        }
    }

    /// Hands segment `seg`'s packed gradient (`W · t` elements) to the
    /// thread; its reduced piece is added into `grads` (the shard
    /// accumulator) when it is back.
    pub(crate) fn scatter(
        &mut self,
        seg: usize,
        packed: &[f32],
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<(), EngineError> {
        let t = part.grad_piece[seg];
        self.start(Flight::Scatter(seg), Job::ReduceScatter(packed.to_vec(), t), part, grads, step)
    }

    /// ZeRO-3: if segment `seg` was gathered ahead, writes it into `out`
    /// (the `W · piece` gathered buffer) and returns true.
    pub(crate) fn take_gathered(
        &mut self,
        seg: usize,
        out: &mut [f32],
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<bool, EngineError> {
        while self.gathering().is_some_and(|j| j == seg) {
            self.complete_oldest(part, grads, step)?;
        }
        let Some((j, v)) = self.ready.take() else { return Ok(false) };
        let hit = j == seg; // else gathered for another segment: dropped
        if hit {
            out.copy_from_slice(&v);
        }
        if let Some(s) = self.step.as_mut() {
            s.staged -= v.len(); // counted until taken
            s.report.gathered_ahead += hit as u64;
        }
        Ok(hit)
    }

    /// ZeRO-3 (the only caller), after segment `seg` was asked for: gathers the segment the
    /// model will ask for next — the one the last micro-step asked for at
    /// this point, if this one has asked for the same so far (nothing in a
    /// run's first micro-step) — unless it is `seg` itself, or a gather is
    /// already waiting or in flight.
    pub(crate) fn prefetch_after(
        &mut self,
        seg: usize,
        part: &Partition,
        params: &[f32],
        grads: &mut [f32],
        step: u64,
    ) -> Result<(), EngineError> {
        if self.step.is_none() {
            return Ok(());
        }
        self.seen.push(seg);
        // What the last micro-step asked for next, if this one has followed it so far.
        let next = match self.seen_before.get(self.seen.len()) {
            Some(&n) if self.seen_before[..self.seen.len()] == self.seen[..] => n,
            _ => return Ok(()),
        };
        let busy = self.ready.is_some() || self.gathering().is_some();
        if next == seg || next >= part.n_segments() || busy {
            return Ok(());
        }
        let shard = params[part.shard_range(next)].to_vec();
        let job = Job::AllGather(shard, part.piece[next] * part.world_size);
        self.start(Flight::Gather(next), job, part, grads, step)
    }

    /// The segment a gather in flight is for (at most one is).
    fn gathering(&self) -> Option<usize> {
        let s = self.step.as_ref()?;
        s.in_flight.iter().find_map(|f| match f.0 {
            Flight::Gather(j) => Some(j),
            _ => None,
        })
    }
}
