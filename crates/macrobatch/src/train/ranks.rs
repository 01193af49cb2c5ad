//! Who a rank trains with: the whole world (no pipeline), or — with
//! `dist.pipeline_parallel = P` — the D ranks holding its stage (`dp`,
//! data-parallel) and the P ranks of its pipeline (`pipe`, one per stage,
//! passing activations and gradients). Every step, evaluation and
//! checkpoint gather of the loop goes through here, so the loop reads the
//! same with and without a pipeline; without one it calls exactly what it
//! did before pipelines existed.

use super::checkpointing::FullState;
use crate::setup::{trainer_placed, Placement, Plan};
use anyhow::{Context, Result};
use comm::Communicator;
use engine::{MicroStepStats, PipelineStage, StagedModel, StepReport, TokenBatch, Trainer};
use std::path::Path;

/// A rank's communicators and, in a pipeline, its stage.
pub struct RankComms<'a> {
    /// Every rank of the run (the stop agreement, heartbeats, memory report).
    pub world: &'a mut dyn Communicator,
    /// The pipeline side, when P > 1.
    pipeline: Option<StageComms>,
}

/// A pipeline rank: its stage and the groups it belongs to.
struct StageComms {
    stage: PipelineStage,
    /// The D ranks holding the same stage (the trainer's data-parallel group).
    dp: Box<dyn Communicator>,
    /// The P ranks of this rank's pipeline (same data rank, one per stage).
    pipe: Box<dyn Communicator>,
    data_rank: usize,
}

impl<'a> RankComms<'a> {
    /// The groups of `world`'s rank in `plan`'s grid (with a pipeline a
    /// collective: every rank splits the world twice, in the same order),
    /// and `model` cut to its stage (after its trainable flags are set).
    pub fn new<M: StagedModel>(plan: &Plan, model: &mut M, world: &'a mut dyn Communicator) -> Result<Self> {
        let grid = &plan.grid;
        if !grid.is_pipeline() {
            return Ok(Self { world, pipeline: None });
        }
        let rank = world.rank();
        let (stage, data_rank) = (grid.stage_of(rank), grid.data_rank_of(rank));
        let dp = world.split(stage, data_rank).context("cannot form the data-parallel group of a pipeline stage")?;
        let pipe = world.split(data_rank, stage).context("cannot form the pipeline group of a data rank")?;
        let stage = PipelineStage::new(model, &grid.cuts, stage, grid.schedule, plan.batch.accumulation_steps)?;
        Ok(Self { world, pipeline: Some(StageComms { stage, dp, pipe, data_rank }) })
    }

    /// This rank's data-parallel rank: which micro-batches it trains on.
    pub fn data_rank(&self) -> usize {
        self.pipeline.as_ref().map_or(self.world.rank(), |p| p.data_rank)
    }

    /// This rank's place in its data-parallel group.
    pub fn dp_rank(&self) -> usize {
        self.pipeline.as_ref().map_or(self.world.rank(), |p| p.dp.rank())
    }

    /// The trainer's data-parallel group: the world, or the ranks of this stage.
    pub fn dp(&mut self) -> &mut dyn Communicator {
        match &mut self.pipeline {
            Some(p) => p.dp.as_mut(),
            None => &mut *self.world,
        }
    }

    /// Bytes every communicator of this rank keeps for staging.
    pub fn buffer_bytes(&self) -> usize {
        let own = self.pipeline.as_ref().map_or(0, |p| p.dp.buffer_bytes() + p.pipe.buffer_bytes());
        self.world.buffer_bytes() + own
    }

    /// This rank's trainer over the whole model or its stage, from `initial`
    /// model-wide parameters (a checkpoint's at any pipeline width, or a
    /// pretrained model's) or a fresh initialisation.
    pub fn trainer<M: StagedModel>(
        &mut self,
        plan: &Plan,
        model: &M,
        initial: Option<&[f32]>,
        offload_root: &Path,
    ) -> Result<Trainer> {
        let world_rank = self.world.rank();
        let placement = match &mut self.pipeline {
            None => Placement::Whole(&mut *self.world),
            Some(p) => Placement::Stage { stage: &p.stage, dp: p.dp.as_mut() },
        };
        trainer_placed(plan, model, placement, initial, offload_root, world_rank)
    }

    /// This rank's part of a model-wide gradient-space buffer (a
    /// checkpoint's optimizer state): all of it without a pipeline.
    pub fn own_state(&self, full: &[f32]) -> Result<Vec<f32>> {
        Ok(match &self.pipeline {
            None => full.to_vec(),
            Some(p) => p.stage.take(full, true)?,
        })
    }

    /// Whether this rank evaluates: rank 0, or every rank where evaluation
    /// is a collective (ZeRO-3 gathers segments; a pipeline's stages pass
    /// activations: the pipeline of data rank 0).
    pub fn evaluates(&self, zero3: bool) -> bool {
        match &self.pipeline {
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
        Ok(match &mut self.pipeline {
            None => trainer.step(model, &mut *self.world, batches)?,
            Some(p) => trainer.step_pipeline(model, &p.stage, p.dp.as_mut(), p.pipe.as_mut(), None, batches)?,
        })
    }

    /// The loss statistics of `batch` (forward only; with a pipeline,
    /// through every stage of this rank's pipeline).
    pub fn loss<M: StagedModel<Batch = TokenBatch>>(
        &mut self,
        trainer: &mut Trainer,
        model: &mut M,
        batch: &TokenBatch,
    ) -> Result<MicroStepStats> {
        Ok(match &mut self.pipeline {
            None => trainer.loss(model, &mut *self.world, batch)?,
            Some(p) => trainer.loss_pipeline(model, &p.stage, p.dp.as_mut(), p.pipe.as_mut(), None, batch)?,
        })
    }

    /// Errors unless the ranks holding the same parameters agree on them
    /// bit for bit (the world; with a pipeline each stage's ranks).
    pub fn check_params_agree(&mut self, trainer: &mut Trainer) -> Result<()> {
        Ok(trainer.check_params_agree(self.dp())?)
    }

    /// The model-wide parameters on rank 0, `None` elsewhere: gathered
    /// within each stage to its data rank 0, then over the pipeline of
    /// data rank 0 to stage 0 — the same buffer at any pipeline width.
    /// Every rank that holds a shard of what is gathered takes part.
    pub fn full_params(&mut self, trainer: &mut Trainer) -> Result<Option<Vec<f32>>> {
        let local = trainer.full_params_to_rank0(self.dp())?;
        self.over_pipeline(local, false)
    }

    /// [`RankComms::full_params`] and the optimizer state by name, model-wide.
    pub fn full_state(&mut self, trainer: &mut Trainer) -> Result<Option<FullState>> {
        let params = self.full_params(trainer)?;
        let mut opt = Vec::new();
        for (name, local) in trainer.full_optimizer_state(self.dp(), false)? {
            // Data ranks other than 0 get empty buffers and skip the pipeline's gather.
            let full = if self.dp().rank() == 0 { self.over_pipeline(Some(local), true)? } else { None };
            opt.extend(full.map(|v| (name, v)));
        }
        Ok(params.map(|p| (p, opt)))
    }

    /// A stage's buffer (`Some` on data rank 0 of the stage) assembled
    /// model-wide on stage 0 over the pipeline; without a pipeline as it is.
    fn over_pipeline(&mut self, local: Option<Vec<f32>>, grad_space: bool) -> Result<Option<Vec<f32>>> {
        let Some(p) = &mut self.pipeline else { return Ok(local) };
        let Some(local) = local else { return Ok(None) };
        Ok(p.stage.gather(p.pipe.as_mut(), None, &local, grad_space)?)
    }
}
