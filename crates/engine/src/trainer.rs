//! One optimizer step: K micro-steps accumulated into the flat gradient
//! buffer, then — once, at the boundary — normalisation, clipping, the
//! optimizer update and the schedule step.

use crate::error::EngineError;
use crate::model::Model;
use crate::optim::{Optimizer, CHUNK};
use crate::schedule::LrSchedule;
use comm::Communicator;
use rayon::prelude::*;

/// How the accumulated gradient is normalised at the boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossNormalization {
    /// Mean over all target tokens of the global batch (SPEC §2; default).
    /// K micro-steps then equal one big batch even when micro-batches hold
    /// different numbers of targets.
    #[default]
    Token,
    /// The tutorials' minimal recipe: each micro-batch's mean loss divided by K.
    /// Wrong when micro-batches hold different numbers of targets; kept for
    /// comparison.
    MicroBatchMean,
}

/// Boundary settings of the trainer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainerOptions {
    /// `clip_grad_norm_` max norm; `None` disables clipping.
    pub grad_clip: Option<f32>,
    /// Loss normalisation.
    pub normalization: LossNormalization,
    /// Elements per gradient all-reduce bucket.
    pub bucket_elems: usize,
}

/// PyTorch DDP's default bucket: 25 MiB of f32.
pub const DEFAULT_BUCKET_ELEMS: usize = 25 * (1 << 20) / 4;

impl Default for TrainerOptions {
    fn default() -> Self {
        Self { grad_clip: None, normalization: LossNormalization::Token, bucket_elems: DEFAULT_BUCKET_ELEMS }
    }
}

/// What one optimizer step reports.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// 0-based index of the step just taken.
    pub step_idx: u64,
    /// Global-batch mean loss (never divided by K).
    pub loss: f64,
    /// Mean loss of each micro-batch (NaN for a micro-batch without targets).
    pub micro_losses: Vec<f64>,
    /// Number of targets in the global batch.
    pub n_targets: u64,
    /// Number of micro-steps taken.
    pub n_micro_steps: usize,
    /// Gradient L2 norm before clipping.
    pub grad_norm: f64,
    /// Whether clipping scaled the gradient.
    pub clipped: bool,
    /// Learning rate used by this step.
    pub lr: f32,
    /// Bytes this rank handed to collectives during the step.
    pub comm_bytes: u64,
    /// Collective calls during the step.
    pub comm_calls: u64,
    /// Seconds spent inside the model's micro-steps (forward + backward).
    pub model_s: f64,
}

/// Owns the flat parameter and gradient buffers, the optimizer and the schedule.
#[derive(Debug, Clone)]
pub struct Trainer {
    params: Vec<f32>,
    grads: Vec<f32>,
    optimizer: Optimizer,
    schedule: LrSchedule,
    options: TrainerOptions,
    n_steps: u64,
    /// Factor the last step applied to the accumulated buffer.
    grad_scale: f32,
}

impl Trainer {
    /// A trainer starting from `params`.
    pub fn new(params: Vec<f32>, optimizer: Optimizer, schedule: LrSchedule, options: TrainerOptions) -> Self {
        let grads = vec![0.0; params.len()];
        Self { params, grads, optimizer, schedule, options, n_steps: 0, grad_scale: 1.0 }
    }

    /// Current parameters.
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// The gradient the last optimizer step applied (normalised and clipped),
    /// computed on demand from the accumulated buffer.
    pub fn gradient(&self) -> Vec<f32> {
        let s = self.grad_scale;
        self.grads.iter().map(|g| g * s).collect()
    }

    /// Number of optimizer steps taken: the schedule's position.
    pub fn n_steps(&self) -> u64 {
        self.n_steps
    }

    /// The optimizer (for its state and update count).
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    /// Restores a checkpointed state: parameters, optimizer state and the
    /// number of steps taken (the schedule's position).
    pub fn restore(
        &mut self,
        params: Vec<f32>,
        n_steps: u64,
        n_updates: u64,
        optimizer_state: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<(), EngineError> {
        if params.len() != self.params.len() {
            return Err(EngineError::ParamCount { expected: self.params.len(), got: params.len() });
        }
        self.optimizer.restore(n_updates, optimizer_state)?;
        self.params = params;
        self.n_steps = n_steps;
        Ok(())
    }

    /// Replaces the parameters (e.g. `--init-from` a pretrained model) before training.
    pub fn set_params(&mut self, params: Vec<f32>) -> Result<(), EngineError> {
        if params.len() != self.params.len() {
            return Err(EngineError::ParamCount { expected: self.params.len(), got: params.len() });
        }
        self.params = params;
        Ok(())
    }

    /// The learning rate the next step will use.
    pub fn next_lr(&self) -> f32 {
        self.schedule.lr(self.n_steps)
    }

    /// Makes every rank start from rank 0's parameters.
    pub fn broadcast_params(&mut self, comm: &mut dyn Communicator) -> Result<(), EngineError> {
        comm.broadcast(&mut self.params, 0).map_err(|source| EngineError::Comm { step: self.n_steps, source })
    }

    /// FNV-1a hash of the parameter bits.
    pub fn params_checksum(&self) -> u64 {
        self.params.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
            x.to_bits().to_le_bytes().iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
        })
    }

    /// Errors unless every rank holds bit-identical parameters.
    pub fn check_params_agree(&mut self, comm: &mut dyn Communicator) -> Result<(), EngineError> {
        let h = self.params_checksum();
        // Four 16-bit pieces: exact in f32, so the all-gather carries the hash losslessly.
        let mine: Vec<f32> = (0..4).map(|i| ((h >> (16 * i)) & 0xffff) as f32).collect();
        let mut all = vec![0.0f32; 4 * comm.world_size()];
        comm.all_gather(&mine, &mut all).map_err(|source| EngineError::Comm { step: self.n_steps, source })?;
        let checksums: Vec<u64> =
            all.chunks(4).map(|c| c.iter().enumerate().fold(0u64, |h, (i, &x)| h | ((x as u64) << (16 * i)))).collect();
        if checksums.iter().any(|&c| c != checksums[0]) {
            return Err(EngineError::RanksDiverged { step: self.n_steps, checksums });
        }
        Ok(())
    }

    /// One optimizer step over this rank's `micro_batches` (K = its length;
    /// every rank must pass the same K). Communication happens only at the
    /// boundary: one f64 all-reduce of statistics and the bucketed gradient
    /// all-reduce — never during micro-steps 0..K-1 (DDP's `no_sync`).
    pub fn step<M: Model>(
        &mut self,
        model: &mut M,
        comm: &mut dyn Communicator,
        micro_batches: &[M::Batch],
    ) -> Result<StepReport, EngineError> {
        let n_params = model.layout().n_params();
        if n_params != self.params.len() {
            return Err(EngineError::ParamCount { expected: n_params, got: self.params.len() });
        }
        if micro_batches.is_empty() {
            return Err(EngineError::NoMicroBatches);
        }
        let step_idx = self.n_steps;
        let n_micro = micro_batches.len();
        let world = comm.world_size();
        let before = comm.counters();

        // Micro-step 0 zeroes; every micro-step adds; nobody communicates.
        self.grads.fill(0.0);
        let mut loss_sum = 0.0f64;
        let mut n_targets = 0u64;
        let mut micro_losses = Vec::with_capacity(n_micro);
        let mut model_s = 0.0;
        for (micro_step_idx, batch) in micro_batches.iter().enumerate() {
            let grad_scale = match self.options.normalization {
                LossNormalization::Token => 1.0,
                LossNormalization::MicroBatchMean => match model.n_targets(batch) {
                    0 => 0.0,
                    n => 1.0 / (n as f64 * (n_micro * world) as f64) as f32,
                },
            };
            let t0 = std::time::Instant::now();
            let stats = model
                .micro_step(&self.params, &mut self.grads, batch, grad_scale)
                .map_err(|e| EngineError::Model { step: step_idx + 1, micro_step_idx, source: Box::new(e) })?;
            model_s += t0.elapsed().as_secs_f64();
            loss_sum += stats.loss_sum;
            n_targets += stats.n_targets;
            micro_losses.push(stats.loss_sum / stats.n_targets as f64);
        }

        // The boundary: everything below runs exactly once per optimizer step.
        // One Sum collective of the statistics and one (bucketed) of the
        // gradients; after them every rank holds the same global values.
        let comm_err = |source| EngineError::Comm { step: step_idx + 1, source };
        let micro_mean_sum: f64 = micro_losses.iter().filter(|l| l.is_finite()).sum();
        let n_valid_micro = micro_losses.iter().filter(|l| l.is_finite()).count();
        let mut stats = [loss_sum, n_targets as f64, micro_mean_sum, n_valid_micro as f64];
        comm.all_reduce_sum_f64(&mut stats).map_err(comm_err)?;
        for bucket in self.grads.chunks_mut(self.options.bucket_elems.max(1)) {
            comm.all_reduce_sum(bucket).map_err(comm_err)?;
        }
        let [loss_sum, n_targets, micro_mean_sum, n_valid_micro] = stats;
        let n_targets = n_targets as u64;
        // The buffer holds Σ over ranks and micro-steps of ∂(Σ loss)/∂θ. Rather
        // than rescaling it in place (two passes), fold 1/n_targets and the clip
        // coefficient into one factor the optimizer applies as it reads.
        let (loss, normalize) = match self.options.normalization {
            LossNormalization::Token => {
                if n_targets == 0 {
                    return Err(EngineError::NoTargets { step: step_idx + 1 });
                }
                (loss_sum / n_targets as f64, 1.0 / n_targets as f64)
            }
            LossNormalization::MicroBatchMean => {
                if n_valid_micro == 0.0 {
                    return Err(EngineError::NoTargets { step: step_idx + 1 });
                }
                (micro_mean_sum / (n_micro * world) as f64, 1.0)
            }
        };
        let grad_norm = grad_norm(&self.grads) * normalize;
        if !grad_norm.is_finite() {
            return Err(EngineError::NonFiniteGradient { step: step_idx + 1, norm: grad_norm });
        }
        let clip_coef = match self.options.grad_clip {
            Some(max_norm) => clip_coefficient(grad_norm, max_norm),
            None => 1.0,
        };
        let clipped = clip_coef < 1.0;
        self.grad_scale = (normalize * clip_coef) as f32;
        let lr = self.schedule.lr(step_idx);
        self.optimizer.update(model.layout(), &mut self.params, &self.grads, lr, self.grad_scale);
        self.n_steps += 1;
        let after = comm.counters();
        Ok(StepReport {
            step_idx,
            loss,
            micro_losses,
            n_targets,
            n_micro_steps: n_micro,
            grad_norm,
            clipped,
            lr,
            comm_bytes: after.bytes_sent - before.bytes_sent,
            comm_calls: after.n_calls - before.n_calls,
            model_s,
        })
    }
}

fn scale(buf: &mut [f32], factor: f32) {
    buf.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x *= factor));
}

/// `torch.nn.utils.clip_grad_norm_`'s factor: `max_norm / (norm + 1e-6)`, capped at 1.
fn clip_coefficient(norm: f64, max_norm: f32) -> f64 {
    (max_norm as f64 / (norm + 1e-6)).min(1.0)
}

/// L2 norm of a flat buffer, accumulated in f64 over fixed chunks summed in
/// order, so the result does not depend on the number of threads.
pub fn grad_norm(grads: &[f32]) -> f64 {
    let partial: Vec<f64> =
        grads.par_chunks(CHUNK).map(|c| c.iter().map(|&x| x as f64 * x as f64).sum::<f64>()).collect();
    partial.iter().sum::<f64>().sqrt()
}

/// `torch.nn.utils.clip_grad_norm_`: scale by `max_norm / (norm + 1e-6)` when
/// that factor is below 1. Returns the pre-clip norm and whether it clipped.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> (f64, bool) {
    let norm = grad_norm(grads);
    let coef = clip_coefficient(norm, max_norm);
    if coef < 1.0 {
        scale(grads, coef as f32);
        (norm, true)
    } else {
        (norm, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_matches_torch_semantics() {
        // norm of [3, 4] is 5; clip to 1 → factor 1/(5+1e-6).
        let mut g = vec![3.0f32, 4.0];
        let (norm, clipped) = clip_grad_norm(&mut g, 1.0);
        assert_eq!(norm, 5.0);
        assert!(clipped);
        assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
        let mut g = vec![0.3f32, 0.4];
        assert_eq!(clip_grad_norm(&mut g, 1.0), (0.500_000_011_920_929, false));
        assert_eq!(g, vec![0.3, 0.4]);
    }
}
