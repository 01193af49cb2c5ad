//! The full training state across ranks: parameters, gradients and
//! optimizer state gathered from every rank's shard for checkpoints and
//! checks, and restored from full buffers (each rank keeps its pieces).

use super::Trainer;
use crate::alloc::{try_copy, try_zeros};
use crate::error::EngineError;
use crate::zero::{Accumulation, Reduction};
use comm::Communicator;

impl Trainer {
    /// Every parameter, assembled from the shards where sharded (a
    /// collective there: every rank must call it).
    pub fn full_params(&mut self, comm: &mut dyn Communicator) -> Result<Vec<f32>, EngineError> {
        if !self.master_sharded() {
            return Ok(self.params.clone());
        }
        self.gather_params(comm, true)
    }

    /// [`Trainer::full_params`] for rank 0 only: the other ranks take part in
    /// the collectives but never hold more than one segment (`None`).
    pub fn full_params_to_rank0(&mut self, comm: &mut dyn Communicator) -> Result<Option<Vec<f32>>, EngineError> {
        let keep = comm.rank() == 0;
        if !self.master_sharded() {
            return Ok(if keep { Some(try_copy(&self.params, "the full parameters")?) } else { None });
        }
        let full = self.gather_params(comm, keep)?;
        Ok(keep.then_some(full))
    }

    /// Assembles every parameter from every rank's parameter shard.
    fn gather_params(&self, comm: &mut dyn Communicator, keep: bool) -> Result<Vec<f32>, EngineError> {
        let mut full = try_zeros(if keep { self.layout.n_params() } else { 0 }, "the full parameters")?;
        let w = self.part.world_size;
        for j in 0..self.part.n_segments() {
            let seg = self.part.segment(j);
            let mut buf = vec![0.0; self.part.piece[j] * w];
            comm.all_gather(&self.params[self.part.shard_range(j)], &mut buf)
                .map_err(|source| EngineError::Comm { step: self.n_steps, source })?;
            if keep {
                full[seg.clone()].copy_from_slice(&buf[..seg.len()]);
            }
        }
        Ok(full)
    }

    /// Assembles a full gradient-space buffer from every rank's gradient shard.
    fn gather_grad_space(
        &self,
        comm: &mut dyn Communicator,
        shard: &[f32],
        keep: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let mut full = try_zeros(if keep { self.part.space.n_grads } else { 0 }, "a full gradient-space buffer")?;
        let w = self.part.world_size;
        for j in 0..self.part.n_segments() {
            let t = self.part.grad_piece[j];
            if t == 0 {
                continue;
            }
            let mut buf = vec![0.0; t * w];
            comm.all_gather(&shard[self.part.grad_shard_range(j)], &mut buf)
                .map_err(|source| EngineError::Comm { step: self.n_steps, source })?;
            if keep {
                for r in 0..w {
                    let own = self.part.grad_owned(j, r);
                    full[own.clone()].copy_from_slice(&buf[r * t..r * t + own.len()]);
                }
            }
        }
        Ok(full)
    }

    /// The gradient the last optimizer step applied (normalised and
    /// clipped), in the gradient space: all of it with local accumulation
    /// (for stage 2 only this rank's pieces are reduced), this rank's
    /// shard with per-segment reduction.
    pub fn gradient(&self) -> Vec<f32> {
        let s = self.grad_scale;
        self.grads.iter().map(|g| g * s).collect()
    }

    /// The full gradient the last step applied, in the gradient space,
    /// assembled from the shards at stages ≥ 2 (a collective there: every
    /// rank must call it).
    pub fn full_gradient(&mut self, comm: &mut dyn Communicator) -> Result<Vec<f32>, EngineError> {
        let raw = match (self.zero_stage.reduction(), self.zero_stage.accumulation()) {
            (Reduction::AllReduce, _) => return Ok(self.gradient()),
            (_, Accumulation::Local) => {
                let mut shard = vec![0.0; self.part.grad_shard_len()];
                self.part.gather_own_grads(&self.grads, &mut shard);
                self.gather_grad_space(comm, &shard, true)?
            }
            (_, Accumulation::PerSegment) => self.gather_grad_space(comm, &self.grads, true)?,
        };
        Ok(raw.into_iter().map(|g| g * self.grad_scale).collect())
    }

    /// The full optimizer state by name, in the gradient space (trainable
    /// tensors only), assembled from every rank's shard (a collective at
    /// stages ≥ 1), for checkpoints; ranks other than 0 get empty buffers
    /// unless `all_ranks`.
    pub fn full_optimizer_state(
        &mut self,
        comm: &mut dyn Communicator,
        all_ranks: bool,
    ) -> Result<Vec<(String, Vec<f32>)>, EngineError> {
        let keep = all_ranks || comm.rank() == 0;
        let mut out = Vec::new();
        // Made once: 8-bit codes and Adafactor's statistics are built here.
        let on_disk = self.optimizer.element_slot_names();
        // Offloaded, only the replicated slots are still in memory.
        let mem = match self.offload {
            None => self.optimizer.state_buffers(),
            Some(_) => self.optimizer.replicated_state_buffers(),
        };
        for name in self.optimizer.slot_names() {
            let disk = match self.offload.as_mut() {
                Some(d) if on_disk.contains(&name) => Some(d.read_all(name)?),
                _ => None,
            };
            let buf = match &disk {
                Some(v) => v.as_slice(),
                None => mem.iter().find(|(n, _)| *n == name).map_or(&[][..], |b| &b.1[..]),
            };
            // A replicated slot is whole on every rank: no gather.
            let full = if self.zero_stage.shards_optimizer() && !self.optimizer.is_replicated_slot(name) {
                self.gather_grad_space(comm, buf, keep)?
            } else {
                try_copy(buf, "the full optimizer state")?
            };
            out.push((name.to_string(), full));
        }
        Ok(out)
    }

    /// Restores a checkpointed state from full buffers (each rank keeps its
    /// pieces): parameters, optimizer state (gradient space) and the number
    /// of steps taken.
    pub fn restore(
        &mut self,
        params: Vec<f32>,
        n_steps: u64,
        n_updates: u64,
        optimizer_state: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        if params.len() != self.layout.n_params() {
            return Err(EngineError::ParamCount { expected: self.layout.n_params(), got: params.len() });
        }
        self.restore_optimizer(n_steps, n_updates, optimizer_state)?;
        self.set_params(params)
    }

    /// [`Trainer::restore`] for a trainer already built from the
    /// checkpoint's parameters: the optimizer state and the schedule position.
    pub fn restore_optimizer(
        &mut self,
        n_steps: u64,
        n_updates: u64,
        mut optimizer_state: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        let (part, sharded, n_grads) = (&self.part, self.zero_stage.shards_optimizer(), self.part.space.n_grads);
        let names = self.optimizer.slot_names();
        let replicated: Vec<&str> = names.iter().copied().filter(|n| self.optimizer.is_replicated_slot(n)).collect();
        // A replicated slot is kept whole by every rank.
        let shard_of = |name: &str, full: Vec<f32>| {
            if !sharded || replicated.contains(&name) {
                return full;
            }
            let mut shard = vec![0.0; part.grad_shard_len()];
            part.gather_own_grads(&full, &mut shard);
            shard
        };
        if let Some(disk) = self.offload.as_mut() {
            for (i, name) in self.optimizer.element_slot_names().into_iter().enumerate() {
                let full = optimizer_state(name).ok_or(EngineError::MissingState { name })?;
                if full.len() != n_grads {
                    return Err(EngineError::ParamCount { expected: n_grads, got: full.len() });
                }
                disk.write_all(i, &shard_of(name, full))?;
            }
            if replicated.is_empty() {
                self.optimizer.set_n_updates(n_updates);
                self.n_steps = n_steps;
                return Ok(());
            }
        }
        // In memory: every slot, or with the state offloaded the replicated ones.
        let mut err = None;
        self.optimizer.restore(n_updates, |name| {
            let full = optimizer_state(name)?;
            if full.len() != n_grads {
                err = Some(EngineError::ParamCount { expected: n_grads, got: full.len() });
                return None;
            }
            Some(shard_of(name, full))
        })?;
        if let Some(e) = err {
            return Err(e);
        }
        self.n_steps = n_steps;
        Ok(())
    }

    /// Replaces the parameters (e.g. `--init-from` a pretrained model, or a
    /// checkpoint) from a full buffer; each rank keeps what it holds.
    pub fn set_params(&mut self, params: Vec<f32>) -> Result<(), EngineError> {
        if params.len() != self.layout.n_params() {
            return Err(EngineError::ParamCount { expected: self.layout.n_params(), got: params.len() });
        }
        if let Some(c) = self.model_copy.as_mut() {
            self.options.precision.encode(&params, &mut c.bits);
            c.stale();
        }
        self.params = if self.master_sharded() {
            let mut shard = vec![0.0; self.part.shard_len()];
            self.part.gather_own(&params, &mut shard);
            shard
        } else {
            params
        };
        Ok(())
    }

    /// FNV-1a hash of the resident parameter bits.
    pub fn params_checksum(&self) -> u64 {
        fnv1a(self.params.iter().flat_map(|x| x.to_bits().to_le_bytes()))
    }

    /// Errors unless every rank holds bit-identical parameters (stages 0–2;
    /// at stage 3 each rank holds a different shard by design).
    pub fn check_params_agree(&mut self, comm: &mut dyn Communicator) -> Result<(), EngineError> {
        if self.zero_stage.shards_parameters() {
            return Ok(());
        }
        let h = match (&self.model_copy, self.master_sharded()) {
            // Mixed precision, stages 1–2: the replicated 16-bit copy must agree.
            (Some(c), true) => fnv1a(c.bits.iter().flat_map(|x| x.to_le_bytes())),
            _ => self.params_checksum(),
        };
        agree_on(comm, h, self.n_steps)
    }

    /// Errors unless the tensor-parallel ranks of `stage` hold bit-identical
    /// copies of every tensor they replicate (`dist.check_every`'s check
    /// across the tensor group; split pieces differ by design). Stages 0–1.
    pub fn check_replicas_agree(
        &mut self,
        tp: &mut dyn Communicator,
        stage: &crate::trainer::PipelineStage,
    ) -> Result<(), EngineError> {
        if stage.tensor_shards().is_none() || self.zero_stage.shards_parameters() {
            return Ok(());
        }
        let ranges: Vec<std::ops::Range<usize>> = self
            .layout
            .tensors()
            .iter()
            .zip(stage.stage_shards())
            .filter(|(_, s)| s.is_replicated())
            .map(|(t, _)| t.range())
            .collect();
        let h = match (&self.model_copy, self.master_sharded()) {
            (Some(c), true) => {
                fnv1a(ranges.iter().flat_map(|r| c.bits[r.clone()].iter().flat_map(|x| x.to_le_bytes())))
            }
            _ => {
                fnv1a(ranges.iter().flat_map(|r| self.params[r.clone()].iter().flat_map(|x| x.to_bits().to_le_bytes())))
            }
        };
        agree_on(tp, h, self.n_steps)
    }
}

/// Errors unless every rank of `comm` has the checksum `h` (an all-gather
/// of four 16-bit pieces: exact in f32, so the hash travels losslessly).
fn agree_on(comm: &mut dyn Communicator, h: u64, step: u64) -> Result<(), EngineError> {
    let mine: Vec<f32> = (0..4).map(|i| ((h >> (16 * i)) & 0xffff) as f32).collect();
    let mut all = vec![0.0f32; 4 * comm.world_size()];
    comm.all_gather(&mine, &mut all).map_err(|source| EngineError::Comm { step, source })?;
    let checksums: Vec<u64> =
        all.chunks(4).map(|c| c.iter().enumerate().fold(0u64, |h, (i, &x)| h | ((x as u64) << (16 * i)))).collect();
    if checksums.iter().any(|&c| c != checksums[0]) {
        return Err(EngineError::RanksDiverged { step, checksums });
    }
    Ok(())
}

fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}
