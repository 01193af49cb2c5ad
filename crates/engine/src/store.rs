//! How a model reads parameters and writes gradients: by *segment* (the
//! model's natural units — for GPT-2 the embeddings, each block, the final
//! LayerNorm), so that ZeRO-3 can gather one segment's parameters just
//! before it runs and release them after, and gradients can be
//! reduce-scattered segment by segment.
//!
//! Gradients live in the *gradient space*: the trainable tensors back to
//! back (frozen tensors have no gradient memory at all). The engine owns
//! that memory: a model asks for one tensor's gradient at a time and is told
//! whether to add into it or to overwrite it ([`GradOut::accumulate`]); a
//! tensor the model never asks for in a step is cleared by the engine. So a
//! model cannot leave stale values behind, and no pass zeroes the buffer.

use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::tensor::TensorGroup;
use std::ops::Range;

/// One tensor of a segment, as the store sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegTensor {
    /// Index of the tensor in the layout.
    pub idx: usize,
    /// Element range relative to the segment's first parameter.
    pub rel: Range<usize>,
    /// Start of its gradient relative to the segment's first gradient
    /// element; `None` when frozen.
    pub grad_rel: Option<usize>,
}

/// The segments of a layout and where their gradients live.
///
/// Invariant: segments tile the parameters back to back and no tensor
/// straddles two; each segment's trainable tensors are back to back in the
/// gradient space, in layout order, so a contiguous range of parameters maps
/// to a contiguous range of gradients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradSpace {
    /// Parameter ranges of the segments.
    pub segments: Vec<Range<usize>>,
    /// Gradient ranges of the segments (empty for an all-frozen segment).
    pub grad_segments: Vec<Range<usize>>,
    /// Each segment's tensors, in layout order.
    pub tensors: Vec<Vec<SegTensor>>,
    /// Number of trainable parameters.
    pub n_grads: usize,
}

impl GradSpace {
    /// The gradient space of `layout` cut into `segments`.
    pub fn new(layout: &ParamLayout, segments: Vec<Range<usize>>) -> Result<Self, EngineError> {
        let covered = segments.iter().try_fold(0usize, |at, r| (r.start == at).then_some(r.end));
        if covered != Some(layout.n_params()) {
            return Err(EngineError::Zero("the model's segments must cover its parameters back to back".into()));
        }
        let mut tensors = vec![Vec::new(); segments.len()];
        let mut grad_segments = Vec::with_capacity(segments.len());
        let mut g = 0;
        let mut next = layout.tensors().iter().enumerate().peekable();
        for (j, seg) in segments.iter().enumerate() {
            let g0 = g;
            while let Some((idx, t)) = next.next_if(|(_, t)| t.offset < seg.end) {
                let r = t.range();
                if r.start < seg.start || r.end > seg.end {
                    return Err(EngineError::Zero(format!(
                        "tensor {} ({r:?}) straddles segment {j} ({seg:?}); segments must hold whole tensors",
                        t.name
                    )));
                }
                let grad_rel = t.trainable.then_some(g - g0);
                if t.trainable {
                    g += t.numel();
                }
                tensors[j].push(SegTensor { idx, rel: r.start - seg.start..r.end - seg.start, grad_rel });
            }
            grad_segments.push(g0..g);
        }
        Ok(Self { segments, grad_segments, tensors, n_grads: g })
    }

    /// Whether every parameter is trainable (gradient space = parameter space).
    pub fn all_trainable(&self) -> bool {
        self.n_grads == self.segments.last().map_or(0, |r| r.end)
    }

    /// The gradient range of the trainable elements inside the parameter
    /// range `params` of segment `seg` (contiguous by the invariant).
    pub fn grad_range(&self, seg: usize, params: Range<usize>) -> Range<usize> {
        let base = self.segments[seg].start;
        let (a, b) = (params.start - base, params.end - base);
        let mut lo = None;
        let mut hi = self.grad_segments[seg].start;
        for t in &self.tensors[seg] {
            let Some(gr) = t.grad_rel else { continue };
            let g0 = self.grad_segments[seg].start + gr;
            let (s, e) = (t.rel.start.max(a), t.rel.end.min(b));
            if s < e {
                lo.get_or_insert(g0 + (s - t.rel.start));
                hi = g0 + (e - t.rel.start);
            } else if t.rel.end <= a {
                hi = g0 + t.rel.len();
            }
        }
        let lo = lo.unwrap_or(hi);
        lo..hi
    }

    /// The trainable runs inside the parameter range `params` of segment
    /// `seg`: `(parameter range, first gradient index, layout index)`.
    pub fn trainable_runs(&self, seg: usize, params: Range<usize>) -> Vec<(Range<usize>, usize, usize)> {
        let base = self.segments[seg].start;
        self.tensors[seg]
            .iter()
            .filter_map(|t| {
                let gr = t.grad_rel?;
                let (s, e) = ((t.rel.start + base).max(params.start), (t.rel.end + base).min(params.end));
                (s < e).then(|| (s..e, self.grad_segments[seg].start + gr + (s - base - t.rel.start), t.idx))
            })
            .collect()
    }

    /// Layout indices of segment `seg`'s tensors.
    fn idx_range(&self, seg: usize) -> Range<usize> {
        let ts = &self.tensors[seg];
        ts.first().map_or(0..0, |f| f.idx..f.idx + ts.len())
    }
}

/// A tensor's gradient handed to a model.
pub struct GradOut<'a> {
    /// The tensor's gradient buffer.
    pub buf: &'a mut [f32],
    /// `true`: add into `buf`. `false`: `buf` holds nothing of this step
    /// yet, and the model must *overwrite every element* (the engine grants
    /// this on a tensor's first use in a step, instead of zeroing it).
    pub accumulate: bool,
}

impl<'a> GradOut<'a> {
    /// The buffer to *add* into: cleared first when it holds nothing of
    /// this step yet. For kernels that only add (scatter-adds).
    pub fn for_adding(self) -> &'a mut [f32] {
        if !self.accumulate {
            self.buf.fill(0.0);
        }
        self.buf
    }
}

/// One segment's gradients, handed out tensor by tensor.
pub struct SegmentGrads<'a> {
    buf: &'a mut [f32],
    tensors: &'a [SegTensor],
    /// Per tensor of the segment: already holds this step's values. `None`:
    /// the caller's buffer is always added to (a [`FullStore`]).
    written: Option<&'a mut [bool]>,
}

impl<'a> SegmentGrads<'a> {
    /// No gradients (a forward-only pass).
    pub fn none() -> Self {
        Self { buf: &mut [], tensors: &[], written: None }
    }

    /// Whether this pass computes gradients at all.
    pub fn enabled(&self) -> bool {
        !self.tensors.is_empty()
    }

    fn find(&self, rel: &Range<usize>) -> Option<usize> {
        let i = self.tensors.partition_point(|t| t.rel.start < rel.start);
        let t = self.tensors.get(i);
        assert!(
            t.is_some_and(|t| t.rel == *rel) || self.tensors.is_empty(),
            "{rel:?} is not one whole tensor of this segment"
        );
        t.filter(|t| t.grad_rel.is_some()).map(|_| i)
    }

    fn take(&mut self, i: usize) -> bool {
        match &mut self.written {
            None => true,
            Some(w) => std::mem::replace(&mut w[i], true),
        }
    }

    /// The gradient of the tensor at `rel` (relative to the segment's
    /// first parameter; exactly one tensor), or `None` when the tensor is
    /// frozen or the pass has no gradients — then its weight-gradient
    /// computation can be skipped.
    pub fn tensor(&mut self, rel: Range<usize>) -> Option<GradOut<'_>> {
        let i = self.find(&rel)?;
        let accumulate = self.take(i);
        let g = self.tensors[i].grad_rel?;
        Some(GradOut { buf: &mut self.buf[g..g + rel.len()], accumulate })
    }

    /// Two tensors' gradients at once (`a` before `b`).
    pub fn pair(&mut self, a: Range<usize>, b: Range<usize>) -> (Option<GradOut<'_>>, Option<GradOut<'_>>) {
        assert!(a.end <= b.start, "tensors out of order");
        let (ia, ib) = (self.find(&a), self.find(&b));
        let acc_a = ia.map(|i| self.take(i));
        let acc_b = ib.map(|i| self.take(i));
        let split = ib.and_then(|i| self.tensors[i].grad_rel).unwrap_or(self.buf.len());
        let (lo, hi) = self.buf.split_at_mut(split);
        let ga = ia
            .and_then(|i| self.tensors[i].grad_rel)
            .zip(acc_a)
            .map(|(g, accumulate)| GradOut { buf: &mut lo[g..g + a.len()], accumulate });
        let gb = acc_b.map(|accumulate| GradOut { buf: &mut hi[..b.len()], accumulate });
        (ga, gb)
    }

    /// The gradient of the tensor at `rel` to *add* into: cleared first if
    /// this is its first use in the step. For kernels that only add.
    pub fn add(&mut self, rel: Range<usize>) -> Option<&mut [f32]> {
        self.tensor(rel).map(GradOut::for_adding)
    }
}

/// One segment's parameters and its gradients.
pub struct SegmentView<'a> {
    /// The segment's parameters (`segments[seg].len()` values).
    pub params: &'a [f32],
    /// Its gradients, tensor by tensor (none in a forward-only pass).
    pub grads: SegmentGrads<'a>,
    /// The tensor-parallel group the segment's split tensors are spread
    /// over (a no-op without a split).
    pub tp: TensorGroup<'a>,
}

/// Where a model's micro-step finds its parameters and puts its gradients.
///
/// Protocol: [`ParamStore::segment`] before touching a segment,
/// [`ParamStore::done`] when the model no longer needs it in this pass
/// (`backward` if this visit computed the segment's gradients). A model
/// holds at most one segment at a time, so a sharded store keeps at most one
/// gathered segment resident.
pub trait ParamStore {
    /// Makes segment `seg` available.
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError>;
    /// The model is done with segment `seg` for now. After a backward
    /// visit the engine clears what the model did not write and may
    /// reduce the segment's gradient.
    fn done(&mut self, seg: usize, backward: bool) -> Result<(), EngineError>;
}

/// A store over full, local buffers (no sharding): what single-process code,
/// evaluation, generation and reference gradients in tests use. Gradients
/// are always *added* into the caller's buffer, which is laid out like the
/// gradient space (all of the parameters when nothing is frozen).
pub struct FullStore<'a> {
    params: &'a [f32],
    grads: &'a mut [f32],
    space: GradSpace,
}

impl<'a> FullStore<'a> {
    /// Parameters and a gradient buffer of the gradient space's length.
    pub fn new(
        layout: &ParamLayout,
        segments: Vec<Range<usize>>,
        params: &'a [f32],
        grads: &'a mut [f32],
    ) -> Result<Self, EngineError> {
        let space = GradSpace::new(layout, segments)?;
        if grads.len() != space.n_grads {
            return Err(EngineError::ParamCount { expected: space.n_grads, got: grads.len() });
        }
        Ok(Self { params, grads, space })
    }

    /// Parameters only, for forward passes.
    pub fn read_only(
        layout: &ParamLayout,
        segments: Vec<Range<usize>>,
        params: &'a [f32],
    ) -> Result<Self, EngineError> {
        Ok(Self { params, grads: &mut [], space: GradSpace::new(layout, segments)? })
    }
}

impl ParamStore for FullStore<'_> {
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError> {
        let r = self.space.segments.get(seg).ok_or(EngineError::NoSuchSegment { seg })?.clone();
        if r.end > self.params.len() {
            return Err(EngineError::ParamCount { expected: r.end, got: self.params.len() });
        }
        let grads = if self.grads.is_empty() {
            SegmentGrads::none()
        } else {
            let g = self.space.grad_segments[seg].clone();
            SegmentGrads { buf: &mut self.grads[g], tensors: &self.space.tensors[seg], written: None }
        };
        Ok(SegmentView { params: &self.params[r], grads, tp: TensorGroup::none() })
    }

    fn done(&mut self, _seg: usize, _backward: bool) -> Result<(), EngineError> {
        Ok(())
    }
}

/// The step-scoped gradient bookkeeping of a trainer's store: which
/// tensors already hold this step's values.
pub(crate) struct Written<'a> {
    pub(crate) space: &'a GradSpace,
    pub(crate) flags: &'a mut [bool],
}

impl<'a> Written<'a> {
    /// Segment `seg`'s gradient view over `buf` (its gradient range).
    pub(crate) fn into_view(self, seg: usize, buf: &'a mut [f32]) -> SegmentGrads<'a> {
        let idx = self.space.idx_range(seg);
        SegmentGrads { buf, tensors: &self.space.tensors[seg], written: Some(&mut self.flags[idx]) }
    }

    /// Clears the gradients of segment `seg`'s trainable tensors that hold
    /// nothing of this step yet (the model contributed zero to them).
    pub(crate) fn clear_unwritten(&mut self, seg: usize, buf: &mut [f32]) {
        let idx = self.space.idx_range(seg);
        for (t, w) in self.space.tensors[seg].iter().zip(&mut self.flags[idx]) {
            if let (Some(g), false) = (t.grad_rel, *w) {
                buf[g..g + t.rel.len()].fill(0.0);
                *w = true;
            }
        }
    }

    /// Forgets that segment `seg`'s tensors were written (its transient
    /// buffer was reduced and may be overwritten again).
    pub(crate) fn reset(&mut self, seg: usize) {
        let idx = self.space.idx_range(seg);
        self.flags[idx].fill(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> ParamLayout {
        let mut l = ParamLayout::new();
        l.push("a", &[3], true);
        l.push("b", &[2], false);
        l.push("c", &[4], true);
        l.push("d", &[1], false);
        l
    }

    #[test]
    fn frozen_tensors_have_no_gradient_space() {
        let mut l = layout();
        assert_eq!(l.set_trainable(|t| t.name != "b" && t.name != "d"), 7);
        let s = GradSpace::new(&l, vec![0..5, 5..10]).unwrap();
        assert_eq!(s.grad_segments, vec![0..3, 3..7]);
        assert_eq!(s.tensors[0][1].grad_rel, None);
        // Parameters 1..7 = a[1..3], b (frozen), c[0..2] → gradients 1..5.
        assert_eq!(s.grad_range(0, 1..5), 1..3);
        assert_eq!(s.grad_range(1, 5..7), 3..5);
        assert_eq!(s.grad_range(1, 9..10), 7..7);
        assert_eq!(s.trainable_runs(1, 6..10), vec![(6..9, 4, 2)]);
    }

    #[test]
    fn segments_must_hold_whole_tensors() {
        assert!(GradSpace::new(&layout(), vec![0..4, 4..10]).is_err());
        assert!(GradSpace::new(&layout(), std::iter::once(0..5).collect()).is_err());
    }

    #[test]
    fn first_use_overwrites_then_adds_and_untouched_tensors_are_cleared() {
        let l = layout();
        let space = GradSpace::new(&l, vec![0..5, 5..10]).unwrap();
        let mut flags = vec![false; 4];
        let mut buf = [7.0f32; 10]; // stale values of a previous step
        {
            let mut g = Written { space: &space, flags: &mut flags }.into_view(0, &mut buf[0..5]);
            let a = g.tensor(0..3).unwrap();
            assert!(!a.accumulate);
            a.buf.fill(1.0);
            assert!(g.tensor(0..3).unwrap().accumulate);
        }
        Written { space: &space, flags: &mut flags }.clear_unwritten(0, &mut buf[0..5]);
        assert_eq!(&buf[..5], &[1.0, 1.0, 1.0, 0.0, 0.0]);
        let mut g = Written { space: &space, flags: &mut flags }.into_view(1, &mut buf[5..10]);
        g.add(0..4).unwrap()[0] += 2.0;
        assert_eq!(&buf[5..10], &[2.0, 0.0, 0.0, 0.0, 7.0]);
    }
}
