//! Pipeline parallelism in the trainer: a trainer over one stage's own
//! layout, one optimizer step executing the stage's part of the schedule
//! (activations and their gradients as point-to-point messages between
//! neighbouring stages), the tied embedding's gradient summed between the
//! first and the last stage, the global norm over the stages, evaluation
//! through the stages, and the full (layout-free) state assembled on the
//! first stage for checkpoints.

use super::step_store::shorter;
use super::tensor::TpGroup;
use super::{
    Accumulated, Groups, InitSegment, PipeGroup, PipeInfo, PipelineReport, StepReport, Trainer, TrainerOptions,
};
use crate::error::EngineError;
use crate::model::MicroStepStats;
use crate::optim::Optimizer;
use crate::pieces::{LocalTensor, PieceMap};
use crate::pipeline::{Op, Schedule, ScheduleKind, StageLayout, StageSpec, StageStore, StagedModel};
use crate::schedule::LrSchedule;
use crate::store::GradSpace;
use crate::tensor::{Shard, TensorShards, TpRank};
use crate::zero::{Accumulation, Reduction, ZeroConfig};
use comm::{CommError, Communicator};
use std::borrow::Cow;
use std::ops::Range;
use std::time::Instant;

/// Message tags: activations, their gradients, the tied embedding's
/// gradient, evaluation activations, checkpoint gathering.
const TAG_ACT: u32 = 1;
const TAG_GRAD: u32 = 2;
const TAG_TIED: u32 = 3;
const TAG_EVAL: u32 = 4;
const TAG_GATHER: u32 = 5;

/// One stage of a pipeline as this rank runs it: the cut, the schedule
/// kind, the stage's layout, and every stage's segments (to assemble and
/// split layout-free state).
#[derive(Debug, Clone)]
pub struct PipelineStage {
    /// This stage (its `in_flight` from the schedule for K micro-batches).
    pub spec: StageSpec,
    /// GPipe or 1F1B.
    pub kind: ScheduleKind,
    /// The stage's own layout.
    pub layout: StageLayout,
    /// The schedule of one step.
    pub schedule: Schedule,
    tied: bool,
    /// Every stage's model segments (the tied embedding listed on the first only).
    owned: Vec<Vec<usize>>,
    model_space: GradSpace,
    space: GradSpace,
    /// A tensor-parallel rank's map onto the whole model.
    tp: Option<TensorShards>,
    /// The shard of each tensor of the stage's layout (empty without a split).
    stage_shards: Vec<Shard>,
    /// The whole model's segments (this rank's own without a tensor split).
    whole_segments: Vec<Range<usize>>,
}

impl PipelineStage {
    /// Stage `stage` of `model` cut into `cuts` (blocks per stage), for
    /// steps of `n_micro` micro-batches under `kind`; tells the model
    /// ([`StagedModel::set_stage`]). Mark trainable tensors first.
    pub fn new<M: StagedModel>(
        model: &mut M,
        cuts: &[Range<usize>],
        stage: usize,
        kind: ScheduleKind,
        n_micro: usize,
    ) -> Result<Self, EngineError> {
        let n_stages = cuts.len();
        let n_blocks = model.n_blocks();
        let covered = cuts.iter().try_fold(0usize, |at, r| (r.start == at && r.end > r.start).then_some(r.end));
        if stage >= n_stages || covered != Some(n_blocks) {
            return Err(EngineError::Pipeline(format!(
                "stage {stage} of cuts {cuts:?}: the cuts must cover the model's {n_blocks} blocks back to back, each non-empty"
            )));
        }
        let schedule = Schedule::new(kind, n_stages, n_micro)?;
        let spec =
            StageSpec { stage, n_stages, blocks: cuts[stage].clone(), in_flight: schedule.stages[stage].in_flight };
        let tied = model.tied_head() && n_stages > 1;
        let segments = model.segments();
        let layout = StageLayout::new(model.layout(), &segments, spec.segments(n_blocks, model.tied_head()));
        let owned = (0..n_stages)
            .map(|s| {
                let sp = StageSpec { stage: s, n_stages, blocks: cuts[s].clone(), in_flight: 1 };
                sp.segments(n_blocks, false)
            })
            .collect();
        let model_space = GradSpace::new(model.layout(), segments)?;
        let space = GradSpace::new(&layout.layout, layout.segments.clone())?;
        let tp = model.tensor_shards().filter(|t| t.tp.is_split());
        let whole_segments = match &tp {
            None => model_space.segments.clone(),
            Some(t) => model_space
                .tensors
                .iter()
                .map(|ts| {
                    let r = |i: usize| t.full.tensors()[i].range();
                    ts.first().map_or(0..0, |a| r(a.idx).start..ts.last().map_or(0, |b| r(b.idx).end))
                })
                .collect(),
        };
        let stage_shards = match &tp {
            None => Vec::new(),
            Some(t) => {
                let by_name: std::collections::HashMap<&str, Shard> =
                    t.local.tensors().iter().zip(&t.shards).map(|(x, s)| (x.name.as_str(), *s)).collect();
                layout
                    .layout
                    .tensors()
                    .iter()
                    .map(|x| by_name.get(x.name.as_str()).copied().unwrap_or(Shard::Replicated))
                    .collect()
            }
        };
        model.set_stage(spec.clone());
        Ok(PipelineStage {
            spec,
            kind,
            layout,
            schedule,
            tied,
            owned,
            model_space,
            space,
            tp,
            stage_shards,
            whole_segments,
        })
    }

    fn info(&self) -> PipeInfo {
        PipeInfo {
            stage: self.spec.stage,
            n_stages: self.spec.n_stages,
            tied: self.tied && (self.spec.is_first() || self.spec.is_last()),
        }
    }

    /// A model segment's range in a model-wide buffer and in this stage's.
    fn ranges(&self, grad_space: bool, seg: usize) -> (Range<usize>, Option<Range<usize>>) {
        let pick =
            |sp: &GradSpace, j: usize| if grad_space { sp.grad_segments[j].clone() } else { sp.segments[j].clone() };
        (pick(&self.model_space, seg), self.layout.local(seg).map(|l| pick(&self.space, l)))
    }

    /// This stage's part of a model-wide buffer (parameters, or with
    /// `grad_space` a gradient-space buffer such as optimizer state): how a
    /// checkpoint written at any pipeline width is restored at this one.
    pub fn take(&self, full: &[f32], grad_space: bool) -> Result<Vec<f32>, EngineError> {
        let split;
        let full = match &self.tp {
            Some(t) => {
                split = t.take(full, grad_space)?;
                &split[..]
            }
            None => full,
        };
        let want =
            if grad_space { self.model_space.n_grads } else { self.model_space.segments.last().map_or(0, |r| r.end) };
        if full.len() != want {
            return Err(EngineError::ParamCount { expected: want, got: full.len() });
        }
        Ok(self
            .layout
            .model_segments
            .iter()
            .flat_map(|&j| full[self.ranges(grad_space, j).0].iter().copied())
            .collect())
    }

    /// This rank's parameter buffer (or with `grad_space` its gradient
    /// space) mapped onto the whole model's tensors: a tensor is written
    /// by the stage that owns it (the tied embedding by the first) and, of
    /// the tensor ranks holding the same values, by the first.
    pub fn piece_map(&self, grad_space: bool) -> PieceMap {
        let tp = self.tp.as_ref().map_or(TpRank::default(), |t| t.tp);
        let mut tensors = Vec::new();
        for (l, &m) in self.layout.model_segments.iter().enumerate() {
            let owns = self.owned[self.spec.stage].contains(&m);
            for (st, whole) in self.space.tensors[l].iter().zip(&self.model_space.tensors[m]) {
                let span = match grad_space {
                    false => self.space.segments[l].start + st.rel.start..self.space.segments[l].start + st.rel.end,
                    true => match st.grad_rel {
                        Some(g) => {
                            let at = self.space.grad_segments[l].start + g;
                            at..at + st.rel.len()
                        }
                        None => continue,
                    },
                };
                let shard = self.stage_shards.get(st.idx).copied().unwrap_or(Shard::Replicated);
                tensors.push(LocalTensor { span, whole: whole.idx, shard, writes: owns && shard.counted_by(tp) });
            }
        }
        PieceMap::new(tensors, tp)
    }

    /// The whole model's segments (what `init` of [`Trainer::for_stage`]
    /// is asked for).
    pub fn whole_segments(&self) -> &[Range<usize>] {
        &self.whole_segments
    }

    /// The shard of each tensor of the stage's layout (empty without a split).
    pub fn stage_shards(&self) -> &[Shard] {
        &self.stage_shards
    }

    /// The tensor-parallel map of this rank, if its tensors are split.
    pub fn tensor_shards(&self) -> Option<&TensorShards> {
        self.tp.as_ref()
    }

    /// This rank's values of model segment `seg` from the whole model's.
    fn take_segment<'a>(&self, seg: usize, whole: Cow<'a, [f32]>) -> Cow<'a, [f32]> {
        match &self.tp {
            None => whole,
            Some(t) => {
                let ts = &self.model_space.tensors[seg];
                let idx = ts.first().map_or(0..0, |a| a.idx..a.idx + ts.len());
                Cow::Owned(t.take_tensors(idx, &whole))
            }
        }
    }

    /// The first stage assembles a model-wide buffer from every stage's
    /// `local` one (the stages send theirs; the tied embedding comes from
    /// the first stage's copy); other stages get `None`. With tensor
    /// parallelism, rank 0 of `tp` (the first stage's group) then
    /// assembles the whole model from its group's. Every rank of `pipe`
    /// (and of `tp`) must call it.
    pub fn gather(
        &self,
        pipe: &mut dyn Communicator,
        tp: Option<&mut dyn Communicator>,
        local: &[f32],
        grad_space: bool,
    ) -> Result<Option<Vec<f32>>, CommError> {
        let Some(mine) = self.gather_stages(pipe, local, grad_space)? else { return Ok(None) };
        match (&self.tp, tp) {
            (Some(t), Some(group)) => t.gather(group, &mine, grad_space),
            _ => Ok(Some(mine)),
        }
    }

    fn gather_stages(
        &self,
        pipe: &mut dyn Communicator,
        local: &[f32],
        grad_space: bool,
    ) -> Result<Option<Vec<f32>>, CommError> {
        let s = self.spec.stage;
        if s > 0 {
            let mine: Vec<f32> = self.owned[s]
                .iter()
                .flat_map(|&j| {
                    let r = self.ranges(grad_space, j).1.unwrap_or(0..0);
                    local[r].iter().copied()
                })
                .collect();
            pipe.send(&mine, 0, TAG_GATHER)?;
            pipe.flush_sends()?;
            return Ok(None);
        }
        let n =
            if grad_space { self.model_space.n_grads } else { self.model_space.segments.last().map_or(0, |r| r.end) };
        let mut full = vec![0.0; n];
        for &j in &self.owned[0] {
            let (dst, src) = self.ranges(grad_space, j);
            full[dst].copy_from_slice(&local[src.unwrap_or(0..0)]);
        }
        for (from, segs) in self.owned.iter().enumerate().skip(1) {
            let len: usize = segs.iter().map(|&j| self.ranges(grad_space, j).0.len()).sum();
            let mut buf = vec![0.0; len];
            pipe.recv(&mut buf, from, TAG_GATHER)?;
            let mut at = 0;
            for &j in segs {
                let dst = self.ranges(grad_space, j).0;
                let l = dst.len();
                full[dst].copy_from_slice(&buf[at..at + l]);
                at += l;
            }
        }
        Ok(Some(full))
    }
}

impl Trainer {
    /// A trainer for one pipeline stage, data-parallel over `dp` (the
    /// ranks holding the same stage), from the whole model's initial values
    /// per model segment (`init(seg)`: the segment of
    /// [`PipelineStage::whole_segments`]; a tensor-parallel rank keeps its
    /// slices). ZeRO stages 0 and 1 compose with a pipeline and with
    /// tensor parallelism; 2 and 3 are refused.
    pub fn for_stage(
        stage: &PipelineStage,
        init: &InitSegment<'_>,
        optimizer: Optimizer,
        schedule: LrSchedule,
        options: TrainerOptions,
        zero: ZeroConfig,
        dp: &mut dyn Communicator,
    ) -> Result<Self, EngineError> {
        let tensor = stage.tp.as_ref().map_or(1, |s| s.tp.size);
        if let Some(e) = crate::zero::composition_error(zero.stage, stage.spec.n_stages, tensor) {
            return Err(if tensor > 1 && stage.spec.n_stages == 1 {
                EngineError::TensorParallel(e)
            } else {
                EngineError::Pipeline(e)
            });
        }
        let model_segs = stage.layout.model_segments.clone();
        let local_init =
            |j: usize| model_segs.get(j).map_or(Cow::Owned(Vec::new()), |&m| stage.take_segment(m, init(m)));
        Self::build(
            (stage.layout.layout.clone(), stage.layout.segments.clone()),
            &local_init,
            optimizer,
            schedule,
            options,
            zero,
            dp,
        )
    }

    /// One optimizer step of a pipeline stage over this rank's
    /// `micro_batches` (every stage of a pipeline gets the same ones; every
    /// rank the same K): the stage's operations in schedule order, then
    /// the boundary, once, as [`Trainer::step`] — statistics from the last
    /// stage, the tied embedding's gradient summed between the first and
    /// the last stage, the norm summed over the stages.
    pub fn step_pipeline<M: StagedModel>(
        &mut self,
        model: &mut M,
        stage: &PipelineStage,
        dp: &mut dyn Communicator,
        pipe: &mut dyn Communicator,
        (tp, mut cp): (Option<&mut dyn Communicator>, Option<&mut dyn Communicator>),
        micro_batches: &[M::Batch],
    ) -> Result<StepReport, EngineError> {
        let k = micro_batches.len();
        if k == 0 {
            return Err(EngineError::NoMicroBatches);
        }
        if pipe.world_size() != stage.spec.n_stages || pipe.rank() != stage.spec.stage {
            return Err(EngineError::Pipeline(format!(
                "the pipeline group has {} ranks with this one at {}, but this is stage {} of {}",
                pipe.world_size(),
                pipe.rank(),
                stage.spec.stage,
                stage.spec.n_stages
            )));
        }
        // The stage's schedule, unless this step has another K.
        let other;
        let schedule = if k == stage.schedule.n_micro {
            &stage.schedule
        } else {
            other = Schedule::new(stage.kind, stage.spec.n_stages, k)?;
            &other
        };
        let plan = &schedule.stages[stage.spec.stage];
        if plan.in_flight > stage.spec.in_flight {
            return Err(EngineError::Pipeline(format!(
                "{} micro-batches need {} activation slots on stage {}, the model has {}",
                k, plan.in_flight, stage.spec.stage, stage.spec.in_flight
            )));
        }
        let step_idx = self.n_steps;
        model.begin_step(step_idx);
        let comm_err = |source| EngineError::Comm { step: step_idx + 1, source };
        let before = dp.counters();
        let p2p_before = pipe.counters().p2p_bytes_sent;
        let loss_scale = self.scaler.map_or(1.0, |s| s.scale);
        let info = stage.info();
        let (s, last) = (info.stage, info.last());
        let tp = check_tp_group(stage, tp)?;
        let split = tp.is_some();
        let tp = tp.map(|comm| TpGroup {
            comm,
            shards: &stage.stage_shards,
            tp: stage.tp.as_ref().map_or(crate::TpRank::WHOLE, |t| t.tp),
        });
        let mut groups = Groups { dp, pipe: Some(PipeGroup { comm: pipe, info }), tp };
        let seeds = self.backward_seeds(model, &mut groups, micro_batches, loss_scale, last)?;
        let Groups { dp, pipe: Some(PipeGroup { comm: pipe, .. }), tp } = &mut groups else {
            unreachable!("built with a pipeline group above")
        };
        self.tp_traffic = Default::default();
        self.cp_traffic = Default::default();

        self.begin_accumulation();
        let mut acc = Accumulated::new(k);
        let mut idle = 0.0;
        let (mut act, mut out, mut gout, mut gin) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let lens: Vec<usize> = micro_batches.iter().map(|b| model.boundary_len(b)).collect();
        let len = |m: usize| lens[m];
        for op in &plan.ops {
            match *op {
                Op::RecvAct(m) => {
                    act.resize(len(m), 0.0);
                    let t0 = Instant::now();
                    pipe.recv(&mut act, s - 1, TAG_ACT).map_err(comm_err)?;
                    idle += t0.elapsed().as_secs_f64();
                }
                Op::Forward(m) => {
                    if s == 0 {
                        act.clear();
                    }
                    out.resize(if last { 0 } else { len(m) }, 0.0);
                    let t0 = Instant::now();
                    let tpc = tp.as_mut().map(|t| -> &mut dyn Communicator { &mut *t.comm });
                    let cpc = cp.as_mut().map(shorter);
                    let mut store =
                        StageStore { inner: &mut self.store_tp(&mut **dp, (tpc, cpc), true), stage: &stage.layout };
                    let stats = model
                        .stage_forward(
                            &mut store,
                            &micro_batches[m],
                            plan.slot[m],
                            &act,
                            &mut out,
                            Some(seeds.per_micro[m]),
                        )
                        .map_err(|e| EngineError::Model {
                            step: step_idx + 1,
                            micro_step_idx: m,
                            source: Box::new(e),
                        })?;
                    acc.model_s += t0.elapsed().as_secs_f64();
                    if last {
                        acc.record(m, stats, model.take_aux_stats());
                    }
                }
                Op::SendAct(m) => {
                    pipe.send(&out, s + 1, TAG_ACT).map_err(comm_err).map(|_| debug_assert_eq!(out.len(), len(m)))?
                }
                Op::RecvGrad(m) => {
                    gout.resize(len(m), 0.0);
                    let t0 = Instant::now();
                    pipe.recv(&mut gout, s + 1, TAG_GRAD).map_err(comm_err)?;
                    idle += t0.elapsed().as_secs_f64();
                }
                Op::Backward(m) => {
                    if last {
                        gout.clear();
                    }
                    gin.resize(if s == 0 { 0 } else { len(m) }, 0.0);
                    let t0 = Instant::now();
                    let tpc = tp.as_mut().map(|t| -> &mut dyn Communicator { &mut *t.comm });
                    let cpc = cp.as_mut().map(shorter);
                    let mut store =
                        StageStore { inner: &mut self.store_tp(&mut **dp, (tpc, cpc), true), stage: &stage.layout };
                    model.stage_backward(&mut store, &micro_batches[m], plan.slot[m], &gout, &mut gin).map_err(
                        |e| EngineError::Model { step: step_idx + 1, micro_step_idx: m, source: Box::new(e) },
                    )?;
                    acc.model_s += t0.elapsed().as_secs_f64();
                }
                Op::SendGrad(_) => pipe.send(&gin, s - 1, TAG_GRAD).map_err(comm_err)?,
            }
        }
        pipe.flush_sends().map_err(comm_err)?;
        self.end_accumulation();
        let mut idle_s = vec![0.0; info.n_stages];
        idle_s[s] = idle;
        pipe.all_reduce_sum_f64(&mut idle_s).map_err(comm_err)?;
        let p2p_bytes = pipe.counters().p2p_bytes_sent - p2p_before;
        acc.pipeline = Some(PipelineReport { stage: s, bubble: schedule.bubble_fraction(), idle_s, p2p_bytes });
        acc.tensor = split.then(|| std::mem::take(&mut self.tp_traffic));
        acc.context = cp.is_some_and(|c| c.world_size() > 1).then(|| std::mem::take(&mut self.cp_traffic));
        self.boundary(&mut groups, acc, &seeds, loss_scale, before)
    }

    /// Forward-only loss of `batch` through the pipeline (every rank of
    /// the pipeline gets the same statistics: the last stage's).
    pub fn loss_pipeline<M: StagedModel>(
        &mut self,
        model: &mut M,
        stage: &PipelineStage,
        dp: &mut dyn Communicator,
        pipe: &mut dyn Communicator,
        (tp, mut cp): (Option<&mut dyn Communicator>, Option<&mut dyn Communicator>),
        batch: &M::Batch,
    ) -> Result<MicroStepStats, EngineError> {
        let tp = check_tp_group(stage, tp)?;
        let step = self.n_steps;
        let comm_err = |source| EngineError::Comm { step, source };
        let (s, last) = (stage.spec.stage, stage.spec.is_last());
        let n = model.boundary_len(batch);
        let mut act = vec![0.0; if s == 0 { 0 } else { n }];
        if s > 0 {
            pipe.recv(&mut act, s - 1, TAG_EVAL).map_err(comm_err)?;
        }
        let mut out = vec![0.0; if last { 0 } else { n }];
        let mut tp = tp;
        let (tpc, cpc) = (tp.as_mut().map(shorter), cp.as_mut().map(shorter));
        let mut store = StageStore { inner: &mut self.store_tp(dp, (tpc, cpc), false), stage: &stage.layout };
        let stats = model
            .stage_forward(&mut store, batch, 0, &act, &mut out, None)
            .map_err(|e| EngineError::Model { step, micro_step_idx: 0, source: Box::new(e) })?;
        if !last {
            pipe.send(&out, s + 1, TAG_EVAL).map_err(comm_err)?;
            pipe.flush_sends().map_err(comm_err)?;
        }
        let mut v = if last { [stats.loss_sum, stats.n_targets as f64] } else { [0.0; 2] };
        pipe.all_reduce_sum_f64(&mut v).map_err(comm_err)?;
        if let Some(c) = cp {
            // Each context rank's loss is of its positions.
            c.all_reduce_sum_f64(&mut v).map_err(comm_err)?;
        }
        Ok(MicroStepStats { loss_sum: v[0], n_targets: v[1] as u64, ..Default::default() })
    }

    /// With a tied head, before the data-parallel reduction: the first and
    /// the last stage exchange their embedding gradients and each adds the
    /// other's (a + b = b + a in IEEE arithmetic, so both copies get the
    /// same bits and stay equal after the update).
    pub(super) fn sum_tied_gradients(&mut self, groups: &mut Groups<'_>) -> Result<(), CommError> {
        let Some(p) = groups.pipe.as_mut().filter(|p| p.info.tied) else { return Ok(()) };
        let g = self.part.space.grad_segments[0].clone();
        if g.is_empty() {
            return Ok(()); // a frozen embedding has no gradient
        }
        let peer = if p.info.stage == 0 { p.info.n_stages - 1 } else { 0 };
        p.comm.send(&self.grads[g.clone()], peer, TAG_TIED)?;
        let mut theirs = vec![0.0; g.len()];
        p.comm.recv(&mut theirs, peer, TAG_TIED)?;
        p.comm.flush_sends()?;
        self.grads[g].iter_mut().zip(&theirs).for_each(|(a, b)| *a += b);
        Ok(())
    }

    /// The global norm with a pipeline: this stage's sum of squares (of
    /// its shard at ZeRO-1; the last stage leaves out its copy of a tied
    /// embedding), summed over the data ranks and then the stages.
    pub(super) fn pipeline_norm(
        &self,
        dp: &mut dyn Communicator,
        p: &mut PipeGroup<'_>,
        tp: Option<&mut TpGroup<'_>>,
    ) -> Result<f64, CommError> {
        let skip0 = p.info.tied && p.info.last();
        if let Some(tp) = tp {
            let mut sq = [self.tensor_parallel_sum_of_squares(tp, skip0.then_some(0))?];
            if self.zero_stage.reduction() != Reduction::AllReduce {
                dp.all_reduce_sum_f64(&mut sq)?;
            }
            p.comm.all_reduce_sum_f64(&mut sq)?;
            return Ok(sq[0].sqrt());
        }
        let segs = (0..self.part.n_segments()).filter(|&j| !(skip0 && j == 0));
        let mut sq = [match (self.zero_stage.reduction(), self.zero_stage.accumulation()) {
            (Reduction::AllReduce, _) => segs
                .map(|j| super::clip::chunked_sum_of_squares(&self.grads[self.part.space.grad_segments[j].clone()]))
                .sum(),
            (_, Accumulation::Local) => {
                segs.map(|j| super::clip::sum_of_squares(&self.grads[self.part.grad_owned(j, self.part.rank)])).sum()
            }
            (_, Accumulation::PerSegment) => unreachable!("ZeRO-2/3 are refused with a pipeline"),
        }];
        if self.zero_stage.reduction() != Reduction::AllReduce {
            dp.all_reduce_sum_f64(&mut sq)?;
        }
        p.comm.all_reduce_sum_f64(&mut sq)?;
        Ok(sq[0].sqrt())
    }
}

/// The tensor-parallel group a step of `stage` runs with: required (and
/// of the stage's T ranks) when its tensors are split, ignored otherwise.
fn check_tp_group<'a>(
    stage: &PipelineStage,
    tp: Option<&'a mut dyn Communicator>,
) -> Result<Option<&'a mut dyn Communicator>, EngineError> {
    let Some(shards) = &stage.tp else { return Ok(None) };
    match tp {
        Some(c) if c.world_size() == shards.tp.size && c.rank() == shards.tp.rank => Ok(Some(c)),
        Some(c) => Err(EngineError::TensorParallel(format!(
            "the tensor-parallel group has {} ranks with this one at {}, but the model is rank {} of {}",
            c.world_size(),
            c.rank(),
            shards.tp.rank,
            shards.tp.size
        ))),
        None => Err(EngineError::TensorParallel(format!(
            "the model is rank {} of a tensor-parallel group of {}, but no group was given",
            shards.tp.rank, shards.tp.size
        ))),
    }
}
