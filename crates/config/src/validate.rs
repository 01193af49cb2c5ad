//! Each section's own rules ([`Config::validate`] runs them, then the
//! rules that join sections): a value out of range is an error naming its
//! key, the value and the fix, before anything is created.

use super::*;

impl TrainConfig {
    /// `[train]`'s own rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let t = self;
        if t.steps == 0 {
            return Err(invalid("train.steps", 0, "must be at least 1"));
        }
        if t.eval_batches == 0 {
            return Err(invalid("train.eval_batches", 0, "must be at least 1"));
        }
        if t.trainable.is_empty() {
            return Err(invalid("train.trainable", "[]", "name at least one tensor pattern (\"*\" trains everything)"));
        }
        if t.log_every == 0 {
            return Err(invalid("train.log_every", 0, "must be at least 1"));
        }
        if !(t.grad_clip >= 0.0 && t.grad_clip.is_finite()) {
            return Err(invalid("train.grad_clip", t.grad_clip, "must be finite and >= 0 (0 disables clipping)"));
        }
        if !(t.initial_loss_scale >= 1.0 && t.initial_loss_scale.is_finite()) {
            return Err(invalid("train.initial_loss_scale", t.initial_loss_scale, "must be finite and >= 1"));
        }
        if !(t.min_loss_scale > 0.0 && t.min_loss_scale <= t.initial_loss_scale) {
            return Err(invalid(
                "train.min_loss_scale",
                t.min_loss_scale,
                "must be > 0 and <= train.initial_loss_scale",
            ));
        }
        if t.loss_scale_window == 0 || t.loss_scale_hysteresis == 0 {
            return Err(invalid(
                "train.loss_scale_window",
                t.loss_scale_window,
                "window and hysteresis must be at least 1",
            ));
        }
        if t.frozen_dtype != FrozenDtype::Nf4 && !t.frozen_double_quant {
            return Err(invalid(
                "train.frozen_double_quant",
                false,
                &format!(
                    "applies to train.frozen_dtype = \"nf4\" only (it is \"{}\"); remove the key",
                    t.frozen_dtype.name()
                ),
            ));
        }
        if t.threads > 4096 {
            return Err(invalid("train.threads", t.threads, "must be at most 4096 (0: all cores)"));
        }
        Ok(())
    }
}

impl OptimConfig {
    /// `[optim]`'s own rules (each optimizer's own: `optimizers::validate`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let o = self;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return Err(invalid("optim.lr", o.lr, "must be finite and > 0"));
        }
        // The optimizers check these too, but only once the trainer exists:
        // here they fail before anything is created.
        for (field, v) in [("optim.beta1", o.beta1), ("optim.beta2", o.beta2), ("optim.momentum", o.momentum)] {
            if !(0.0..1.0).contains(&v) {
                return Err(invalid(field, v, "must be in [0, 1)"));
            }
        }
        if !(o.eps > 0.0 && o.eps.is_finite()) {
            return Err(invalid(
                "optim.eps",
                o.eps,
                "must be finite and > 0 (with 0, parameters that get no gradient become 0/0 = NaN)",
            ));
        }
        if !(o.weight_decay >= 0.0 && o.weight_decay.is_finite()) {
            return Err(invalid("optim.weight_decay", o.weight_decay, "must be finite and >= 0"));
        }
        if o.name == OptimizerKind::Sgd && o.nesterov && o.momentum == 0.0 {
            return Err(invalid("optim.momentum", o.momentum, "Nesterov momentum (optim.nesterov) needs momentum > 0"));
        }
        Ok(())
    }
}

impl ScheduleConfig {
    /// `[schedule]` against the learning rate it decays.
    pub fn validate(&self, o: &OptimConfig) -> Result<(), ConfigError> {
        let s = self;
        if !(s.min_lr >= 0.0 && s.min_lr <= o.lr) {
            return Err(invalid("schedule.min_lr", s.min_lr, &format!("must be between 0 and optim.lr ({})", o.lr)));
        }
        Ok(())
    }
}

impl DistConfig {
    /// `[dist]`'s rules, with what ZeRO composes with
    /// ([`engine::zero::composition_error`], the engine's one rule).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let dist = self;
        if dist.world_size == 0 {
            return Err(invalid("dist.world_size", 0, "must be at least 1"));
        }
        if dist.zero_stage > 3 {
            return Err(invalid("dist.zero_stage", dist.zero_stage, "use 0, 1, 2 or 3"));
        }
        if dist.reduce_every_micro_step && dist.zero_stage != 2 {
            return Err(invalid("dist.reduce_every_micro_step", true, "applies to dist.zero_stage = 2 only"));
        }
        if dist.overlap_comm && (dist.pipeline_parallel > 1 || dist.tensor_parallel > 1) {
            return Err(invalid(
                "dist.overlap_comm",
                true,
                "applies to data parallelism alone: with a pipeline or a tensor split the gradients are first summed over stages or tensor ranks at the boundary, and reducing over the data ranks earlier would add them in another order; set dist.overlap_comm = false",
            ));
        }
        if dist.pipeline_parallel == 0 {
            return Err(invalid("dist.pipeline_parallel", 0, "must be at least 1 (1: no pipeline)"));
        }
        if dist.tensor_parallel == 0 {
            return Err(invalid("dist.tensor_parallel", 0, "must be at least 1 (1: no tensor split)"));
        }
        if let Some(e) = engine::zero::composition_error(dist.zero_stage, dist.pipeline_parallel, dist.tensor_parallel)
        {
            return Err(invalid("dist.zero_stage", dist.zero_stage, &e));
        }
        if let Some(layers) = &dist.pipeline_layers {
            if layers.len() != dist.pipeline_parallel || layers.contains(&0) {
                return Err(invalid(
                    "dist.pipeline_layers",
                    format!("{layers:?}"),
                    &format!(
                        "list one positive layer count per stage: {} of them (dist.pipeline_parallel), summing to the model's layers; or leave it unset for an even split",
                        dist.pipeline_parallel
                    ),
                ));
            }
        }
        if !(dist.bucket_mb > 0.0 && dist.bucket_mb.is_finite()) {
            return Err(invalid("dist.bucket_mb", dist.bucket_mb, "must be finite and > 0"));
        }
        if !(dist.timeout_s > 0.0 && dist.timeout_s.is_finite()) {
            return Err(invalid("dist.timeout_s", dist.timeout_s, "must be finite and > 0"));
        }
        Ok(())
    }
}

impl DataConfig {
    /// `[data]`'s rules (its sources: `sources::validate`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let d = self;
        sources::validate(d)?;
        // `text` (the default) reads a `.parquet` / `.arrow` path as that table.
        let format = d.format.resolved_for(d.path.as_deref().map(std::path::Path::new));
        if d.val_path.is_some() && d.path.is_none() {
            return Err(invalid("data.val_path", "set", "needs data.path (the bundled corpus splits itself)"));
        }
        if format.has_records() && d.path.is_none() && d.sources.is_none() {
            return Err(invalid(
                "data.format",
                format!("\"{}\"", format.name()),
                "needs data.path (the training records) or data.sources; held-out records are data.val_path, else the last data.val_fraction of data.path",
            ));
        }
        if d.schema != Schema::Auto && !format.has_records() && d.sources.is_none() {
            return Err(invalid(
                "data.schema",
                format!("\"{}\"", d.schema.name()),
                "applies to data.format = \"jsonl\", \"parquet\" or \"arrow\" (how its records are read)",
            ));
        }
        if d.pack && !format.has_records() && d.sources.is_none() {
            return Err(invalid(
                "data.pack",
                true,
                "applies to data.format = \"jsonl\", \"parquet\" or \"arrow\" (token streams are windows already)",
            ));
        }
        if d.val_path.as_deref() == Some("") {
            return Err(invalid("data.val_path", "\"\"", "give a file, or leave it unset to split data.path"));
        }
        if !(d.val_fraction > 0.0 && d.val_fraction < 1.0) {
            return Err(invalid("data.val_fraction", d.val_fraction, "must be strictly between 0 and 1"));
        }
        if d.seq_len == Some(0) {
            return Err(invalid("data.seq_len", 0, "must be at least 1"));
        }
        if d.path.as_deref() == Some("") {
            return Err(invalid("data.path", "\"\"", "give a file, or leave it unset for the bundled corpus"));
        }
        Ok(())
    }
}
