//! Pipeline parallelism where the accumulation micro-batches are the
//! pipeline: a model's block stack cut into P contiguous stages
//! ([`split_layers`], [`StageSpec`]), the schedule every stage executes —
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
use std::fmt;
use std::ops::Range;

/// `dist.pipeline_schedule`: the order in which a stage runs its
/// micro-batches' forward and backward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum ScheduleKind {
    /// One forward, one backward (PipeDream-flush, Megatron-LM's default):
    /// stage s runs P − s − 1 warm-up forwards, then alternates; at most
    /// P − s micro-batches' activations are alive on stage s.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Every forward, then every backward: K micro-batches' activations alive on every stage.
    #[serde(rename = "gpipe")]
    GPipe,
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::GPipe => "gpipe",
        })
    }
}

/// One operation of a stage's schedule; `k` is the micro-batch (0-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Receive micro-batch k's activations from the previous stage.
    RecvAct(usize),
    /// Forward of micro-batch k through this stage (the last stage adds
    /// the loss and the head's backward).
    Forward(usize),
    /// Send micro-batch k's output activations to the next stage.
    SendAct(usize),
    /// Receive the gradient of micro-batch k's output from the next stage.
    RecvGrad(usize),
    /// Backward of micro-batch k through this stage's blocks (and the embedding on the first).
    Backward(usize),
    /// Send the gradient of micro-batch k's input to the previous stage.
    SendGrad(usize),
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Op::RecvAct(k) => write!(f, "recv-act {k}"),
            Op::Forward(k) => write!(f, "F{k}"),
            Op::SendAct(k) => write!(f, "send-act {k}"),
            Op::RecvGrad(k) => write!(f, "recv-grad {k}"),
            Op::Backward(k) => write!(f, "B{k}"),
            Op::SendGrad(k) => write!(f, "send-grad {k}"),
        }
    }
}

/// Ticks a forward takes in the schedule's timeline.
pub const FORWARD_TICKS: u64 = 1;
/// Ticks a backward takes (about twice a forward's work).
pub const BACKWARD_TICKS: u64 = 2;

/// One stage's part of a [`Schedule`]: its operations in execution order,
/// the tick each compute operation starts at in the ideal timeline
/// (forward [`FORWARD_TICKS`], backward [`BACKWARD_TICKS`], messages free),
/// and the activation slot each micro-batch occupies from its forward to
/// its backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePlan {
    /// Operations in the order the stage executes them.
    pub ops: Vec<Op>,
    /// Start tick of each compute operation, in `ops` order (`None` for messages).
    pub ticks: Vec<Option<u64>>,
    /// Slot of micro-batch k's activations.
    pub slot: Vec<usize>,
    /// Activation slots the stage needs: the most micro-batches between
    /// their forward and their backward at once.
    pub in_flight: usize,
    /// Ticks the stage computes.
    pub busy_ticks: u64,
}

/// The schedule of one optimizer step: K micro-batches through P stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// GPipe or 1F1B.
    pub kind: ScheduleKind,
    /// Number of stages P.
    pub n_stages: usize,
    /// Number of micro-batches K.
    pub n_micro: usize,
    /// Per stage: its operations.
    pub stages: Vec<StagePlan>,
    /// Ticks from the first forward to the last backward.
    pub makespan: u64,
}

impl Schedule {
    /// The schedule of `kind` for `n_stages` stages and `n_micro` micro-batches.
    /// Backward passes run in ascending micro-batch order on every stage
    /// under both schedules, so each parameter's gradient accumulates in
    /// the same order as without a pipeline.
    pub fn new(kind: ScheduleKind, n_stages: usize, n_micro: usize) -> Result<Self, EngineError> {
        if n_stages == 0 || n_micro == 0 {
            return Err(EngineError::Pipeline(format!(
                "a schedule needs at least one stage and one micro-batch (got P = {n_stages}, K = {n_micro})"
            )));
        }
        let (p, k) = (n_stages, n_micro);
        // Compute order per stage.
        let compute: Vec<Vec<Op>> = (0..p)
            .map(|s| match kind {
                ScheduleKind::GPipe => (0..k).map(Op::Forward).chain((0..k).map(Op::Backward)).collect(),
                ScheduleKind::OneFOneB => {
                    let warm = (p - s - 1).min(k);
                    let mut v: Vec<Op> = (0..warm).map(Op::Forward).collect();
                    for i in 0..k - warm {
                        v.push(Op::Forward(warm + i));
                        v.push(Op::Backward(i));
                    }
                    v.extend((k - warm..k).map(Op::Backward));
                    v
                }
            })
            .collect();
        // The ideal timeline: each compute op starts when its stage is free
        // and its input exists (the previous stage's forward, the next
        // stage's backward, both of the same micro-batch).
        let mut f_end = vec![vec![None::<u64>; k]; p];
        let mut b_end = vec![vec![None::<u64>; k]; p];
        let mut start = vec![vec![None::<u64>; 0]; p];
        let mut next = vec![0usize; p];
        let mut free_at = vec![0u64; p];
        let total: usize = compute.iter().map(Vec::len).sum();
        let mut placed = 0;
        while placed < total {
            let mut progressed = false;
            for s in 0..p {
                while let Some(&op) = compute[s].get(next[s]) {
                    let ready = match op {
                        Op::Forward(_) if s == 0 => Some(0),
                        Op::Forward(m) => f_end[s - 1][m],
                        Op::Backward(m) if s == p - 1 => f_end[s][m],
                        Op::Backward(m) => b_end[s + 1][m],
                        _ => unreachable!("compute operations only"),
                    };
                    let Some(ready) = ready else { break };
                    let t0 = ready.max(free_at[s]);
                    let (end, slot) = match op {
                        Op::Forward(m) => (t0 + FORWARD_TICKS, &mut f_end[s][m]),
                        Op::Backward(m) => (t0 + BACKWARD_TICKS, &mut b_end[s][m]),
                        _ => unreachable!("compute operations only"),
                    };
                    *slot = Some(end);
                    free_at[s] = end;
                    start[s].push(Some(t0));
                    next[s] += 1;
                    placed += 1;
                    progressed = true;
                }
            }
            if !progressed {
                return Err(EngineError::Pipeline(format!("the {kind} schedule for P = {p}, K = {k} deadlocks")));
            }
        }
        let makespan = free_at.iter().copied().max().unwrap_or(0);
        let stages = (0..p)
            .map(|s| {
                let mut ops = Vec::with_capacity(3 * compute[s].len());
                let mut ticks = Vec::with_capacity(ops.capacity());
                for (op, &t) in compute[s].iter().zip(&start[s]) {
                    match *op {
                        Op::Forward(m) => {
                            if s > 0 {
                                ops.push(Op::RecvAct(m));
                                ticks.push(None);
                            }
                            ops.push(*op);
                            ticks.push(t);
                            if s + 1 < p {
                                ops.push(Op::SendAct(m));
                                ticks.push(None);
                            }
                        }
                        Op::Backward(m) => {
                            if s + 1 < p {
                                ops.push(Op::RecvGrad(m));
                                ticks.push(None);
                            }
                            ops.push(*op);
                            ticks.push(t);
                            if s > 0 {
                                ops.push(Op::SendGrad(m));
                                ticks.push(None);
                            }
                        }
                        _ => unreachable!("compute operations only"),
                    }
                }
                let (slot, in_flight) = assign_slots(&compute[s], k);
                let busy_ticks = k as u64 * (FORWARD_TICKS + BACKWARD_TICKS);
                StagePlan { ops, ticks, slot, in_flight, busy_ticks }
            })
            .collect();
        Ok(Schedule { kind, n_stages: p, n_micro: k, stages, makespan })
    }

    /// Idle ticks of stage `s` in the ideal timeline.
    pub fn idle_ticks(&self, s: usize) -> u64 {
        self.makespan - self.stages[s].busy_ticks
    }

    /// The bubble: idle ticks over all stages' ticks, (P−1)/(K+P−1) for
    /// both schedules when a backward is a fixed multiple of a forward.
    pub fn bubble_fraction(&self) -> f64 {
        let idle: u64 = (0..self.n_stages).map(|s| self.idle_ticks(s)).sum();
        idle as f64 / (self.makespan * self.n_stages as u64) as f64
    }

    /// Most activation slots any stage needs (stage 0's).
    pub fn max_in_flight(&self) -> usize {
        self.stages.iter().map(|s| s.in_flight).max().unwrap_or(0)
    }
}

/// Slots for the micro-batches in `compute` order: the lowest free slot at
/// each forward, released at the backward.
fn assign_slots(compute: &[Op], k: usize) -> (Vec<usize>, usize) {
    let mut slot = vec![0; k];
    let mut busy: Vec<bool> = Vec::new();
    for op in compute {
        match *op {
            Op::Forward(m) => {
                let free = busy.iter().position(|b| !b).unwrap_or(busy.len());
                if free == busy.len() {
                    busy.push(false);
                }
                busy[free] = true;
                slot[m] = free;
            }
            Op::Backward(m) => busy[slot[m]] = false,
            _ => {}
        }
    }
    (slot, busy.len())
}

impl fmt::Display for Schedule {
    /// One line per stage: its compute operations at their ticks, `.` where
    /// the stage idles in the ideal timeline (forward 1 tick, backward 2).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} schedule, P = {}, K = {}: {} ticks, bubble {:.3} (= (P-1)/(K+P-1) = {:.3})",
            self.kind,
            self.n_stages,
            self.n_micro,
            self.makespan,
            self.bubble_fraction(),
            (self.n_stages - 1) as f64 / (self.n_micro + self.n_stages - 1) as f64
        )?;
        for (s, plan) in self.stages.iter().enumerate() {
            let mut line = vec![".".to_string(); self.makespan as usize];
            for (op, t) in plan.ops.iter().zip(&plan.ticks) {
                let Some(t) = t else { continue };
                let (len, txt) = match op {
                    Op::Forward(k) => (FORWARD_TICKS, format!("F{k}")),
                    Op::Backward(k) => (BACKWARD_TICKS, format!("B{k}")),
                    _ => continue,
                };
                line[*t as usize] = txt;
                for i in 1..len {
                    line[(*t + i) as usize] = "~".into();
                }
            }
            writeln!(f, "stage {s} (slots {}): {}", plan.in_flight, line.join(" "))?;
        }
        Ok(())
    }
}

/// Cuts `n_layers` blocks into `n_stages` contiguous stages: as given
/// (`manual`: layers per stage), or evenly by layers (the first
/// `n_layers % n_stages` stages take one more).
pub fn split_layers(
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
    fn bubble_is_p_minus_1_over_k_plus_p_minus_1() {
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            for p in 1..=6 {
                for k in 1..=12 {
                    let s = Schedule::new(kind, p, k).unwrap();
                    let want = (p - 1) as f64 / (k + p - 1) as f64;
                    assert!((s.bubble_fraction() - want).abs() < 1e-12, "{kind} P={p} K={k}: {s}");
                    // Every stage idles the same (P−1)(t_f + t_b) ticks.
                    for st in 0..p {
                        assert_eq!(s.idle_ticks(st), (p as u64 - 1) * (FORWARD_TICKS + BACKWARD_TICKS));
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_keeps_p_minus_s_in_flight_gpipe_k() {
        let (p, k) = (4, 8);
        let f = Schedule::new(ScheduleKind::OneFOneB, p, k).unwrap();
        let g = Schedule::new(ScheduleKind::GPipe, p, k).unwrap();
        for s in 0..p {
            assert_eq!(f.stages[s].in_flight, p - s);
            assert_eq!(g.stages[s].in_flight, k);
        }
        // Fewer micro-batches than stages: at most K in flight.
        let f = Schedule::new(ScheduleKind::OneFOneB, 4, 2).unwrap();
        assert_eq!(f.stages[0].in_flight, 2);
    }

    #[test]
    fn every_stage_runs_each_micro_batch_once_backwards_ascending_and_messages_pair_up() {
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            let (p, k) = (4, 6);
            let s = Schedule::new(kind, p, k).unwrap();
            for (st, plan) in s.stages.iter().enumerate() {
                let fw: Vec<usize> =
                    plan.ops.iter().filter_map(|o| if let Op::Forward(m) = o { Some(*m) } else { None }).collect();
                let bw: Vec<usize> =
                    plan.ops.iter().filter_map(|o| if let Op::Backward(m) = o { Some(*m) } else { None }).collect();
                assert_eq!(fw, (0..k).collect::<Vec<_>>());
                assert_eq!(bw, (0..k).collect::<Vec<_>>());
                let count = |f: fn(&Op) -> bool| plan.ops.iter().filter(|o| f(o)).count();
                assert_eq!(count(|o| matches!(o, Op::SendAct(_))), if st + 1 < p { k } else { 0 });
                assert_eq!(count(|o| matches!(o, Op::RecvAct(_))), if st > 0 { k } else { 0 });
                assert_eq!(count(|o| matches!(o, Op::SendGrad(_))), if st > 0 { k } else { 0 });
                // A slot is never reused while its micro-batch is alive.
                for (i, op) in plan.ops.iter().enumerate() {
                    if let Op::Forward(m) = op {
                        let end = plan.ops.iter().position(|o| *o == Op::Backward(*m)).unwrap();
                        for o in &plan.ops[i + 1..end] {
                            if let Op::Forward(n) = o {
                                assert_ne!(plan.slot[*n], plan.slot[*m], "{kind} stage {st}: slot reused");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn layers_split_evenly_or_as_given_and_bad_cuts_are_named() {
        assert_eq!(split_layers(10, 4, None).unwrap(), vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(split_layers(4, 4, None).unwrap(), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(split_layers(6, 2, Some(&[2, 4])).unwrap(), vec![0..2, 2..6]);
        let e = split_layers(2, 4, None).unwrap_err().to_string();
        assert!(e.contains("4 stages") && e.contains("2 layers"), "{e}");
        let e = split_layers(6, 2, Some(&[2, 3])).unwrap_err().to_string();
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
