//! Evaluation: the mean validation loss, on the last step and every
//! `train.eval_every` steps (through every stage of a pipeline).

use crate::heap::{self, Phase};
use crate::setup::{Plan, RankComms};
use anyhow::{bail, Result};
use engine::{StagedModel, TokenBatch, Trainer};

/// The validation loss of step `step` when it is due: measured by rank 0,
/// at ZeRO-3 by every rank together (evaluation gathers segments), with a
/// pipeline by the stages of data rank 0 together (each runs its layers).
pub fn maybe_evaluate(
    plan: &Plan,
    step: u64,
    trainer: &mut Trainer,
    model: &mut impl StagedModel<Batch = TokenBatch>,
    comms: &mut RankComms,
) -> Result<Option<f64>> {
    let cfg = &plan.cfg.train;
    let is_eval = step == cfg.steps || (cfg.eval_every > 0 && step.is_multiple_of(cfg.eval_every));
    if !(is_eval && comms.evaluates(plan.cfg.dist.zero_stage == 3)) {
        return Ok(None);
    }
    heap::set_phase(Phase::Eval);
    Ok(Some(evaluate(trainer, model, comms, plan)?))
}

/// Mean validation loss over the first `eval_batches` micro-batches (at
/// ZeRO-3 and through a pipeline a collective: every rank taking part
/// evaluates the same batches).
fn evaluate(
    trainer: &mut Trainer,
    model: &mut impl StagedModel<Batch = TokenBatch>,
    comms: &mut RankComms,
    plan: &Plan,
) -> Result<f64> {
    let (val, micro) = (&plan.val, plan.batch.micro);
    let n = (micro * plan.cfg.train.eval_batches).min(val.n_samples());
    let idx: Vec<usize> = (0..n).collect();
    let (mut sum, mut count) = (0.0, 0u64);
    for chunk in idx.chunks(micro) {
        let s = comms.loss(trainer, model, &val.batch(chunk)?)?;
        sum += s.loss_sum;
        count += s.n_targets;
    }
    if count == 0 {
        // Loading drops (or refuses) examples without targets, so this is
        // unreachable; a loss of 0 would read as a perfect model.
        bail!("the validation batches hold no target tokens: no validation loss can be measured; check data.val_path");
    }
    Ok(sum / count as f64)
}
