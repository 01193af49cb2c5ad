//! The [`ParamStore`] a model sees during a step: parameters from the
//! replicated buffer, the 16-bit copy or stage 3's gathered segment, and
//! gradients handed out per tensor; at per-segment accumulation `done`
//! reduce-scatters the segment's gradient.

use super::{ModelCopy, Trainer};
use crate::error::EngineError;
use crate::precision::Precision;
use crate::store::{ParamStore, SegmentGrads, SegmentView, Written};
use crate::tensor::{TensorGroup, TpLink};
use crate::zero::{Accumulation, Partition, ZeroStage};
use comm::Communicator;

impl Trainer {
    /// A store over this trainer's buffers for one pass of the model.
    pub(super) fn store<'a>(&'a mut self, comm: &'a mut dyn Communicator, with_grads: bool) -> StepStore<'a> {
        self.store_tp(comm, (None, None), with_grads)
    }

    /// [`Trainer::store`] whose segments carry the tensor-parallel group
    /// `groups.0` and the context-parallel group `groups.1`.
    pub(super) fn store_tp<'a, 'c: 'a>(
        &'a mut self,
        comm: &'a mut dyn Communicator,
        groups: (Option<&'a mut (dyn Communicator + 'c)>, Option<&'a mut (dyn Communicator + 'c)>),
        with_grads: bool,
    ) -> StepStore<'a> {
        let step = self.n_steps + 1;
        StepStore {
            tp: groups.0.map(|comm| TpLink { comm, traffic: &mut self.tp_traffic, step }),
            cp: groups.1.map(|comm| TpLink { comm, traffic: &mut self.cp_traffic, step }),
            part: &self.part,
            zero_stage: self.zero_stage,
            with_grads,
            precision: self.options.precision,
            model_copy: self.model_copy.as_mut(),
            params: &self.params,
            grads: &mut self.grads,
            seg_grads: &mut self.seg_grads,
            gathered: &mut self.gathered,
            gathered_seg: &mut self.gathered_seg,
            written: &mut self.written,
            scratch: &mut self.scratch,
            comm,
            step: self.n_steps + 1,
            overlap: self.overlap.as_mut(),
        }
    }
}

/// A group reborrowed with its trait object's lifetime cut to the borrow
/// (`Option::as_deref_mut` keeps the original one, which `&mut`'s
/// invariance then forces on every group handed to [`Trainer::store_tp`] beside it).
pub(super) fn shorter<'s>(c: &'s mut &mut dyn Communicator) -> &'s mut (dyn Communicator + 's) {
    &mut **c
}

/// The store a model sees during a step.
pub(super) struct StepStore<'a> {
    tp: Option<TpLink<'a>>,
    cp: Option<TpLink<'a>>,
    part: &'a Partition,
    zero_stage: ZeroStage,
    with_grads: bool,
    precision: Precision,
    model_copy: Option<&'a mut ModelCopy>,
    params: &'a [f32],
    grads: &'a mut [f32],
    seg_grads: &'a mut [f32],
    gathered: &'a mut [f32],
    gathered_seg: &'a mut Option<usize>,
    written: &'a mut [bool],
    scratch: &'a mut [f32],
    comm: &'a mut dyn Communicator,
    step: u64,
    /// `overlap_comm` in a step's last micro-step (else idle: no step begun).
    overlap: Option<&'a mut super::overlap::Overlap>,
}

/// Segment `seg`'s gradient buffer during a step: its range of the local
/// accumulator, or the front of the transient per-segment buffer.
fn grad_buf<'b>(
    part: &Partition,
    zero_stage: ZeroStage,
    grads: &'b mut [f32],
    seg_grads: &'b mut [f32],
    seg: usize,
) -> &'b mut [f32] {
    let g = part.space.grad_segments[seg].clone();
    match zero_stage.accumulation() {
        Accumulation::Local => &mut grads[g],
        Accumulation::PerSegment => &mut seg_grads[..g.len()],
    }
}

impl ParamStore for StepStore<'_> {
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError> {
        if seg >= self.part.n_segments() {
            return Err(EngineError::NoSuchSegment { seg });
        }
        if let (true, Some(o)) = (self.with_grads, self.overlap.as_deref()) {
            o.check_open(seg, self.step)?;
        }
        let r = self.part.segment(seg);
        let n = r.len();
        if self.zero_stage.shards_parameters() && *self.gathered_seg != Some(seg) {
            // Just before use: every rank's piece of this segment.
            let s = self.part.piece[seg];
            let w = self.part.world_size;
            let ahead = match self.overlap.as_deref_mut() {
                Some(o) => o.take_gathered(seg, &mut self.gathered[..s * w], self.part, self.grads, self.step)?,
                None => false,
            };
            if !ahead {
                self.comm
                    .all_gather(&self.params[self.part.shard_range(seg)], &mut self.gathered[..s * w])
                    .map_err(|source| EngineError::Comm { step: self.step, source })?;
            }
            *self.gathered_seg = Some(seg);
            // Mixed precision: the model reads the segment in 16 bits.
            self.precision.round(&mut self.gathered[..n]);
        }
        if let (true, Some(o)) = (self.zero_stage.shards_parameters(), self.overlap.as_deref_mut()) {
            // While this segment computes, the next one's gather.
            o.prefetch_after(seg, self.part, self.params, self.grads, self.step)?;
        }
        let params: &[f32] = match self.model_copy.as_deref_mut() {
            _ if self.zero_stage.shards_parameters() => &self.gathered[..n],
            Some(c) => c.decoded(seg, r.clone(), self.precision),
            None => &self.params[r],
        };
        if !self.with_grads {
            let tp = TensorGroup::new(self.tp.as_mut(), self.cp.as_mut());
            return Ok(SegmentView { params, grads: SegmentGrads::none(), tp });
        }

        let buf = grad_buf(self.part, self.zero_stage, self.grads, self.seg_grads, seg);
        let grads = Written { space: &self.part.space, flags: self.written }.into_view(seg, buf);
        let tp = TensorGroup::new(self.tp.as_mut(), self.cp.as_mut());
        Ok(SegmentView { params, grads, tp })
    }

    fn done(&mut self, seg: usize, backward: bool) -> Result<(), EngineError> {
        if self.with_grads && backward {
            let part = self.part;
            let buf = grad_buf(part, self.zero_stage, self.grads, self.seg_grads, seg);
            let mut written = Written { space: &part.space, flags: self.written };
            written.clear_unwritten(seg, buf);
            if let Some(o) = self.overlap.as_deref_mut().filter(|o| !o.per_segment()) {
                o.segment_done(seg, part, self.grads, self.step)?;
            }
            let t = part.grad_piece[seg];
            if self.zero_stage.accumulation() == Accumulation::PerSegment && t > 0 {
                // Reduce-scatter this segment's gradient now; accumulate this
                // rank's piece into the shard accumulator.
                let w = part.world_size;
                part.pack_grads_in_place(seg, &mut self.seg_grads[..t * w]);
                if let Some(o) = self.overlap.as_deref_mut().filter(|o| o.in_step()) {
                    // On the thread; added into the shard when it is back.
                    o.scatter(seg, &self.seg_grads[..t * w], part, self.grads, self.step)?;
                } else {
                    let out = &mut self.scratch[..t];
                    self.comm
                        .reduce_scatter_sum(&self.seg_grads[..t * w], out)
                        .map_err(|source| EngineError::Comm { step: self.step, source })?;
                    part.add_reduced(seg, out, self.grads);
                }
                // Reduced and accumulated: the transient buffer is free again.
                Written { space: &part.space, flags: self.written }.reset(seg);
            }
        }
        if self.zero_stage.shards_parameters() {
            *self.gathered_seg = None; // released: the buffer is reused by the next segment
        }
        Ok(())
    }
}
