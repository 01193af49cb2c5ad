//! How a model reads parameters and writes gradients: by *segment* (the
//! model's natural units — for GPT-2 the embeddings, each block, the final
//! LayerNorm), so that ZeRO-3 can gather one segment's parameters just
//! before it runs and release them after, and gradients can be
//! reduce-scattered segment by segment.

use crate::error::EngineError;
use std::ops::Range;

/// One segment's parameters and its gradient buffer.
pub struct SegmentView<'a> {
    /// The segment's parameters (`segments[seg].len()` values).
    pub params: &'a [f32],
    /// Where the segment's gradient is added (same length; empty for a
    /// read-only store used for evaluation).
    pub grads: &'a mut [f32],
    /// The gradient buffer holds nothing to keep yet (its first use in this
    /// step): the model may *write* instead of adding, and must clear what it
    /// would only add to — which spares zeroing the whole buffer every step.
    pub fresh: bool,
}

/// Where a model's micro-step finds its parameters and puts its gradients.
///
/// Protocol: [`ParamStore::segment`] before touching a segment,
/// [`ParamStore::done`] when the model no longer needs it in this pass
/// (`grads_written` if it added gradients). A model holds at most one segment
/// at a time, so a sharded store keeps at most one gathered segment resident.
pub trait ParamStore {
    /// Makes segment `seg` available.
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError>;
    /// The model is done with segment `seg` for now.
    fn done(&mut self, seg: usize, grads_written: bool) -> Result<(), EngineError>;
}

/// A store over full, local buffers (no sharding): what single-process code,
/// evaluation and generation use.
pub struct FullStore<'a> {
    params: &'a [f32],
    grads: &'a mut [f32],
    segments: &'a [Range<usize>],
}

impl<'a> FullStore<'a> {
    /// Parameters and a gradient buffer of the same length.
    pub fn new(params: &'a [f32], grads: &'a mut [f32], segments: &'a [Range<usize>]) -> Self {
        Self { params, grads, segments }
    }

    /// Parameters only, for forward passes.
    pub fn read_only(params: &'a [f32], segments: &'a [Range<usize>]) -> Self {
        Self { params, grads: &mut [], segments }
    }
}

impl ParamStore for FullStore<'_> {
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError> {
        let r = self.segments.get(seg).ok_or(EngineError::NoSuchSegment { seg })?.clone();
        if r.end > self.params.len() {
            return Err(EngineError::ParamCount { expected: r.end, got: self.params.len() });
        }
        let grads = if self.grads.is_empty() { &mut [][..] } else { &mut self.grads[r.clone()] };
        Ok(SegmentView { params: &self.params[r], grads, fresh: false })
    }

    fn done(&mut self, _seg: usize, _grads_written: bool) -> Result<(), EngineError> {
        Ok(())
    }
}
