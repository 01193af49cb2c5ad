//! Pipeline parallelism where the accumulation micro-batches are the
//! pipeline: a model's block stack cut into P contiguous stages
//! ([`partition_layers`], [`StageSpec`]), the schedule every stage executes —
//! GPipe or 1F1B (PipeDream-flush) — written out as an explicit list of
//! operations per stage ([`Schedule`]), and the stage interface a model
//! implements ([`StagedModel`]).
//!
//! A stage holds only its segments: the embedding (first stage), its
//! blocks, the final norm and head (last stage) — and, when the head is
//! tied to the token embedding, the last stage holds the embedding segment
//! too; the two copies' gradients are summed between the first and the last
//! stage at the boundary (as Megatron-LM does), so both copies stay equal.
//! The engine's [`crate::Trainer`] then runs over the stage's own layout
//! ([`StageLayout`]), data-parallel over the ranks holding the same stage.

use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::model::{MicroStepStats, Model};
use crate::store::{ParamStore, SegmentView};
use std::ops::Range;

mod schedule;

pub use schedule::{Op, Schedule, ScheduleKind, StagePlan, BACKWARD_TICKS, FORWARD_TICKS};

/// Cuts `n_layers` blocks into `n_stages` contiguous stages: as given
/// (`manual`: layers per stage), or evenly by layers (the first
/// `n_layers % n_stages` stages take one more).
pub fn partition_layers(
    n_layers: usize,
    n_stages: usize,
    manual: Option<&[usize]>,
) -> Result<Vec<Range<usize>>, EngineError> {
    if n_stages == 0 {
        return Err(EngineError::Pipeline("dist.pipeline_parallel must be at least 1".into()));
    }
    let counts: Vec<usize> = match manual {
        Some(m) => {
            if m.len() != n_stages || m.iter().sum::<usize>() != n_layers || m.contains(&0) {
                return Err(EngineError::Pipeline(format!(
                    "dist.pipeline_layers = {m:?} must list {n_stages} positive layer counts (one per stage) summing to the model's {n_layers} layers"
                )));
            }
            m.to_vec()
        }
        None => {
            if n_stages > n_layers {
                return Err(EngineError::Pipeline(format!(
                    "dist.pipeline_parallel = {n_stages} stages for a model of {n_layers} layers: every stage needs at least one layer; use at most {n_layers} stages"
                )));
            }
            (0..n_stages).map(|s| n_layers / n_stages + usize::from(s < n_layers % n_stages)).collect()
        }
    };
    let mut at = 0;
    Ok(counts
        .into_iter()
        .map(|c| {
            at += c;
            at - c..at
        })
        .collect())
}

/// What one pipeline stage holds and runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSpec {
    /// This stage, `0..n_stages`.
    pub stage: usize,
    /// Number of stages.
    pub n_stages: usize,
    /// The blocks (layers) of the stack this stage runs.
    pub blocks: Range<usize>,
    /// Activation slots: micro-batches between forward and backward at once.
    pub in_flight: usize,
}

impl StageSpec {
    /// The whole model as one stage with one slot (no pipeline).
    pub fn whole(n_blocks: usize) -> Self {
        StageSpec { stage: 0, n_stages: 1, blocks: 0..n_blocks, in_flight: 1 }
    }

    /// The first stage runs the embedding.
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    /// The last stage runs the final norm, the head and the loss.
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.n_stages
    }

    /// Errors unless this is the whole model (`what` needs all of it).
    pub fn require_whole(&self, what: &str) -> Result<(), String> {
        if self.n_stages == 1 {
            return Ok(());
        }
        Err(format!("{what} runs the whole model, but this one is pipeline stage {} of {}", self.stage, self.n_stages))
    }

    /// Checks the activations a stage's forward takes and gives (`input`,
    /// `output`; or its backward's gradients) against `want` values each:
    /// the first stage takes none, the last gives none.
    pub fn check_io(
        &self,
        (what_in, input): (&str, usize),
        (what_out, output): (&str, usize),
        want: usize,
    ) -> Result<(), String> {
        let bad = |what: &str, got: usize| format!("{what} holds {got} values, the micro-batch's activations {want}");
        if !self.is_first() && input != want {
            return Err(bad(what_in, input));
        }
        if !self.is_last() && output != want {
            return Err(bad(what_out, output));
        }
        Ok(())
    }

    /// The model segments this stage reads, ascending, for a model whose
    /// segments are `[embedding, block 0, …, block L−1, head]`: the
    /// embedding on the first stage — and on the last when the head is
    /// tied to it —, the blocks' segments, the head on the last.
    pub fn segments(&self, n_blocks: usize, tied_head: bool) -> Vec<usize> {
        let mut v = Vec::new();
        if self.is_first() || (self.is_last() && tied_head) {
            v.push(0);
        }
        v.extend(self.blocks.clone().map(|b| 1 + b));
        if self.is_last() {
            v.push(1 + n_blocks);
        }
        v
    }
}

/// A model whose block stack can be cut into pipeline stages. Its segments
/// are `[embedding, block 0, …, block L−1, head]` (the head segment holding
/// the final norm and, untied, the output projection).
///
/// Contract, for one micro-batch: [`StagedModel::stage_forward`] on every
/// stage in order, the activations handed from one to the next, then
/// [`StagedModel::stage_backward`] in reverse with the activation
/// gradients, computes exactly what [`Model::micro_step`] computes — the
/// same kernels in the same order per tensor — and a stage reads and
/// writes only the segments of [`StageSpec::segments`] (by their model
/// index).
pub trait StagedModel: Model {
    /// Number of blocks in the stack.
    fn n_blocks(&self) -> usize;

    /// Whether the head reads the embedding segment (tied embeddings).
    fn tied_head(&self) -> bool;

    /// From now on run only `spec`'s part, with `spec.in_flight` activation slots.
    fn set_stage(&mut self, spec: StageSpec);

    /// A model built for one rank of a tensor-parallel group: how its
    /// layout maps onto the whole model's (`None`: the whole model).
    fn tensor_shards(&self) -> Option<crate::tensor::TensorShards> {
        None
    }

    /// From now on run as rank `cp` of a context-parallel group: that
    /// rank's positions of each sequence ([`crate::context`]), the group
    /// reached through each segment's [`crate::TensorGroup`]. The error
    /// says why this model cannot.
    fn context_parallel(&mut self, cp: crate::ContextRank) -> Result<(), String> {
        Err(format!("this model cannot split its sequences over ranks ({cp})"))
    }

    /// Elements of the activations passed between stages for `batch`
    /// (and of their gradient).
    fn boundary_len(&self, batch: &Self::Batch) -> usize;

    /// Forward of `batch` through this stage, keeping what the backward
    /// needs in activation slot `slot`: from the embedding (first stage) or
    /// from `input` (the previous stage's output), into `output` (not the
    /// last stage). The last stage computes the loss, and with
    /// `loss_seed = Some(seed)` the head's backward too (its gradient
    /// waits in the slot for [`StagedModel::stage_backward`]); it returns
    /// the loss statistics (other stages: zeros). `loss_seed = None`: a
    /// forward-only pass (evaluation) that keeps nothing.
    fn stage_forward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Self::Batch,
        slot: usize,
        input: &[f32],
        output: &mut [f32],
        loss_seed: Option<f32>,
    ) -> Result<MicroStepStats, Self::Error>;

    /// Backward of the micro-batch in `slot` through this stage: from the
    /// gradient of its output (`grad_out`, empty on the last stage) to the
    /// gradient of its input (`grad_in`, not on the first stage), putting
    /// parameter gradients into `store` as [`Model::micro_step`] does.
    fn stage_backward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Self::Batch,
        slot: usize,
        grad_out: &[f32],
        grad_in: &mut [f32],
    ) -> Result<(), Self::Error>;
}

/// A boxed staged model is one (the binary holds its model behind a trait object).
impl<M: StagedModel + ?Sized> StagedModel for Box<M> {
    fn n_blocks(&self) -> usize {
        (**self).n_blocks()
    }

    fn tied_head(&self) -> bool {
        (**self).tied_head()
    }

    fn set_stage(&mut self, spec: StageSpec) {
        (**self).set_stage(spec)
    }

    fn tensor_shards(&self) -> Option<crate::tensor::TensorShards> {
        (**self).tensor_shards()
    }

    fn context_parallel(&mut self, cp: crate::ContextRank) -> Result<(), String> {
        (**self).context_parallel(cp)
    }

    fn boundary_len(&self, batch: &Self::Batch) -> usize {
        (**self).boundary_len(batch)
    }

    fn stage_forward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Self::Batch,
        slot: usize,
        input: &[f32],
        output: &mut [f32],
        loss_seed: Option<f32>,
    ) -> Result<MicroStepStats, Self::Error> {
        (**self).stage_forward(store, batch, slot, input, output, loss_seed)
    }

    fn stage_backward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Self::Batch,
        slot: usize,
        grad_out: &[f32],
        grad_in: &mut [f32],
    ) -> Result<(), Self::Error> {
        (**self).stage_backward(store, batch, slot, grad_out, grad_in)
    }
}

/// A stage's own layout: the tensors of its segments back to back (names,
/// shapes, trainable and decay flags as in the model), and where each of
/// its segments lives in it.
#[derive(Debug, Clone, PartialEq)]
pub struct StageLayout {
    /// The stage's layout.
    pub layout: ParamLayout,
    /// The model's segment index of each of the stage's segments.
    pub model_segments: Vec<usize>,
    /// Each segment's parameter range in the stage's layout.
    pub segments: Vec<Range<usize>>,
}

impl StageLayout {
    /// The part of `layout` (cut into `segments`) made of `model_segments`.
    pub fn new(layout: &ParamLayout, segments: &[Range<usize>], model_segments: Vec<usize>) -> Self {
        let mut out = ParamLayout::new();
        let mut ranges = Vec::with_capacity(model_segments.len());
        for &j in &model_segments {
            let seg = &segments[j];
            let start = out.n_params();
            for t in layout.tensors().iter().filter(|t| t.offset >= seg.start && t.offset < seg.end) {
                out.push(t.name.clone(), &t.shape, t.decay);
            }
            ranges.push(start..out.n_params());
        }
        let trainable: std::collections::HashMap<&str, bool> =
            layout.tensors().iter().map(|t| (t.name.as_str(), t.trainable)).collect();
        out.set_trainable(|t| trainable.get(t.name.as_str()).copied().unwrap_or(true));
        StageLayout { layout: out, model_segments, segments: ranges }
    }

    /// The stage's local index of model segment `seg`.
    pub fn local(&self, seg: usize) -> Option<usize> {
        self.model_segments.iter().position(|&j| j == seg)
    }
}

/// A store that lets a stage's model ask for segments by their model
/// index while the trainer's store is indexed by the stage's layout.
pub struct StageStore<'a> {
    /// The trainer's store over the stage's layout.
    pub inner: &'a mut dyn ParamStore,
    /// The stage's segments.
    pub stage: &'a StageLayout,
}

impl StageStore<'_> {
    fn map(&self, seg: usize) -> Result<usize, EngineError> {
        self.stage.local(seg).ok_or(EngineError::NoSuchSegment { seg })
    }
}

impl ParamStore for StageStore<'_> {
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError> {
        let local = self.map(seg)?;
        self.inner.segment(local)
    }

    fn done(&mut self, seg: usize, backward: bool) -> Result<(), EngineError> {
        let local = self.map(seg)?;
        self.inner.done(local, backward)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_split_evenly_or_as_given_and_bad_cuts_are_named() {
        assert_eq!(partition_layers(10, 4, None).unwrap(), vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(partition_layers(4, 4, None).unwrap(), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(partition_layers(6, 2, Some(&[2, 4])).unwrap(), vec![0..2, 2..6]);
        let e = partition_layers(2, 4, None).unwrap_err().to_string();
        assert!(e.contains("4 stages") && e.contains("2 layers"), "{e}");
        let e = partition_layers(6, 2, Some(&[2, 3])).unwrap_err().to_string();
        assert!(e.contains("pipeline_layers") && e.contains("6 layers"), "{e}");
    }

    #[test]
    fn stage_segments_put_the_tied_embedding_on_first_and_last() {
        let last = StageSpec { stage: 1, n_stages: 2, blocks: 2..4, in_flight: 1 };
        assert_eq!(last.segments(4, true), vec![0, 3, 4, 5]);
        assert_eq!(last.segments(4, false), vec![3, 4, 5]);
        let first = StageSpec { stage: 0, n_stages: 2, blocks: 0..2, in_flight: 2 };
        assert_eq!(first.segments(4, true), vec![0, 1, 2]);
        assert_eq!(StageSpec::whole(4).segments(4, true), vec![0, 1, 2, 3, 4, 5]);
    }
}
