//! Dynamic loss scaling for f16 (PyTorch's `GradScaler`, DeepSpeed's
//! `DynamicLossScaler`), updated once per optimizer step.

/// Settings of the dynamic loss scaler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScalerConfig {
    /// Starting scale (2^16).
    pub initial_scale: f32,
    /// Good steps in a row after which the scale doubles.
    pub window: u64,
    /// Overflowing steps tolerated before the scale halves (1: halve at once).
    pub hysteresis: u32,
    /// The scale never drops below this.
    pub min_scale: f32,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        Self { initial_scale: 65536.0, window: 1000, hysteresis: 1, min_scale: 1.0 }
    }
}

/// The scaler's state (checkpointed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaler {
    /// Settings.
    pub config: LossScalerConfig,
    /// Current scale.
    pub scale: f32,
    /// Good steps since the last change.
    pub good_steps: u64,
    /// Overflows left before the next halving.
    pub hysteresis_left: u32,
    /// Steps skipped so far.
    pub n_skipped: u64,
}

impl LossScaler {
    /// A scaler at its initial scale.
    pub fn new(config: LossScalerConfig) -> Self {
        Self {
            config,
            scale: config.initial_scale,
            good_steps: 0,
            hysteresis_left: config.hysteresis.max(1),
            n_skipped: 0,
        }
    }

    /// Records the outcome of one optimizer step (called exactly once per step).
    pub fn update(&mut self, overflow: bool) {
        if overflow {
            self.n_skipped += 1;
            self.good_steps = 0;
            self.hysteresis_left = self.hysteresis_left.saturating_sub(1);
            if self.hysteresis_left == 0 {
                self.scale = (self.scale * 0.5).max(self.config.min_scale);
                self.hysteresis_left = self.config.hysteresis.max(1);
            }
        } else {
            self.good_steps += 1;
            if self.good_steps >= self.config.window {
                self.scale *= 2.0;
                self.good_steps = 0;
                self.hysteresis_left = self.config.hysteresis.max(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_on_overflow_grows_after_window_and_floors() {
        let mut s = LossScaler::new(LossScalerConfig { initial_scale: 8.0, window: 3, hysteresis: 1, min_scale: 2.0 });
        s.update(true);
        assert_eq!((s.scale, s.n_skipped), (4.0, 1));
        for _ in 0..2 {
            s.update(false);
        }
        assert_eq!(s.scale, 4.0, "not yet a full window");
        s.update(false);
        assert_eq!(s.scale, 8.0, "doubles after 3 good steps");
        s.update(true);
        s.update(true);
        s.update(true);
        assert_eq!(s.scale, 2.0, "floor");
        let mut h = LossScaler::new(LossScalerConfig { hysteresis: 2, ..Default::default() });
        h.update(true);
        assert_eq!(h.scale, 65536.0, "hysteresis 2 tolerates one overflow");
        h.update(true);
        assert_eq!(h.scale, 32768.0);
    }
}
