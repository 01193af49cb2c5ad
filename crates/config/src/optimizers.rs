//! `[optim]` and `[schedule]` settings of the optimizers beyond AdamW and
//! SGD: Lion's betas, Adafactor's options, the no-decay patterns, the WSD
//! decay share, and the combinations an optimizer cannot run.

use crate::{invalid, Config, ConfigError, OptimizerKind};
use serde::{Deserialize, Serialize};

/// `[optim.lion]`: Lion's betas (Chen et al. 2023's defaults), apart from
/// AdamW's `optim.beta1` / `optim.beta2`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LionConfig {
    /// Interpolation of momentum and gradient whose sign is the update.
    pub beta1: f32,
    /// The momentum's decay.
    pub beta2: f32,
}

impl Default for LionConfig {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.99 }
    }
}

/// Checks the settings of this module's keys and the combinations an
/// optimizer cannot run, each error naming the key and the fix.
pub(crate) fn validate(cfg: &Config) -> Result<(), ConfigError> {
    let o = &cfg.optim;
    for (field, v) in [("optim.lion.beta1", o.lion.beta1), ("optim.lion.beta2", o.lion.beta2)] {
        if !(0.0..1.0).contains(&v) {
            return Err(invalid(field, v, "must be in [0, 1)"));
        }
    }
    let a = &o.adafactor;
    if let Some(b1) = a.beta1.filter(|b| !(0.0..1.0).contains(b)) {
        return Err(invalid("optim.adafactor.beta1", b1, "must be in [0, 1) (leave it unset for no first moment)"));
    }
    if a.decay_rate >= 0.0 || a.decay_rate.is_nan() {
        return Err(invalid("optim.adafactor.decay_rate", a.decay_rate, "must be < 0 (transformers' default -0.8)"));
    }
    if !(a.clip_threshold > 0.0 && a.clip_threshold.is_finite()) {
        return Err(invalid("optim.adafactor.clip_threshold", a.clip_threshold, "must be finite and > 0"));
    }
    for (field, v) in [("optim.adafactor.eps1", a.eps1), ("optim.adafactor.eps2", a.eps2)] {
        if !(v >= 0.0 && v.is_finite()) {
            return Err(invalid(field, v, "must be finite and >= 0"));
        }
    }
    if a.warmup_init && !a.relative_step {
        return Err(invalid(
            "optim.adafactor.warmup_init",
            true,
            "applies with optim.adafactor.relative_step = true only; remove it or set relative_step = true",
        ));
    }
    if let Some(p) = o.no_decay.iter().flatten().find(|p| p.is_empty()) {
        return Err(invalid(
            "optim.no_decay",
            format!("{p:?}"),
            "patterns must not be empty (\"*bias\" names every bias)",
        ));
    }
    let f = cfg.schedule.decay_fraction;
    if !(0.0..=1.0).contains(&f) {
        return Err(invalid(
            "schedule.decay_fraction",
            f,
            "must be in [0, 1] (the share of train.steps spent decaying)",
        ));
    }
    if o.name == OptimizerKind::Adafactor && cfg.dist.tensor_parallel > 1 {
        return Err(invalid(
            "dist.tensor_parallel",
            cfg.dist.tensor_parallel,
            "adafactor's row and column statistics are sums over whole tensors, and tensor parallelism splits tensors over ranks whose sums are not added; set dist.tensor_parallel = 1 (ZeRO shards adafactor's state, dist.zero_stage = 1..3) or use another optim.name",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{Config, OptimizerKind};

    fn parse(sets: &[&str]) -> Result<Config, String> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let c = Config::from_toml("", "test", &sets).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn new_optimizers_and_their_keys_parse() {
        let c = parse(&["optim.name=\"lion\"", "optim.lion.beta2=0.98"]).unwrap();
        assert_eq!((c.optim.name, c.optim.lion.beta1, c.optim.lion.beta2), (OptimizerKind::Lion, 0.9, 0.98));
        let c = parse(&["optim.name=\"adamw8bit\"", "dist.zero_stage=2"]).unwrap();
        assert_eq!(c.optim.name, OptimizerKind::AdamW8bit);
        let c =
            parse(&["optim.name=\"adafactor\"", "optim.adafactor.beta1=0.9", "optim.no_decay=[\"*bias\"]"]).unwrap();
        assert_eq!(
            (c.optim.adafactor.beta1, c.optim.no_decay.as_deref()),
            (Some(0.9), Some(&["*bias".to_string()][..]))
        );
        let c = parse(&["schedule.kind=\"wsd\"", "schedule.decay_fraction=0.1"]).unwrap();
        assert_eq!((c.schedule.kind, c.schedule.decay_fraction), (crate::Decay::Wsd, 0.1));
        // Defaults: no patterns (the family's grouping), WSD decays over the last 20%.
        let c = parse(&[]).unwrap();
        assert_eq!((c.optim.no_decay.clone(), c.schedule.decay_fraction), (None, 0.2));
        assert!(c.to_toml().contains("[optim.adafactor]"));
    }

    #[test]
    fn adafactor_refuses_tensor_parallelism_naming_the_key_and_fix() {
        let e = parse(&["optim.name=\"adafactor\"", "dist.tensor_parallel=2"]).unwrap_err();
        assert!(e.contains("dist.tensor_parallel") && e.contains("whole tensors") && e.contains("set "), "{e}");
        for ok in ["dist.zero_stage=3", "dist.offload_optimizer=\"disk\""] {
            parse(&["optim.name=\"adafactor\"", "optim.adafactor.beta1=0.9", ok]).unwrap();
        }
        let e = parse(&["optim.adafactor.warmup_init=true"]).unwrap_err();
        assert!(e.contains("relative_step"), "{e}");
        let e = parse(&["schedule.decay_fraction=1.5"]).unwrap_err();
        assert!(e.contains("schedule.decay_fraction"), "{e}");
        let e = parse(&["optim.no_decay=[\"\"]"]).unwrap_err();
        assert!(e.contains("optim.no_decay"), "{e}");
    }
}
