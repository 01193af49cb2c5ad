//! `[train]`'s loop controls and loss terms: early stopping on the
//! validation loss, keeping the best checkpoint, an exponential moving
//! average of the weights, label smoothing and PaLM's z-loss — and their
//! checks against the rest of the config.

use super::{invalid, Config, ConfigError, LossNormalization, Precision};
use serde::{Deserialize, Serialize};

/// `train.early_stopping = { patience = N, min_delta = x }`: the run stops
/// once `patience` evaluations in a row did not lower the best validation
/// loss by more than `min_delta`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Evaluations in a row without an improvement before the run stops.
    pub patience: u32,
    /// How much lower than the best so far a validation loss must be to
    /// count as an improvement (absolute, in nats per target token).
    #[serde(default)]
    pub min_delta: f64,
}

/// Checks the loop-control and loss-term keys of `cfg`.
pub(super) fn validate(cfg: &Config) -> Result<(), ConfigError> {
    let t = &cfg.train;
    if let Some(es) = &t.early_stopping {
        if es.patience == 0 {
            return Err(invalid(
                "train.early_stopping.patience",
                0,
                "must be at least 1 (evaluations without improvement before the run stops)",
            ));
        }
        if !(es.min_delta >= 0.0 && es.min_delta.is_finite()) {
            return Err(invalid("train.early_stopping.min_delta", es.min_delta, "must be finite and >= 0"));
        }
    }
    for (key, on) in [("train.early_stopping", t.early_stopping.is_some()), ("train.keep_best", t.keep_best)] {
        if on && t.eval_every == 0 {
            return Err(invalid(
                key,
                "on",
                "watches the validation loss measured every train.eval_every steps, and train.eval_every = 0 evaluates only at the end; set train.eval_every > 0",
            ));
        }
    }
    if !(0.0..1.0).contains(&t.ema_decay) {
        return Err(invalid(
            "train.ema_decay",
            t.ema_decay,
            "must be in [0, 1) (0: no moving average; 0.999 is usual)",
        ));
    }
    if t.ema_decay > 0.0 {
        let d = &cfg.dist;
        let sharded = d.zero_stage == 3 || (d.zero_stage >= 1 && t.precision != Precision::F32);
        let why = if sharded {
            Some(format!(
                "dist.zero_stage = {} with train.precision = \"{}\" shards the f32 weights, and the average is kept by rank 0 over the whole set; use dist.zero_stage <= 2 with f32, or dist.zero_stage = 0",
                d.zero_stage,
                t.precision
            ))
        } else if d.pipeline_parallel > 1 || d.tensor_parallel > 1 {
            Some("rank 0 keeps the average over the whole model, which a pipeline or tensor split does not hold in one rank; set dist.pipeline_parallel = 1 and dist.tensor_parallel = 1, or train.ema_decay = 0".to_string())
        } else {
            None
        };
        if let Some(why) = why {
            return Err(invalid("train.ema_decay", t.ema_decay, &why));
        }
    }
    if t.checkpoint_sharded && t.checkpoint_async {
        return Err(invalid(
            "train.checkpoint_sharded",
            true,
            "every rank writes its own pieces in place, which train.checkpoint_async (rank 0 writing the gathered state in the background) does not combine with; set train.checkpoint_async = false or train.checkpoint_sharded = false",
        ));
    }
    if t.checkpoint_sharded && cfg.lora.is_some() {
        return Err(invalid(
            "train.checkpoint_sharded",
            true,
            "a LoRA run's checkpoints hold only its adapters (and a reference to the frozen base), already small and written whole; set train.checkpoint_sharded = false",
        ));
    }
    if !(0.0..1.0).contains(&t.label_smoothing) {
        return Err(invalid("train.label_smoothing", t.label_smoothing, "must be in [0, 1) (0: none; 0.1 is usual)"));
    }
    if !(t.z_loss >= 0.0 && t.z_loss.is_finite()) {
        return Err(invalid("train.z_loss", t.z_loss, "must be finite and >= 0 (0: none; PaLM used 1e-4)"));
    }
    if (t.label_smoothing > 0.0 || t.z_loss > 0.0) && t.loss_normalization != LossNormalization::Token {
        return Err(invalid(
            "train.loss_normalization",
            "micro_batch_mean",
            "label smoothing and z-loss are summed over target tokens and divided by the global target count; set train.loss_normalization = \"token\" or train.label_smoothing = train.z_loss = 0",
        ));
    }
    Ok(())
}
