//! Who a rank trains with (for `train` and `bench`): the whole world (no split), or — with
//! `dist.pipeline_parallel = P` and/or `dist.tensor_parallel = T` — the D
//! ranks holding the same part of the model (`dp`, data-parallel), the P
//! ranks of its pipeline (`pipe`, one per stage, passing activations and
//! gradients; one rank without a pipeline) and the T ranks splitting its
//! tensors (`tp`, all-reducing inside each block). Every step, evaluation
//! and checkpoint gather of the training loop goes through here, so the loop reads
//! the same with and without a split; without one it calls exactly what it
//! did before pipelines existed.

use super::{trainer_placed, Initial, Placement, Plan};
use anyhow::{Context, Result};
use comm::Communicator;
use engine::{MicroStepStats, ParamLayout, PipelineStage, StagedModel, StepReport, TokenBatch, Trainer};
use std::path::Path;

/// A step's full state on rank 0: the parameters and the optimizer state by name.
pub type FullState = (Vec<f32>, Vec<(String, Vec<f32>)>);

/// A rank's communicators and, with a split, its part of the model.
pub struct RankComms<'a> {
    /// Every rank of the run (the stop agreement, heartbeats, memory report).
    pub world: &'a mut dyn Communicator,
    /// The staged side, when P > 1 or T > 1.
    split: Option<StageComms>,
}

/// A rank holding part of the model: its stage (and tensor slices) and
/// the groups it belongs to.
struct StageComms {
    stage: PipelineStage,
    /// The D ranks holding the same part (the trainer's data-parallel group).
    dp: Box<dyn Communicator>,
    /// The P ranks of this rank's pipeline (same data and tensor rank, one per stage).
    pipe: Box<dyn Communicator>,
    /// With T > 1: the T ranks splitting the same stage of the same data rank.
    tp: Option<Box<dyn Communicator>>,
    /// With C > 1: the C ranks splitting the sequences of the same stage,
    /// data rank and tensor rank.
    cp: Option<Box<dyn Communicator>>,
    data_rank: usize,
}

impl<'a> RankComms<'a> {
    /// The groups of `world`'s rank in `plan`'s grid (with a split a
    /// collective: every rank splits the world in the same order: dp, pipe,
    /// then tp), and `model` — built for this rank's tensor slices — cut to
    /// its stage (after its trainable flags are set).
    pub fn new<M: StagedModel>(plan: &Plan, model: &mut M, world: &'a mut dyn Communicator) -> Result<Self> {
        let grid = &plan.grid;
        if !grid.is_split() {
            return Ok(Self { world, split: None });
        }
        let rank = world.rank();
        let (s, d, t) = (grid.stage_of(rank), grid.data_rank_of(rank), grid.tensor_rank_of(rank));
        let (tn, dn, cn, c) = (grid.tensor, grid.data, grid.context, grid.context_rank_of(rank));
        // The context ranks sum their gradients and statistics with the data ranks.
        let dp = world.split(s * tn + t, d * cn + c).context("cannot form the data-parallel group of a model part")?;
        let pipe = world.split((d * cn + c) * tn + t, s).context("cannot form the pipeline group of a data rank")?;
        let tp = match grid.is_tensor_parallel() {
            true => Some(
                world.split((s * dn + d) * cn + c, t).context("cannot form the tensor-parallel group of a stage")?,
            ),
            false => None,
        };
        let cp = match cn > 1 {
            true => {
                let g = world.split((s * dn + d) * tn + t, c).context("cannot form the context-parallel group")?;
                model
                    .context_parallel(engine::ContextRank::new(c, cn).with(plan.cfg.dist.context_attention))
                    .map_err(|e| anyhow::anyhow!("dist.context_parallel = {cn}: {e}"))?;
                Some(g)
            }
            false => None,
        };
        let stage = PipelineStage::new(model, &grid.cuts, s, grid.schedule, plan.batch.accumulation_steps)?;
        Ok(Self { world, split: Some(StageComms { stage, dp, pipe, tp, cp, data_rank: d }) })
    }

    /// This rank's data-parallel rank: which micro-batches it trains on.
    pub fn data_rank(&self) -> usize {
        self.split.as_ref().map_or(self.world.rank(), |p| p.data_rank)
    }

    /// This rank's place in its data-parallel group.
    pub fn dp_rank(&self) -> usize {
        self.split.as_ref().map_or(self.world.rank(), |p| p.dp.rank())
    }

    /// The trainer's data-parallel group: the world, or the ranks holding this part.
    pub fn dp(&mut self) -> &mut dyn Communicator {
        match &mut self.split {
            Some(p) => p.dp.as_mut(),
            None => &mut *self.world,
        }
    }

    /// Bytes every communicator of this rank keeps for staging.
    pub fn buffer_bytes(&self) -> usize {
        let own = self.split.as_ref().map_or(0, |p| {
            let groups = [&p.tp, &p.cp].into_iter().flatten().map(|c| c.buffer_bytes()).sum::<usize>();
            p.dp.buffer_bytes() + p.pipe.buffer_bytes() + groups
        });
        self.world.buffer_bytes() + own
    }

    /// The whole model's layout (what checkpoints and the saved model are
    /// written in), given the layout of this rank's `local` model: with
    /// tensor parallelism the layout the slices map onto, else `local`.
    pub fn whole_layout<'l>(&'l self, local: &'l ParamLayout) -> &'l ParamLayout {
        match self.split.as_ref().and_then(|p| p.stage.tensor_shards()) {
            Some(t) => &t.full,
            None => local,
        }
    }

    /// This rank's trainer over the whole model or its part, from `initial`
    /// model-wide parameters (a checkpoint's at any layout, or a
    /// pretrained model's) or a fresh initialisation of the whole model.
    pub fn trainer<M: StagedModel>(
        &mut self,
        plan: &Plan,
        model: &M,
        initial: Initial<'_>,
        offload_root: &Path,
    ) -> Result<Trainer> {
        let world_rank = self.world.rank();
        let placement = match &mut self.split {
            None => Placement::Whole(&mut *self.world),
            Some(p) => Placement::Stage { stage: &p.stage, dp: p.dp.as_mut() },
        };
        trainer_placed(plan, model, placement, initial, offload_root, world_rank)
    }

    /// This rank's parameter buffer (or with `grad_space` its gradient
    /// space) mapped onto the whole model's tensors; `local` is the
    /// rank's layout (the whole model's without a split).
    pub fn piece_map(&self, local: &ParamLayout, grad_space: bool) -> engine::PieceMap {
        match &self.split {
            None => engine::PieceMap::whole(local, grad_space),
            Some(p) => p.stage.piece_map(grad_space),
        }
    }

    /// This rank's place among the ranks holding the same layout: (data
    /// rank, data ranks).
    pub fn dp_place(&self) -> (usize, usize) {
        match &self.split {
            None => (self.world.rank(), self.world.world_size()),
            Some(p) => (p.dp.rank(), p.dp.world_size()),
        }
    }

    /// This rank's part of a model-wide gradient-space buffer (a
    /// checkpoint's optimizer state): all of it without a split.
    pub fn own_state(&self, full: &[f32]) -> Result<Vec<f32>> {
        Ok(match &self.split {
            None => full.to_vec(),
            Some(p) => p.stage.take(full, true)?,
        })
    }

    /// Whether this rank evaluates: rank 0, or every rank where evaluation
    /// is a collective (ZeRO-3 gathers segments; a split model's stages
    /// pass activations and its tensor ranks all-reduce: every rank of data
    /// rank 0).
    pub fn evaluates(&self, zero3: bool) -> bool {
        match &self.split {
            None => self.world.rank() == 0 || zero3,
            Some(p) => p.data_rank == 0,
        }
    }

    /// One optimizer step over this rank's `batches`.
    pub fn step<M: StagedModel<Batch = TokenBatch>>(
        &mut self,
        trainer: &mut Trainer,
        model: &mut M,
        batches: &[TokenBatch],
    ) -> Result<StepReport> {
        Ok(match &mut self.split {
            None => trainer.step(model, &mut *self.world, batches)?,
            Some(p) => {
                let tp = p.tp.as_deref_mut().map(|c| c as &mut dyn Communicator);
                let cp = p.cp.as_deref_mut().map(|c| c as &mut dyn Communicator);
                trainer.step_pipeline(model, &p.stage, p.dp.as_mut(), p.pipe.as_mut(), (tp, cp), batches)?
            }
        })
    }

    /// The loss statistics of `batch` (forward only; with a split, through
    /// every stage and tensor rank of this rank's replica).
    pub fn loss<M: StagedModel<Batch = TokenBatch>>(
        &mut self,
        trainer: &mut Trainer,
        model: &mut M,
        batch: &TokenBatch,
    ) -> Result<MicroStepStats> {
        Ok(match &mut self.split {
            None => trainer.loss(model, &mut *self.world, batch)?,
            Some(p) => {
                let tp = p.tp.as_deref_mut().map(|c| c as &mut dyn Communicator);
                let cp = p.cp.as_deref_mut().map(|c| c as &mut dyn Communicator);
                trainer.loss_pipeline(model, &p.stage, p.dp.as_mut(), p.pipe.as_mut(), (tp, cp), batch)?
            }
        })
    }

    /// Errors unless the ranks holding the same parameters agree on them
    /// bit for bit (the world; with a split each part's data-parallel ranks,
    /// and each tensor group's copies of the tensors it replicates).
    pub fn check_params_agree(&mut self, trainer: &mut Trainer) -> Result<()> {
        trainer.check_params_agree(self.dp())?;
        if let Some(p) = &mut self.split {
            if let Some(tp) = p.tp.as_deref_mut() {
                trainer.check_replicas_agree(tp, &p.stage)?;
            }
        }
        Ok(())
    }

    /// The model-wide parameters on rank 0, `None` elsewhere: gathered
    /// within each part to its data rank 0, then over the pipeline of data
    /// rank 0 to stage 0, then over stage 0's tensor ranks to tensor rank
    /// 0 — the same buffer at any layout. Every rank that holds a shard of
    /// what is gathered takes part.
    pub fn full_params(&mut self, trainer: &mut Trainer) -> Result<Option<Vec<f32>>> {
        let local = trainer.full_params_to_rank0(self.dp())?;
        self.over_parts(local, false)
    }

    /// [`RankComms::full_params`] and the optimizer state by name, model-wide.
    pub fn full_state(&mut self, trainer: &mut Trainer) -> Result<Option<FullState>> {
        let params = self.full_params(trainer)?;
        let mut opt = Vec::new();
        for (name, local) in trainer.full_optimizer_state(self.dp(), false)? {
            // Data ranks other than 0 get empty buffers and skip the pipeline's gather.
            let full = if self.dp().rank() == 0 { self.over_parts(Some(local), true)? } else { None };
            opt.extend(full.map(|v| (name, v)));
        }
        Ok(params.map(|p| (p, opt)))
    }

    /// A part's buffer (`Some` on data rank 0 of the part) assembled
    /// model-wide on rank 0 over the pipeline and the tensor ranks; without
    /// a split as it is.
    fn over_parts(&mut self, local: Option<Vec<f32>>, grad_space: bool) -> Result<Option<Vec<f32>>> {
        let Some(p) = &mut self.split else { return Ok(local) };
        let Some(local) = local else { return Ok(None) };
        let (stage, pipe) = (&p.stage, p.pipe.as_mut());
        let tp = p.tp.as_deref_mut().map(|c| c as &mut dyn Communicator);
        Ok(stage.gather(pipe, tp, &local, grad_space)?)
    }
}
