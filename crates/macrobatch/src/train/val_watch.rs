//! Early stopping and keep-best: what the validation loss measured every
//! `train.eval_every` steps decides. Rank 0 holds the loss and decides;
//! every rank learns the verdict in one collective on evaluation steps
//! (only while either control is on), so all stop, or write the best
//! checkpoint, together.

use crate::checkpoint::ValWatchState;
use anyhow::Result;
use comm::Communicator;
use config::{EarlyStopping, TrainConfig};

/// What an evaluation step decided.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Verdict {
    /// The validation loss is the lowest so far and keep-best is on: this
    /// step's checkpoint is written and marked best.
    pub new_best: bool,
    /// Early stopping ends the run after this step, for this reason.
    pub stop: Option<String>,
}

/// The validation-loss history of a run.
pub struct ValWatch {
    early: Option<EarlyStopping>,
    keep_best: bool,
    eval_every: u64,
    last_step: u64,
    state: ValWatchState,
}

impl ValWatch {
    /// The controls of `cfg`, continuing `resumed` (a checkpoint's history).
    pub fn new(cfg: &TrainConfig, resumed: Option<ValWatchState>) -> Self {
        Self {
            early: cfg.early_stopping,
            keep_best: cfg.keep_best,
            eval_every: cfg.eval_every,
            last_step: cfg.steps,
            state: resumed.unwrap_or_default(),
        }
    }

    /// The history to save in a checkpoint (none when both controls are off).
    pub fn state(&self) -> Option<ValWatchState> {
        (self.early.is_some() || self.keep_best).then_some(self.state)
    }

    /// The step of the best checkpoint, which pruning spares.
    pub fn best_step(&self) -> Option<u64> {
        self.keep_best.then_some(self.state.best.map(|b| b.0)).flatten()
    }

    /// Step `step`'s verdict. `val_loss` is rank 0's measurement (other
    /// ranks pass what they have; only rank 0's counts). A collective on
    /// the evaluation steps a control watches, on every rank alike.
    pub fn observe(&mut self, step: u64, val_loss: Option<f64>, comm: &mut dyn Communicator) -> Result<Verdict> {
        // The evaluation steps of `maybe_evaluate`.
        let is_eval = step == self.last_step || (self.eval_every > 0 && step.is_multiple_of(self.eval_every));
        let watched = (self.early.is_some() || self.keep_best) && is_eval;
        if !watched {
            return Ok(Verdict::default());
        }
        let mut verdict = Verdict::default();
        if comm.rank() == 0 {
            if let Some(loss) = val_loss {
                verdict = self.judge(step, loss);
            }
            if step == self.last_step {
                // The run ends here anyway.
                verdict.stop = None;
            }
        }
        if comm.world_size() > 1 {
            let mut v = [verdict.new_best as u8 as f64, verdict.stop.is_some() as u8 as f64];
            comm.all_reduce_sum_f64(&mut v)?;
            verdict.new_best = v[0] > 0.0;
            if v[1] > 0.0 && verdict.stop.is_none() {
                verdict.stop = Some("early stopping (decided by rank 0)".to_string());
            }
        }
        Ok(verdict)
    }

    /// Rank 0's decision on the validation loss `loss` of step `step`.
    /// Early stopping follows Keras' `EarlyStopping`: an evaluation
    /// improves when it is lower than the reference by more than
    /// `min_delta`, and becomes the reference; `patience` evaluations in a
    /// row without one stop the run. A NaN loss never improves.
    fn judge(&mut self, step: u64, loss: f64) -> Verdict {
        let st = &mut self.state;
        let lowest = !loss.is_nan() && st.best.is_none_or(|(_, b)| loss < b);
        if lowest {
            st.best = Some((step, loss));
        }
        let mut stop = None;
        if let Some(es) = self.early {
            if !loss.is_nan() && st.reference.is_none_or(|r| loss < r - es.min_delta) {
                st.reference = Some(loss);
                st.evals_without_improvement = 0;
            } else {
                st.evals_without_improvement += 1;
            }
            if st.evals_without_improvement >= es.patience {
                let (best_step, best) = st.best.unwrap_or((step, loss));
                stop = Some(format!(
                    "early stopping: the validation loss did not improve by more than {} for {} evaluations (best {best:.4} at step {best_step}, now {loss:.4})",
                    es.min_delta, es.patience
                ));
            }
        }
        Verdict { new_best: self.keep_best && lowest, stop }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(patience: u32, min_delta: f64, keep_best: bool) -> ValWatch {
        let cfg = TrainConfig {
            early_stopping: Some(EarlyStopping { patience, min_delta }),
            keep_best,
            eval_every: 1,
            steps: 1000,
            ..TrainConfig::default()
        };
        ValWatch::new(&cfg, None)
    }

    #[test]
    fn stops_after_patience_evaluations_without_an_improvement_beyond_min_delta() {
        let mut w = watch(2, 0.05, true);
        let losses = [3.0, 2.5, 2.48, 2.46, 2.6];
        let verdicts: Vec<Verdict> = losses.iter().enumerate().map(|(i, &l)| w.judge(i as u64 + 1, l)).collect();
        // 2.48 and 2.46 are new lows (kept as best) but within 0.05 of 2.5.
        assert_eq!(verdicts.iter().map(|v| v.new_best).collect::<Vec<_>>(), [true, true, true, true, false]);
        assert!(verdicts[2].stop.is_none());
        let reason = verdicts[3].stop.as_deref().expect("stops at the second evaluation without improvement");
        assert!(reason.contains("best 2.4600 at step 4"), "{reason}");
        assert_eq!(w.best_step(), Some(4));
    }

    #[test]
    fn an_improvement_resets_the_count_and_nan_never_improves() {
        let mut w = watch(2, 0.0, false);
        assert!(w.judge(1, 2.0).stop.is_none());
        assert!(w.judge(2, f64::NAN).stop.is_none());
        assert!(w.judge(3, 1.9).stop.is_none(), "an improvement resets the count");
        assert!(w.judge(4, 1.95).stop.is_none());
        assert!(w.judge(5, f64::NAN).stop.is_some());
        assert_eq!(w.best_step(), None, "keep_best is off");
        assert_eq!(w.state().and_then(|s| s.best), Some((3, 1.9)));
    }
}
