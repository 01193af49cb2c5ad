//! The model and trainer of a rank: the trainable tensors, the optimizer,
//! schedule and ZeRO options of the config, and where optimizer state is
//! offloaded.

use super::Plan;
use crate::family::{Family, LanguageModel};
use anyhow::{bail, Context, Result};
use comm::Communicator;
use config::{Config, OffloadOptimizer};
use engine::{LossScalerConfig, LrSchedule, Model, PipelineStage, TpRank, Trainer, TrainerOptions, ZeroConfig};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The whole model for this plan, storing activations in the configured
/// precision, with `train.trainable` applied.
pub fn model_for(plan: &Plan) -> Result<Box<dyn LanguageModel>> {
    model_for_rank(plan, TpRank::WHOLE)
}

/// [`model_for`] as tensor-parallel rank `tp` holds it: its slices of the
/// split tensors and the replicated ones whole (the whole model when `tp`
/// does not split).
pub fn model_for_rank(plan: &Plan, tp: TpRank) -> Result<Box<dyn LanguageModel>> {
    let family = match tp.is_split() {
        true => tensor_family(plan.family.as_ref(), tp)?,
        false => plan.family.clone(),
    };
    let mut model = family.build(plan.build())?;
    apply_trainable(&mut model, &trainable_patterns(&plan.cfg))?;
    let t = &plan.cfg.train;
    model.set_loss_terms(engine::LossTerms { label_smoothing: t.label_smoothing, z_loss: t.z_loss });
    if plan.cfg.train.objective == config::Objective::Dpo {
        model = Box::new(family::dpo::Dpo::new(model, plan.cfg.train.dpo_beta)?);
    }
    Ok(model)
}

/// The shape tensor-parallel rank `tp` of `family` holds, or the family's
/// reason it cannot split (heads not divisible by T, a family without a split).
pub fn tensor_family(family: &dyn Family, tp: TpRank) -> Result<Arc<dyn Family>> {
    family.tensor_parallel(tp).map_err(|e| {
        anyhow::anyhow!(e).context(format!("dist.tensor_parallel = {}: the model cannot be split", tp.size))
    })
}

/// The tensors to train: `train.trainable`, except that with `[lora]` and
/// the default `["*"]` only the adapters train (the base is frozen): A, B
/// and, with `use_dora`, the magnitudes.
pub fn trainable_patterns(cfg: &Config) -> Vec<String> {
    let everything = cfg.train.trainable.len() == 1 && cfg.train.trainable[0] == "*";
    if let Some(lora) = cfg.lora.as_ref().filter(|_| everything) {
        let mut adapters = vec!["*.lora_A.weight".to_string(), "*.lora_B.weight".to_string()];
        if lora.get("use_dora").and_then(toml::Value::as_bool) == Some(true) {
            adapters.push("*.lora_magnitude_vector".into());
        }
        return adapters;
    }
    cfg.train.trainable.clone()
}

/// Freezes every tensor that no `train.trainable` pattern names; a pattern
/// that names no tensor is an error (a typo would silently freeze).
pub fn apply_trainable(model: &mut impl Model, patterns: &[String]) -> Result<usize> {
    let names: Vec<String> = model.layout().tensors().iter().map(|t| t.name.clone()).collect();
    if let Some(p) = patterns.iter().find(|p| !names.iter().any(|n| config::name_matches(p, n))) {
        bail!(
            "train.trainable: pattern `{p}` names no tensor of this model (tensor names look like {}, {}; `*` matches any run of characters)",
            names.first().map_or("", String::as_str),
            names.get(2).map_or("", String::as_str)
        );
    }
    Ok(model.set_trainable(&|t| patterns.iter().any(|p| config::name_matches(p, &t.name))))
}

/// A trainer over freshly initialised parameters for this rank of `comm`
/// (rank 0's parameters are broadcast; ZeRO partitions as configured).
pub fn trainer_for(plan: &Plan, model: &impl Model, comm: &mut dyn Communicator) -> Result<Trainer> {
    trainer_from(plan, model, comm, None, &scratch_offload_root())
}

/// Where `verify` and `bench` offload optimizer state (no run folder):
/// a folder of this process under the temporary directory.
pub fn scratch_offload_root() -> PathBuf {
    std::env::temp_dir().join(format!("macrobatch-offload-{}", std::process::id()))
}

/// Removes the offload folder once every rank's files are gone (each
/// trainer removes its own `rank-R/`); a no-op if anything is left in it.
pub fn remove_offload_root(root: &Path) {
    let _ = std::fs::remove_dir(root);
}

/// Removes the offload folder of `verify` and `bench`
/// ([`scratch_offload_root`]) once their trainers are gone.
pub fn remove_scratch_offload_root() {
    remove_offload_root(&scratch_offload_root());
}

/// [`trainer_for`] starting from `initial` parameters (a checkpoint's or a
/// pretrained model's), read a segment at a time: no further full copy.
pub fn trainer_from(
    plan: &Plan,
    model: &impl Model,
    comm: &mut dyn Communicator,
    initial: Option<&[f32]>,
    offload_root: &Path,
) -> Result<Trainer> {
    let world_rank = comm.rank();
    let initial = initial.map_or(Initial::Fresh, Initial::Params);
    trainer_placed(plan, model, Placement::Whole(comm), initial, offload_root, world_rank)
}

/// Which part of the model a trainer holds, and the ranks it is data-parallel over.
pub enum Placement<'a> {
    /// The whole model, data-parallel over every rank of this communicator.
    Whole(&'a mut dyn Communicator),
    /// One pipeline stage (with tensor parallelism this rank's slices of
    /// it), data-parallel over `dp` (the ranks holding the same part).
    Stage {
        /// The stage.
        stage: &'a PipelineStage,
        /// The ranks holding the same stage.
        dp: &'a mut dyn Communicator,
    },
}

/// Where a trainer's parameters come from.
#[derive(Clone, Copy)]
pub enum Initial<'a> {
    /// A fresh initialisation from the plan's family and seed.
    Fresh,
    /// Model-wide parameters in memory (a whole checkpoint's, a pretrained
    /// model's).
    Params(&'a [f32]),
    /// The whole layout's range of whole tensors a segment covers, read
    /// when the trainer asks for it with at least this rank's values
    /// filled in (a sharded checkpoint's pieces).
    Segments(&'a dyn Fn(std::ops::Range<usize>) -> Result<Vec<f32>>),
}

/// The trainer of `placement` over `model` (whose model-wide `initial`
/// parameters, if given, are read a segment at a time; a fresh start
/// initialises the whole model's segments from the plan's family, and a
/// stage keeps its part), offloading under `offload_root/rank-{world_rank}`.
pub fn trainer_placed(
    plan: &Plan,
    model: &impl Model,
    placement: Placement<'_>,
    initial: Initial<'_>,
    offload_root: &Path,
    world_rank: usize,
) -> Result<Trainer> {
    let (cfg, o) = (&plan.cfg, &plan.cfg.optim);
    // The whole model's segments are what `init` is asked for (a stage
    // keeps its part).
    let segments = match &placement {
        Placement::Whole(_) => model.segments(),
        Placement::Stage { stage, .. } => stage.whole_segments().to_vec(),
    };
    let n_params = segments.last().map_or(0, |r| r.end);
    // The hyper-parameters only: the trainer sizes the state for its shard
    // of the trainable tensors (sizing it here for every parameter would
    // hold twice the model, frozen base included, while starting).
    let optimizer = super::optimizer::optimizer_of(cfg)?;
    let schedule = LrSchedule {
        max_lr: o.lr,
        min_lr: cfg.schedule.min_lr,
        warmup_steps: cfg.schedule.warmup_steps,
        total_steps: cfg.train.steps,
        decay: cfg.schedule.kind,
        decay_fraction: cfg.schedule.decay_fraction,
    };
    let options = TrainerOptions {
        grad_clip: (cfg.train.grad_clip > 0.0).then_some(cfg.train.grad_clip),
        normalization: cfg.train.loss_normalization,
        bucket_elems: bucket_elems(cfg),
        overlap_comm: cfg.dist.overlap_comm,
        precision: cfg.train.precision,
        loss_scaler: LossScalerConfig {
            initial_scale: cfg.train.initial_loss_scale,
            window: cfg.train.loss_scale_window,
            hysteresis: cfg.train.loss_scale_hysteresis,
            min_scale: cfg.train.min_loss_scale,
        },
    };
    let zero = ZeroConfig { stage: cfg.dist.zero_stage, reduce_every_micro_step: cfg.dist.reduce_every_micro_step };
    // By model segment: a stage's trainer asks only for its own.
    // A segment that cannot be read is reported after the build (the
    // trainer asks for segments infallibly).
    let failed = std::cell::RefCell::new(None);
    let init = |seg: usize| match initial {
        Initial::Params(p) => Cow::Borrowed(&p[segments[seg].clone()]),
        Initial::Fresh => Cow::Owned(plan.family.init_segment(cfg.train.seed, seg)),
        Initial::Segments(read) => Cow::Owned(read(segments[seg].clone()).unwrap_or_else(|e| {
            failed.borrow_mut().get_or_insert(e);
            vec![0.0; segments[seg].len()]
        })),
    };
    if let Initial::Params(p) = initial {
        if p.len() != n_params {
            bail!("the initial parameters hold {} values, the model {n_params}", p.len());
        }
    }
    let built = match placement {
        Placement::Whole(comm) => Trainer::distributed_with(model, &init, optimizer, schedule, options, zero, comm),
        Placement::Stage { stage, dp } => Trainer::for_stage(stage, &init, optimizer, schedule, options, zero, dp),
    };
    if let Some(e) = failed.into_inner() {
        return Err(e);
    }
    let mut trainer = built?;
    super::optimizer::apply_no_decay(cfg, &mut trainer)?;
    match cfg.dist.offload_optimizer {
        OffloadOptimizer::None => {}
        OffloadOptimizer::Disk => {
            // After the constructor's broadcasts from rank 0, which created
            // the run folder before taking part: no rank makes it first.
            let dir = offload_root.join(format!("rank-{world_rank}"));
            trainer
                .offload_optimizer(&dir)
                .with_context(|| format!("dist.offload_optimizer = \"disk\": cannot set up {}", dir.display()))?;
        }
    }
    Ok(trainer)
}

/// Elements per gradient all-reduce bucket (`dist.bucket_mb` of f32).
pub fn bucket_elems(cfg: &Config) -> usize {
    ((cfg.dist.bucket_mb * (1 << 20) as f64 / 4.0) as usize).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap;

    /// Starting a trainer from parameters already in memory (a pretrained
    /// model, a checkpoint) allocates only what the trainer keeps. It once
    /// also held a copy of each segment beside its own (the embedding, most
    /// of a small model) and AdamW state for every parameter before cutting
    /// it to the trainable ones: twice the model more while starting.
    /// LoRA on a tiny Llama whose frozen embedding is most of the model;
    /// heap bytes of this thread, which runs the constructor.
    #[test]
    fn a_trainer_from_initial_parameters_allocates_only_what_it_keeps() {
        let sets: Vec<String> = [
            "model.family=llama",
            "model.preset=tiny",
            "model.vocab_size=50304",
            "lora.r=4",
            "lora.target_modules=[\"all-linear\"]",
        ]
        .map(String::from)
        .to_vec();
        let cfg = super::super::load_config(None, &sets, &Default::default()).unwrap();
        let plan = crate::planning::plan(cfg, crate::dist::Backend::Single).unwrap();
        let model = model_for_rank(&plan, TpRank::WHOLE).unwrap();
        let initial: Vec<f32> = (0..model.segments().len()).flat_map(|s| plan.family.init_segment(0, s)).collect();
        let embedding = model.segments()[0].len() * 4;
        let base = heap::reset_peak();
        let mut single = comm::SingleProcess::new();
        let trainer = trainer_from(&plan, &model, &mut single, Some(&initial), &scratch_offload_root()).unwrap();
        let grew = (heap::peak() - base) as usize;
        let m = trainer.memory();
        let kept = m.model_states() + m.comm_buffers;
        // What the trainer keeps, plus bookkeeping (layout copy, update
        // chunks, flags): far less than the embedding a copy would add.
        assert!(grew <= kept + embedding / 8, "starting took {grew} bytes, the trainer keeps {kept}");
        assert!(kept >= m.params && m.optimizer < m.params / 4, "{m:?}");
    }
}
