//! Learning-rate schedules, indexed by the optimizer step (never the micro-step).

/// What follows the linear warmup.
///
/// In a config: `constant`, `linear`, `cosine`, or DeepSpeed's scheduler
/// names `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR` for the same shapes.
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
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f32) -> Self {
        Self { max_lr: lr, min_lr: lr, warmup_steps: 0, total_steps: 0, decay: Decay::Constant }
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
        let s = LrSchedule { max_lr: 1.0, min_lr: 0.1, warmup_steps: 4, total_steps: 8, decay: Decay::Cosine };
        let got: Vec<f32> = (0..9).map(|i| s.lr(i)).collect();
        // warmup 0.25, 0.5, 0.75, 1; cosine over 4 steps: 1, 0.1+0.45(1+cos(π/4)) = 0.868198,
        // 0.55, 0.231802, then the floor.
        let want = [0.25, 0.5, 0.75, 1.0, 1.0, 0.868_198, 0.55, 0.231_802, 0.1];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
    }

    proptest! {
        /// Each decay is continuous at the warmup edge and monotone afterwards.
        #[test]
        fn continuous_and_monotone(warmup in 0u64..20, extra in 1u64..200, kind in 0usize..3) {
            let decay = [Decay::Constant, Decay::Linear, Decay::Cosine][kind];
            let s = LrSchedule { max_lr: 3e-4, min_lr: 3e-5, warmup_steps: warmup, total_steps: warmup + extra, decay };
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
