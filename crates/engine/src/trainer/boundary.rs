//! What runs once per optimizer step after the micro-steps: the gradient
//! collective, the global norm, the optimizer update of this rank's pieces
//! and sharing the updated parameters.

use super::clip::clip_coefficient;
use super::clip::{grad_norm, sum_of_squares};
use super::{Accumulated, Groups, LossNormalization, Seeds, StepReport, Trainer};
use crate::error::EngineError;
use crate::layout::ParamLayout;
use crate::optim::{aligned_chunks, slices_mut, Piece, StateRun, StateRuns};
use crate::zero::{buckets, Accumulation, Partition, Reduction, UpdateSharding};
use comm::Communicator;
use std::ops::Range;

impl Trainer {
    /// Everything that runs exactly once per optimizer step, after the
    /// micro-steps: the statistics, the gradient collective, the global
    /// norm, the f16 skip decision, clipping, the update and sharing.
    /// With a pipeline, statistics come from the last stage (the others
    /// contribute zeros), tied-embedding gradients are summed between the
    /// first and last stage, and the norm is summed over the stages.
    pub(super) fn boundary(
        &mut self,
        groups: &mut Groups<'_>,
        mut acc: Accumulated,
        seeds: &Seeds,
        loss_scale: f32,
        before: comm::CommCounters,
    ) -> Result<StepReport, EngineError> {
        let step_idx = self.n_steps;
        if groups.tp.is_some() && matches!(self.optimizer, crate::Optimizer::Adafactor(_)) {
            return Err(EngineError::Optimizer(
                "adafactor's row and column statistics are sums over whole tensors, and tensor parallelism splits tensors over ranks whose sums are not added; set dist.tensor_parallel = 1 (ZeRO shards adafactor's state) or use another optim.name".into(),
            ));
        }
        let comm_err = |source| EngineError::Comm { step: step_idx + 1, source };
        let n_micro = acc.loss_sums.len();
        let dp_world = groups.dp.world_size();
        let micro_losses = acc.micro_losses(groups).map_err(comm_err)?;
        let micro_mean_sum: f64 = micro_losses.iter().filter(|l| l.is_finite()).sum();
        let n_valid_micro = micro_losses.iter().filter(|l| l.is_finite()).count();
        let (loss_sum, n_targets) = (acc.loss_sums.iter().sum::<f64>(), acc.n_targets.iter().sum::<u64>());
        // One collective for the loss statistics, the loss terms' sum and the model's own sums.
        // + under overlap_comm, its order of collectives, which every rank must share.
        let overlapped = self.overlap.as_ref().is_some_and(|o| o.in_step());
        let order = 5 + crate::AUX_STATS;
        let mut stats = vec![0.0; order + if overlapped { 2 } else { 0 }];
        if let (true, Some(o)) = (overlapped, self.overlap.as_ref()) {
            stats[order..].copy_from_slice(&o.order_check());
        }
        if groups.pipe.as_ref().is_none_or(|p| p.info.last()) {
            stats[..5].copy_from_slice(&[
                loss_sum,
                n_targets as f64,
                micro_mean_sum,
                n_valid_micro as f64,
                acc.aux_sum,
            ]);
            stats[5..order].copy_from_slice(&acc.aux);
        }
        groups.all_reduce_f64(&mut stats).map_err(comm_err)?;
        let [loss_sum, n_targets, micro_mean_sum, n_valid_micro, aux_sum] =
            [stats[0], stats[1], stats[2], stats[3], stats[4]];
        let mut aux = [0.0; crate::AUX_STATS];
        aux.copy_from_slice(&stats[5..order]);
        if overlapped {
            let (sum, squares) = (stats[order], stats[order + 1]);
            if dp_world as f64 * squares != sum * sum {
                return Err(EngineError::OverlapOrder { step: step_idx + 1 });
            }
        }
        let n_targets = n_targets as u64;
        let loss = match self.options.normalization {
            LossNormalization::Token if n_targets > 0 => loss_sum / n_targets as f64,
            LossNormalization::MicroBatchMean if n_valid_micro > 0.0 => micro_mean_sum / (n_micro * dp_world) as f64,
            _ => return Err(EngineError::NoTargets { step: step_idx + 1 }),
        };
        // What turns the accumulated buffer into the gradient of the mean
        // loss: what the seeds left to do, and the loss scale undone
        // (unscaled before the norm, and so before clipping).
        let normalize = match (self.options.normalization, seeds.divided_by_targets) {
            (LossNormalization::Token, false) => 1.0 / n_targets as f64,
            _ => 1.0,
        } / loss_scale as f64;

        self.sum_tied_gradients(groups).map_err(comm_err)?;
        self.sum_partial_gradients(groups.tp.as_mut()).map_err(comm_err)?;
        match self.overlap.as_mut() {
            // Under the backward: wait for what is in flight, start the rest.
            Some(o) if o.in_step() => acc.overlap = Some(o.finish(&self.part, &mut self.grads, step_idx + 1)?),
            _ => self.reduce_gradients(groups.dp).map_err(comm_err)?,
        }
        let grad_norm = match groups.pipe.as_mut() {
            None => self.global_norm(groups.dp),
            Some(p) => self.pipeline_norm(groups.dp, p, groups.tp.as_mut()),
        }
        .map_err(comm_err)?
            * normalize;
        let (pipeline, tensor, context, overlap) = (acc.pipeline, acc.tensor, acc.context, acc.overlap);
        let waited = overlap.as_ref().map_or(0.0, |o| o.waited_s);
        let report = |grad_norm, clipped, skipped, lr, groups: &Groups<'_>| {
            let after = groups.dp.counters();
            StepReport {
                step_idx,
                loss,
                aux_loss: if n_targets > 0 { aux_sum / n_targets as f64 } else { 0.0 },
                micro_losses: micro_losses.clone(),
                n_targets,
                aux,
                n_micro_steps: n_micro,
                grad_norm,
                clipped,
                lr,
                comm_bytes: after.bytes_sent - before.bytes_sent + overlap.as_ref().map_or(0, |o| o.bytes),
                comm_calls: after.n_calls - before.n_calls + overlap.as_ref().map_or(0, |o| o.collectives.len() as u64),
                comm_s: (after.collective_ns - before.collective_ns) as f64 * 1e-9 + waited,
                model_s: acc.model_s,
                step_stats_s: acc.step_stats_s,
                step_stats: acc.step_stats.clone(),
                skipped,
                loss_scale,
                pipeline: pipeline.clone(),
                tensor,
                context,
                overlap: overlap.clone(),
            }
        };
        if !grad_norm.is_finite() {
            // The norm is global (all ranks reduced the same values), so every
            // rank takes this branch together: under f16 the step is skipped —
            // no parameter, optimizer state or schedule position changes.
            let Some(scaler) = self.scaler.as_mut() else {
                return Err(EngineError::NonFiniteGradient { step: step_idx + 1, norm: grad_norm });
            };
            scaler.update(true);
            return Ok(report(grad_norm, false, true, self.schedule.lr(step_idx), groups));
        }
        let clip_coef = self.options.grad_clip.map_or(1.0, |max_norm| clip_coefficient(grad_norm, max_norm));
        self.grad_scale = (normalize * clip_coef) as f32;
        let lr = self.schedule.lr(step_idx);
        self.apply_update(lr, groups.dp)?;
        self.share_updated_params(groups.dp).map_err(comm_err)?;
        if let Some(s) = self.scaler.as_mut() {
            s.update(false);
        }
        self.n_steps += 1;
        Ok(report(grad_norm, clip_coef < 1.0, false, lr, groups))
    }

    /// The boundary's gradient collective: afterwards `self.grads` holds
    /// this rank's part of the global sum (all of it after an all-reduce).
    pub(super) fn reduce_gradients(&mut self, comm: &mut dyn Communicator) -> Result<(), comm::CommError> {
        crate::profile::timed(crate::profile::Kind::Collective, || {
            match self.zero_stage.reduction() {
                Reduction::AllReduce => {
                    for bucket in buckets(self.grads.len(), self.options.bucket_elems) {
                        comm.all_reduce_sum(&mut self.grads[bucket])?;
                    }
                }
                Reduction::ReduceScatter => {
                    // Each segment: pack, reduce-scatter, and this rank's reduced
                    // piece back into its own range of the local buffer.
                    let w = self.part.world_size;
                    for j in 0..self.part.n_segments() {
                        let t = self.part.grad_piece[j];
                        if t == 0 {
                            continue; // nothing trainable: no communication
                        }
                        self.part.pack_segment_grads(j, &self.grads, &mut self.scratch);
                        let mut out = vec![0.0; t];
                        comm.reduce_scatter_sum(&self.scratch[..t * w], &mut out)?;
                        self.part.place_reduced(j, &out, &mut self.grads);
                    }
                }
                Reduction::Done => {}
            }
            Ok(())
        })
    }

    /// The L2 norm of the global (reduced, unnormalised) gradient: local
    /// when every rank holds all of it, else a sum of the shards' squares.
    pub(super) fn global_norm(&self, comm: &mut dyn Communicator) -> Result<f64, comm::CommError> {
        if self.zero_stage.reduction() == Reduction::AllReduce {
            return Ok(grad_norm(&self.grads));
        }
        let mut sq = [match self.zero_stage.accumulation() {
            Accumulation::PerSegment => sum_of_squares(&self.grads),
            Accumulation::Local => (0..self.part.n_segments())
                .map(|j| sum_of_squares(&self.grads[self.part.grad_owned(j, self.part.rank)]))
                .sum(),
        }];
        comm.all_reduce_sum_f64(&mut sq)?;
        Ok(sq[0].sqrt())
    }

    /// The optimizer update of this rank's part (every trainable parameter
    /// at stage 0), reading the gradient scaled by `grad_scale`; sums an
    /// optimizer needs over the ranks sharing its state (Adafactor's
    /// statistics at stages ≥ 1) go over `comm`.
    pub(super) fn apply_update(&mut self, lr: f32, comm: &mut dyn Communicator) -> Result<(), EngineError> {
        let step = self.n_steps + 1;
        let mut sum =
            |buf: &mut [f64]| comm.all_reduce_sum_f64(buf).map_err(|source| EngineError::Comm { step, source });
        let reduce: Option<crate::optim::SumOverRanks<'_>> = self.zero_stage.shards_optimizer().then_some(&mut sum);
        crate::profile::timed(crate::profile::Kind::Optimizer, || {
            let ranges: Vec<Range<usize>> = self.update.iter().map(|c| c.params.clone()).collect();
            let grads = &self.grads;
            let pieces: Vec<Piece<'_>> = slices_mut(&mut self.params, &ranges)
                .into_iter()
                .zip(&self.update)
                .map(|(params, c)| Piece {
                    params,
                    grads: &grads[c.grads..c.grads + c.params.len()],
                    state: c.state..c.state + c.params.len(),
                    decay: c.decay,
                })
                .collect();
            match self.offload.as_mut() {
                Some(disk) => self.optimizer.update_offloaded(pieces, lr, self.grad_scale, disk, reduce),
                None => self.optimizer.update_pieces(pieces, lr, self.grad_scale, reduce),
            }
        })
    }

    /// After the update: stages 1–2 all-gather every rank's updated
    /// (trainable) pieces of each segment into every rank's parameters — the
    /// f32 ones, or under mixed precision the 16-bit copy the model reads;
    /// stage 0 re-encodes its 16-bit copy; stage 3 keeps only its shard.
    pub(super) fn share_updated_params(&mut self, comm: &mut dyn Communicator) -> Result<(), comm::CommError> {
        if !self.zero_stage.gathers_after_update() {
            if let Some(c) = self.model_copy.as_mut() {
                let (space, prec) = (&self.part.space, self.options.precision);
                if space.n_grads == self.params.len() {
                    prec.encode(&self.params, &mut c.bits);
                } else {
                    // Frozen values never change: their 16-bit copy stays
                    // (a LoRA run's base is most of the buffer).
                    for j in 0..space.segments.len() {
                        for (r, _, _) in space.trainable_runs(j, space.segments[j].clone()) {
                            prec.encode(&self.params[r.clone()], &mut c.bits[r]);
                        }
                    }
                }
                c.stale();
            }
            return Ok(());
        }
        let (w, rank, sharded) = (self.part.world_size, self.part.rank, self.master_sharded());
        for j in 0..self.part.n_segments() {
            let t = self.part.grad_piece[j];
            if t == 0 {
                continue; // frozen: never changes
            }
            // This rank's trainable values, packed like its gradient piece.
            let own = self.part.owned(j, rank);
            let mut mine = vec![0.0; t];
            let mut at = 0;
            for (pr, _, _) in self.part.space.trainable_runs(j, own.clone()) {
                let src = if sharded { self.part.shard_range(j).start + (pr.start - own.start) } else { pr.start };
                mine[at..at + pr.len()].copy_from_slice(&self.params[src..src + pr.len()]);
                at += pr.len();
            }
            let mut all = vec![0.0; t * w];
            comm.all_gather(&mine, &mut all)?;
            for r in 0..w {
                let mut at = r * t;
                for (pr, _, _) in self.part.space.trainable_runs(j, self.part.owned(j, r)) {
                    let vals = &all[at..at + pr.len()];
                    match self.model_copy.as_mut() {
                        Some(c) if sharded => self.options.precision.encode(vals, &mut c.bits[pr.clone()]),
                        _ => self.params[pr.clone()].copy_from_slice(vals),
                    }
                    at += pr.len();
                }
            }
        }
        if let Some(c) = self.model_copy.as_mut() {
            if !sharded {
                self.options.precision.encode(&self.params, &mut c.bits);
            }
            c.stale();
        }
        Ok(())
    }
}

/// One piece of this rank's optimizer update: where its parameters,
/// gradient and optimizer state live, and whether weight decay applies.
#[derive(Debug, Clone)]
pub(super) struct UpdateChunk {
    params: Range<usize>,
    grads: usize,
    state: usize,
    decay: bool,
}

/// The pieces of this rank's update, at most CHUNK elements each (the unit
/// of parallel work), fixed for the trainer's life: cut where the segment
/// offset is a multiple of CHUNK, so a piece holds whole 8-bit blocks.
pub(super) fn update_chunks(part: &Partition, layout: &ParamLayout, sharding: UpdateSharding) -> Vec<UpdateChunk> {
    let runs = part.update_runs(sharding);
    let mut chunks = Vec::with_capacity(runs.len());
    for r in runs {
        let decay = layout.tensors()[r.tensor].decay;
        for (at, m) in aligned_chunks(r.seg_at, r.len) {
            chunks.push(UpdateChunk {
                params: r.param + at..r.param + at + m,
                grads: r.grad + at,
                state: r.state + at,
                decay,
            });
        }
    }
    chunks
}

/// This rank's optimizer state as runs of tensors, in state order, and
/// every trainable tensor in gradient-space order: what a blockwise or
/// factored optimizer cuts its state by.
pub(super) fn state_runs(part: &Partition, layout: &ParamLayout, sharding: UpdateSharding) -> StateRuns {
    // Layout index → position among the trainable tensors (gradient-space order).
    let mut index = vec![usize::MAX; layout.tensors().len()];
    let mut tensors = Vec::new();
    for j in 0..part.n_segments() {
        for t in &part.space.tensors[j] {
            if t.grad_rel.is_some() {
                index[t.idx] = tensors.len();
                tensors.push(layout.tensors()[t.idx].shape.clone());
            }
        }
    }
    let runs = part
        .update_runs(sharding)
        .into_iter()
        .map(|r| StateRun {
            state: r.state..r.state + r.len,
            shape: layout.tensors()[r.tensor].shape.clone(),
            at: r.at,
            seg_at: r.seg_at,
            tensor: index[r.tensor],
        })
        .collect();
    StateRuns { runs, tensors }
}
