//! `train.objective`: what the loss is — next-token cross-entropy, or DPO
//! over preference pairs — and the settings DPO cannot run with.

use crate::{invalid, Config, ConfigError, DataFormat, LossNormalization};
use serde::{Deserialize, Serialize};

/// `train.objective`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Next-token cross-entropy over the target tokens.
    #[default]
    Lm,
    /// Direct Preference Optimization over `prompt`/`chosen`/`rejected`
    /// JSON Lines: the LoRA-adapted model is the policy, the same model
    /// with its adapters off the reference; `train.dpo_beta` is β.
    Dpo,
}

impl Objective {
    /// The TOML spelling.
    pub fn name(self) -> &'static str {
        match self {
            Objective::Lm => "lm",
            Objective::Dpo => "dpo",
        }
    }
}

/// The checks of `train.objective = "dpo"` against the rest of the config.
pub(crate) fn validate(cfg: &Config) -> Result<(), ConfigError> {
    let t = &cfg.train;
    if t.objective != Objective::Dpo {
        return Ok(());
    }
    let refuse = |key: &'static str, value: &dyn std::fmt::Display, fix: &str| {
        Err(invalid(key, value, &format!("train.objective = \"dpo\" {fix}")))
    };
    if !(t.dpo_beta.is_finite() && t.dpo_beta > 0.0) {
        return Err(invalid("train.dpo_beta", t.dpo_beta, "must be a positive number (TRL's default is 0.1)"));
    }
    if cfg.lora.is_none() {
        return refuse("lora", &"(none)", "needs a [lora] section: the reference model is the policy with its adapters off, so no second copy of the model is held");
    }
    let lora = cfg.lora.as_ref();
    if lora.and_then(|l| l.get("use_dora")).and_then(toml::Value::as_bool) == Some(true) {
        return refuse("lora.use_dora", &true, "takes the reference as the adapters' B read as zeros, which is the base only for plain LoRA (DoRA's magnitudes rescale it): set lora.use_dora = false");
    }
    let dropout = lora.and_then(|l| l.get("dropout")).and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)));
    if dropout.is_some_and(|p| p > 0.0) {
        return refuse("lora.dropout", &dropout.unwrap_or(0.0), "scores each reply once without dropout to weigh its gradient, so the two passes must agree: set lora.dropout = 0");
    }
    if cfg.data.sources.is_some() {
        return refuse(
            "data.sources",
            &"[…]",
            "reads one JSON Lines file of pairs: set data.path instead of data.sources",
        );
    }
    if cfg.data.format != DataFormat::Jsonl {
        return refuse(
            "data.format",
            &cfg.data.format.name(),
            "reads JSON Lines of {\"prompt\", \"chosen\", \"rejected\"}: set data.format = \"jsonl\"",
        );
    }
    if cfg.data.pack {
        return refuse("data.pack", &true, "keeps each reply in a row of its own: set data.pack = false");
    }
    if t.loss_normalization != LossNormalization::Token {
        return refuse(
            "train.loss_normalization",
            &"micro_batch_mean",
            "averages its loss over the pairs of the global batch: set train.loss_normalization = \"token\"",
        );
    }
    for (key, v) in [("train.label_smoothing", t.label_smoothing), ("train.z_loss", t.z_loss)] {
        if v != 0.0 {
            return refuse(key, &v, &format!("scores replies by their plain log probabilities: set {key} = 0"));
        }
    }
    for (key, n) in
        [("dist.pipeline_parallel", cfg.dist.pipeline_parallel), ("dist.tensor_parallel", cfg.dist.tensor_parallel)]
    {
        if n > 1 {
            return refuse(key, &n, &format!("runs on data-parallel ranks only: set {key} = 1"));
        }
    }
    if cfg.dist.overlap_comm && cfg.dist.zero_stage < 3 && !cfg.dist.reduce_every_micro_step {
        return refuse(
            "dist.overlap_comm",
            &true,
            "starts a bucket's reduction once the backward has passed its layers, and a DPO micro-step runs two backwards (chosen, then rejected): set dist.overlap_comm = false (it applies to DPO at dist.zero_stage = 3 or with dist.reduce_every_micro_step)",
        );
    }
    if !cfg.data.drop_last && (cfg.dist.world_size > 1 || cfg.dist.zero_stage > 0) {
        return refuse(
            "data.drop_last",
            &false,
            "with several ranks or ZeRO runs the same number of pairs on every rank: set data.drop_last = true",
        );
    }
    Ok(())
}
