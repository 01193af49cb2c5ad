//! The full training state across ranks: parameters, gradients and
//! optimizer state gathered from every rank's shard for checkpoints and
//! checks, and restored from full buffers (each rank keeps its pieces).

use super::Trainer;
use crate::alloc::{try_copy, try_zeros};
use crate::error::EngineError;
use crate::zero::{Accumulation, Reduction};
use comm::Communicator;
use std::ops::Range;

/// A buffer a rank holds its part of: the parameters, or an optimizer slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held<'a> {
    /// The f32 (master) parameters.
    Params,
    /// The optimizer's slot of this name.
    Slot(&'a str),
}

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
        let sharded: Vec<bool> = self.optimizer.slot_names().iter().map(|n| self.slot_sharded(n)).collect();
        self.each_resident_slot(|t, name, buf| {
            // A replicated slot is whole on every rank: no gather.
            let full = match sharded[out.len()] {
                true => t.gather_grad_space(comm, buf, keep)?,
                false => try_copy(buf, "the full optimizer state")?,
            };
            out.push((name.to_string(), full));
            Ok(())
        })?;
        Ok(out)
    }

    /// Calls `f` with the trainer, each optimizer slot's name and the values this rank
    /// holds of it (its shard where the state is sharded), in slot order.
    pub fn each_resident_slot(
        &mut self,
        mut f: impl FnMut(&Trainer, &'static str, &[f32]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
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
            f(self, name, buf)?;
        }
        Ok(())
    }

    /// Whether optimizer slot `name` is held as this rank's shard (else
    /// whole, on every rank).
    fn slot_sharded(&self, name: &str) -> bool {
        self.zero_stage.shards_optimizer() && !self.optimizer.is_replicated_slot(name)
    }

    /// The parameters this rank holds: its shard where the master weights
    /// are sharded, else all of its layout's.
    pub fn resident_params(&self) -> &[f32] {
        &self.params
    }

    /// Where the values of buffer `held` that this rank holds come from in
    /// its layout's space (parameters, or the gradient space for a slot):
    /// `(range, offset in the held buffer)`, and the held buffer's length.
    pub fn resident_runs(&self, held: Held<'_>) -> (Vec<(Range<usize>, usize)>, usize) {
        let p = &self.part;
        match held {
            Held::Params if self.master_sharded() => {
                ((0..p.n_segments()).map(|j| (p.owned(j, p.rank), p.shard_range(j).start)).collect(), p.shard_len())
            }
            Held::Params => (vec![(0..self.layout.n_params(), 0)], self.layout.n_params()),
            Held::Slot(n) if self.slot_sharded(n) => (
                (0..p.n_segments()).map(|j| (p.grad_owned(j, p.rank), p.grad_shard_range(j).start)).collect(),
                p.grad_shard_len(),
            ),
            Held::Slot(_) => (vec![(0..p.space.n_grads, 0)], p.space.n_grads),
        }
    }

    /// This rank's share of buffer `held` among the `dp_size` ranks
    /// holding the same layout (it is data rank `dp_rank`): its ZeRO piece
    /// of each segment — the part it writes of a sharded checkpoint, so
    /// that the ranks write in parallel, each value once. `(range in the
    /// layout's space, offset in the held buffer)`.
    pub fn share_runs(&self, held: Held<'_>, dp_rank: usize, dp_size: usize) -> Vec<(Range<usize>, usize)> {
        let (sharded, grads) = match held {
            Held::Params => (self.master_sharded(), false),
            Held::Slot(n) => (self.slot_sharded(n), true),
        };
        // Replicated buffers are cut as ZeRO would cut them.
        let cut;
        let p = match self.part.world_size == dp_size {
            true => &self.part,
            false => {
                cut = crate::zero::Partition::new(self.part.space.clone(), dp_rank, dp_size);
                &cut
            }
        };
        (0..p.n_segments())
            .map(|j| match (grads, sharded) {
                (false, true) => (p.owned(j, dp_rank), p.shard_range(j).start),
                (false, false) => (p.owned(j, dp_rank), p.owned(j, dp_rank).start),
                (true, true) => (p.grad_owned(j, dp_rank), p.grad_shard_range(j).start),
                (true, false) => (p.grad_owned(j, dp_rank), p.grad_owned(j, dp_rank).start),
            })
            .filter(|(r, _)| !r.is_empty())
            .collect()
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
        let (part, n_grads) = (self.part.clone(), self.part.space.n_grads);
        let sharded: Vec<(&str, bool)> =
            self.optimizer.slot_names().into_iter().map(|n| (n, self.slot_sharded(n))).collect();
        let mut err = None;
        let restored = self.restore_optimizer_resident(n_steps, n_updates, |name| {
            let full = optimizer_state(name)?;
            if full.len() != n_grads {
                err = Some(EngineError::ParamCount { expected: n_grads, got: full.len() });
                return None;
            }
            // A replicated slot is kept whole by every rank.
            if !sharded.iter().any(|&(n, s)| n == name && s) {
                return Some(full);
            }
            let mut shard = vec![0.0; part.grad_shard_len()];
            part.gather_own_grads(&full, &mut shard);
            Some(shard)
        });
        // A slot of the wrong length, not the missing slot it became.
        err.map_or(restored, Err)
    }

    /// [`Trainer::restore_optimizer`] from the values this rank holds of
    /// each slot (laid out as [`Trainer::resident_runs`] says: its shard,
    /// padding zero, where the state is sharded).
    pub fn restore_optimizer_resident(
        &mut self,
        n_steps: u64,
        n_updates: u64,
        mut resident: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        let names = self.optimizer.slot_names();
        let lens: Vec<(&str, usize)> = names.iter().map(|&n| (n, self.resident_runs(Held::Slot(n)).1)).collect();
        let mut check = |name: &str| -> Result<Vec<f32>, EngineError> {
            let (name, want) = lens.iter().copied().find(|(n, _)| *n == name).unwrap_or(("?", 0));
            let v = resident(name).ok_or(EngineError::MissingState { name })?;
            match v.len() == want {
                true => Ok(v),
                false => Err(EngineError::ParamCount { expected: want, got: v.len() }),
            }
        };
        let replicated = names.iter().any(|n| self.optimizer.is_replicated_slot(n));
        if let Some(disk) = self.offload.as_mut() {
            for (i, name) in self.optimizer.element_slot_names().into_iter().enumerate() {
                disk.write_all(i, &check(name)?)?;
            }
            if !replicated {
                self.optimizer.set_n_updates(n_updates);
                self.n_steps = n_steps;
                return Ok(());
            }
        }
        // In memory: every slot, or with the state offloaded the replicated ones.
        let mut err = None;
        self.optimizer.restore(n_updates, |name| check(name).map_err(|e| err = Some(e)).ok())?;
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
