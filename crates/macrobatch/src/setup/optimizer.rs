//! The optimizer of `[optim]` and its weight-decay grouping
//! (`optim.no_decay`), for every command that builds a trainer.

use anyhow::{bail, Result};
use config::{Config, OptimizerKind};
use engine::{Adafactor, AdamW, AdamW8bit, Lion, Optimizer, Sgd, StateSize, Trainer};

/// The optimizer `[optim]` names, with its hyper-parameters only: the
/// trainer sizes the state for its shard of the trainable tensors.
pub fn optimizer_of(cfg: &Config) -> Result<Optimizer> {
    let o = &cfg.optim;
    Ok(match o.name {
        OptimizerKind::Sgd => Optimizer::Sgd(Sgd::new(0, o.momentum, o.nesterov, o.weight_decay)?),
        OptimizerKind::AdamW => Optimizer::AdamW(AdamW::new(0, o.beta1, o.beta2, o.eps, o.weight_decay)?),
        OptimizerKind::Lion => Optimizer::Lion(Lion::new(0, o.lion.beta1, o.lion.beta2, o.weight_decay)?),
        OptimizerKind::AdamW8bit => Optimizer::AdamW8bit(AdamW8bit::new(o.beta1, o.beta2, o.eps, o.weight_decay)?),
        OptimizerKind::Adafactor => Optimizer::Adafactor(Adafactor::new(o.adafactor, o.weight_decay)?),
    })
}

/// How the configured optimizer's state is sized, for memory plans.
pub fn state_size(cfg: &Config) -> StateSize {
    cfg.optim.name.state_size(cfg.optim.momentum, cfg.optim.adafactor.beta1.is_some())
}

/// Applies `optim.no_decay` (if set): tensors a pattern names get no
/// weight decay, every other tensor does. A pattern that names no tensor
/// of the trainer's layout is an error (a typo would silently decay).
pub fn apply_no_decay(cfg: &Config, trainer: &mut Trainer) -> Result<()> {
    let Some(patterns) = &cfg.optim.no_decay else { return Ok(()) };
    let names: Vec<&str> = trainer.layout().tensors().iter().map(|t| t.name.as_str()).collect();
    if let Some(p) = patterns.iter().find(|p| !names.iter().any(|n| config::name_matches(p, n))) {
        bail!(
            "optim.no_decay: pattern `{p}` names no tensor of this model (tensor names look like {}, {}; `*` matches any run of characters)",
            names.first().copied().unwrap_or(""),
            names.get(2).copied().unwrap_or("")
        );
    }
    trainer.set_decay(|t| !patterns.iter().any(|p| config::name_matches(p, &t.name)));
    Ok(())
}
