//! The boundary's units at ZeRO 0–2 and when each may start.
//!
//! The units are the boundary's own collectives, cut the same way: at
//! stages 0–1 the buckets of `bucket_elems` over the local accumulator
//! ([`crate::zero::buckets`]), all-reduced; at stage 2 each segment, packed
//! and reduce-scattered. Only *when* each starts changes.
//!
//! When is a unit's gradient final? The backward walks the segments in
//! descending order, except that a segment may come back later (a tied head
//! writes the embedding's segment first and the embedding again last). So a
//! `done(j)` only makes `j` *pending*; it is final once a `done(i)` with
//! `i < j` follows, or at the boundary. A unit starts once every segment
//! whose gradient it covers is final. Asking for a final segment again is an
//! error (its gradient was sent; a write would be lost), never silent.

use super::{Flight, Job, Overlap};
use crate::error::EngineError;
use crate::zero::{buckets, Partition, Reduction};
use std::ops::Range;

/// One collective of the boundary's gradient reduction.
#[derive(Debug)]
pub(super) enum Unit {
    /// Stages 0–1: a bucket of the gradient space, all-reduced.
    Bucket(Range<usize>),
    /// Stage 2: a segment's gradient, packed `W · t` and reduce-scattered.
    Segment(usize),
}

impl Unit {
    /// The boundary's units under `reduction` (none for a per-segment one).
    pub(super) fn all(part: &Partition, reduction: Reduction, bucket_elems: usize) -> Vec<Unit> {
        match reduction {
            Reduction::AllReduce => buckets(part.space.n_grads, bucket_elems).map(Unit::Bucket).collect(),
            Reduction::ReduceScatter => {
                (0..part.n_segments()).filter(|&j| part.grad_piece[j] > 0).map(Unit::Segment).collect()
            }
            Reduction::Done => Vec::new(),
        }
    }

    /// Whether its gradient range meets segment `seg`'s.
    fn covers(&self, part: &Partition, seg: usize) -> bool {
        let g = &part.space.grad_segments[seg];
        match self {
            Unit::Bucket(b) => !g.is_empty() && b.start < g.end && g.start < b.end,
            Unit::Segment(s) => *s == seg,
        }
    }
}

/// Per segment, the units covering its gradient (none for a frozen one:
/// never waited for).
pub(super) fn units_of_segments(part: &Partition, units: &[Unit]) -> Vec<Vec<usize>> {
    (0..part.n_segments()).map(|j| (0..units.len()).filter(|&u| units[u].covers(part, j)).collect()).collect()
}

impl Overlap {
    /// Whether segment `seg`'s gradient was already sent this step (the
    /// boundary's units; a per-segment reduction sends each `done` anew).
    pub(crate) fn check_open(&self, seg: usize, step: u64) -> Result<(), EngineError> {
        match &self.step {
            Some(s) if s.final_seg[seg] && !self.per_segment => Err(EngineError::Overlap { step, seg }),
            _ => Ok(()),
        }
    }

    /// `done(seg)` of a backward in the last micro-step: segments above
    /// `seg` still pending are final now; `seg` becomes pending.
    pub(crate) fn segment_done(
        &mut self,
        seg: usize,
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<(), EngineError> {
        let Some(s) = self.step.as_mut() else { return Ok(()) };
        let mut now: Vec<usize> = s.pending.iter().copied().filter(|&p| p > seg).collect();
        s.pending.retain(|&p| p <= seg);
        if !s.pending.contains(&seg) {
            s.pending.push(seg);
        }
        now.sort_unstable_by(|a, b| b.cmp(a));
        for p in now {
            self.finalise(p, part, grads, step)?;
        }
        Ok(())
    }

    /// After the last micro-step (before the boundary's own collectives,
    /// which would otherwise queue behind nothing): every segment is final
    /// (pending ones, then those never done, each in descending order), so
    /// every unit is started.
    pub(crate) fn launch_rest(&mut self, part: &Partition, grads: &mut [f32], step: u64) -> Result<(), EngineError> {
        let Some(s) = self.step.as_mut() else { return Ok(()) };
        let mut order = std::mem::take(&mut s.pending);
        order.sort_unstable_by(|a, b| b.cmp(a));
        let rest: Vec<usize> =
            (0..part.n_segments()).rev().filter(|&j| !s.final_seg[j] && !order.contains(&j)).collect();
        for j in order.into_iter().chain(rest) {
            self.finalise(j, part, grads, step)?;
        }
        Ok(())
    }

    fn finalise(&mut self, seg: usize, part: &Partition, grads: &mut [f32], step: u64) -> Result<(), EngineError> {
        let Some(s) = self.step.as_mut() else { return Ok(()) };
        if s.final_seg[seg] {
            return Ok(());
        }
        s.final_seg[seg] = true;
        let mut ready = Vec::new();
        for &u in &self.seg_units[seg] {
            s.left[u] -= 1;
            if s.left[u] == 0 {
                ready.push(u);
            }
        }
        for u in ready {
            self.launch(u, part, grads, step)?;
        }
        Ok(())
    }

    /// Stages unit `u`'s input and hands it to the thread.
    fn launch(&mut self, u: usize, part: &Partition, grads: &mut [f32], step: u64) -> Result<(), EngineError> {
        let job = match &self.units[u] {
            Unit::Bucket(b) => Job::AllReduce(grads[b.clone()].to_vec()),
            Unit::Segment(j) => {
                let (t, g) = (part.grad_piece[*j], part.space.grad_segments[*j].len());
                let mut buf = vec![0.0; (t * part.world_size).max(g)];
                part.pack_segment_grads(*j, grads, &mut buf);
                buf.truncate(t * part.world_size);
                Job::ReduceScatter(buf, t)
            }
        };
        self.start(Flight::Unit(u), job, part, grads, step)
    }

    /// Writes unit `u`'s reduced values into `grads`.
    pub(super) fn apply(&self, u: usize, part: &Partition, out: &[f32], grads: &mut [f32]) {
        match &self.units[u] {
            Unit::Bucket(b) => grads[b.clone()].copy_from_slice(out),
            Unit::Segment(j) => part.place_reduced(*j, out, grads),
        }
    }
}
