//! Learning-rate schedules, indexed by the optimizer step (never the micro-step).

/// What follows the linear warmup.
///
/// In a config: `constant`, `linear`, `cosine`, `wsd`, or DeepSpeed's
/// scheduler names `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR` for the
/// first three shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    /// Stay at the peak (DeepSpeed `WarmupLR`).
    #[serde(alias = "WarmupLR")]
    Constant,
    /// Linear decay to `min_lr` at `total_steps` (DeepSpeed `WarmupDecayLR`).
    #[serde(alias = "WarmupDecayLR")]
    Linear,
    /// Cosine decay to `min_lr` at `total_steps` (DeepSpeed `WarmupCosineLR`).
    #[serde(alias = "WarmupCosineLR")]
    Cosine,
    /// Warmup-stable-decay: the peak until the last
    /// [`LrSchedule::decay_fraction`] of the run, then a cosine-shaped decay
    /// to `min_lr` at `total_steps` (transformers' `get_wsd_schedule` with
    /// `decay_type="cosine"`).
    Wsd,
}

/// Linear warmup from `max_lr / warmup_steps` to `max_lr`, then [`Decay`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub max_lr: f32,
    /// Floor reached at `total_steps` by the decaying schedules.
    pub min_lr: f32,
    /// Number of warmup optimizer steps (0: none).
    pub warmup_steps: u64,
    /// Number of optimizer steps of the run.
    pub total_steps: u64,
    /// Shape after warmup.
    pub decay: Decay,
    /// [`Decay::Wsd`]: the share of `total_steps` spent decaying (rounded
    /// up to whole steps, at most the steps after warmup).
    pub decay_fraction: f32,
}

/// [`LrSchedule::decay_fraction`]'s default: the last 20% of the run, the
/// share Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training
/// Beyond Fixed Training Durations") found to match a cosine schedule.
pub const WSD_DECAY_FRACTION: f32 = 0.2;

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f32) -> Self {
        Self {
            max_lr: lr,
            min_lr: lr,
            warmup_steps: 0,
            total_steps: 0,
            decay: Decay::Constant,
            decay_fraction: WSD_DECAY_FRACTION,
        }
    }

    /// [`Decay::Wsd`]'s decay steps: `ceil(decay_fraction · total_steps)`,
    /// at most the steps after warmup (1e-4 of a step is forgiven, so the
    /// f32 spelling of 0.3 times 10 is 3 steps, not 4).
    pub fn wsd_decay_steps(&self) -> u64 {
        let d = (self.decay_fraction as f64 * self.total_steps as f64 - 1e-4).ceil().max(0.0) as u64;
        d.min(self.total_steps.saturating_sub(self.warmup_steps))
    }

    /// Learning rate of the 0-based optimizer step `step_idx`.
    ///
    /// Warmup step `i < warmup` uses `max_lr·(i+1)/warmup`, so the last warmup
    /// step runs at the peak and the first decay step starts from it: the
    /// schedule is continuous at the phase edge.
    pub fn lr(&self, step_idx: u64) -> f32 {
        if step_idx < self.warmup_steps {
            return self.max_lr * (step_idx + 1) as f32 / self.warmup_steps as f32;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step_idx - self.warmup_steps) as f64 / span as f64).min(1.0);
        let (lo, hi) = (self.min_lr as f64, self.max_lr as f64);
        let lr = match self.decay {
            Decay::Constant => hi,
            Decay::Linear => hi + (lo - hi) * progress,
            Decay::Cosine => lo + 0.5 * (hi - lo) * (1.0 + (std::f64::consts::PI * progress).cos()),
            Decay::Wsd => {
                // Stable until the decay phase, whose steps go from the peak
                // towards min_lr (reached at total_steps) as a half cosine.
                let d = self.wsd_decay_steps();
                let start = self.total_steps.saturating_sub(d);
                if d == 0 || step_idx < start {
                    hi
                } else {
                    let p = ((step_idx - start) as f64 / d as f64).min(1.0);
                    lo + 0.5 * (hi - lo) * (1.0 + (std::f64::consts::PI * p).cos())
                }
            }
        };
        lr as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn warmup_then_cosine_hand_values() {
        let s = LrSchedule {
            decay: Decay::Cosine,
            min_lr: 0.1,
            warmup_steps: 4,
            total_steps: 8,
            ..LrSchedule::constant(1.0)
        };
        let got: Vec<f32> = (0..9).map(|i| s.lr(i)).collect();
        // warmup 0.25, 0.5, 0.75, 1; cosine over 4 steps: 1, 0.1+0.45(1+cos(π/4)) = 0.868198,
        // 0.55, 0.231802, then the floor.
        let want = [0.25, 0.5, 0.75, 1.0, 1.0, 0.868_198, 0.55, 0.231_802, 0.1];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
    }

    /// transformers 5.x: `get_wsd_schedule(opt, num_warmup_steps=2,
    /// num_decay_steps=3, num_training_steps=10, min_lr_ratio=0.1,
    /// decay_type="cosine")` on lr 1.0:
    /// ```python
    /// from transformers import get_wsd_schedule
    /// import torch
    /// opt = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    /// s = get_wsd_schedule(opt, 2, 3, num_training_steps=10, min_lr_ratio=0.1)
    /// print([s.lr_lambdas[0](i) for i in range(11)])
    /// # [0.1, 0.55, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.325, 0.1]
    /// ```
    /// Equal from step 2 on (stable, then 0.1 + 0.45·(1 + cos(π·k/3)) for
    /// k = 0, 1, 2, then the floor); the warmup differs by our convention
    /// (step i < warmup runs at (i+1)/warmup of the peak, transformers' at
    /// i/warmup from min_lr_ratio).
    #[test]
    fn wsd_matches_transformers_after_warmup() {
        let s = LrSchedule {
            max_lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 2,
            total_steps: 10,
            decay: Decay::Wsd,
            decay_fraction: 0.3,
        };
        assert_eq!(s.wsd_decay_steps(), 3);
        let want = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.325, 0.1];
        for (i, w) in want.iter().enumerate() {
            // 1e-6: f64 arithmetic rounded once to f32.
            assert!((s.lr(i as u64) - w).abs() < 1e-6, "step {i}: {} vs {w}", s.lr(i as u64));
        }
    }

    proptest! {
        /// Each decay is continuous at the warmup edge and monotone afterwards.
        #[test]
        fn continuous_and_monotone(warmup in 0u64..20, extra in 1u64..200, kind in 0usize..4, frac in 0.0f32..1.0) {
            let decay = [Decay::Constant, Decay::Linear, Decay::Cosine, Decay::Wsd][kind];
            let total_steps = warmup + extra;
            let s = LrSchedule { max_lr: 3e-4, min_lr: 3e-5, warmup_steps: warmup, total_steps, decay, decay_fraction: frac };
            if warmup > 0 {
                prop_assert_eq!(s.lr(warmup - 1), s.max_lr);
            }
            prop_assert!((s.lr(warmup) - s.max_lr).abs() <= 1e-9);
            for i in warmup..warmup + extra + 5 {
                prop_assert!(s.lr(i + 1) <= s.lr(i) + 1e-9);
                prop_assert!(s.lr(i) >= s.min_lr - 1e-9);
            }
        }
    }
}
