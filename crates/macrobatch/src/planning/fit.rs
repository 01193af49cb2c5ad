//! The plan of a run with `batch.micro = "auto"` resolved: the memory
//! budget (`train.memory_budget`) and the largest micro-batch whose
//! planned peak fits it.

use super::{compute_threads, estimate, human, largest_fitting, render, report, Knobs};
use crate::memory;
use crate::setup::Plan;
use anyhow::{bail, Context, Result};

/// The [`Plan`] of `cfg` on `backend` ([`crate::setup::resolve`]), with
/// `batch.micro = "auto"` resolved to the largest micro-batch that fits
/// the memory budget.
pub fn plan(cfg: config::Config, backend: crate::dist::Backend) -> Result<Plan> {
    let (mut plan, auto_micro) = crate::setup::resolve(cfg, backend)?;
    if auto_micro {
        choose_micro(&mut plan)?;
    }
    Ok(plan)
}

/// The per-process memory budget of `train.memory_budget` (default all of
/// what is available now; the plan keeps its margin inside it). A size
/// above what is available is cut to it: the memory check would refuse
/// whatever it picked beyond.
fn memory_budget(cfg: &config::Config, ranks_per_process: usize) -> Result<u64> {
    let threads = memory::allocating_threads(compute_threads(cfg), ranks_per_process);
    let available = memory::Available::now().usable(threads);
    let need_available =
        || available.context("cannot read the available memory from /proc; set train.memory_budget to a size");
    Ok(match cfg.train.memory_budget {
        None => need_available()?,
        Some(config::Budget::Fraction(f)) => (need_available()? as f64 * f) as u64,
        Some(config::Budget::Bytes(b)) => match available {
            Some(a) if a < b => {
                eprintln!(
                    "note: train.memory_budget = {} is more than the {} available; planning for what is available",
                    human(b),
                    human(a)
                );
                a
            }
            _ => b,
        },
    })
}

/// `batch.micro = "auto"`: the largest micro-batch whose planned peak fits
/// the budget, with the accumulation steps that keep the global batch
/// (never a smaller global batch). The choice is written into the config, so
/// `config.resolved.toml` (and a resume) use the same factorization.
fn choose_micro(plan: &mut Plan) -> Result<()> {
    let budget = memory_budget(&plan.cfg, plan.backend.ranks_per_process())?;
    let knobs = Knobs::of(plan);
    let Some(best) = largest_fitting(plan, knobs, budget)? else {
        let at_1 = estimate(plan, knobs)?;
        let report = report(plan, knobs, budget, budget, None)?;
        bail!(
            "batch.micro = \"auto\": not even micro-batch 1 fits the memory budget of {} ({} per process planned at micro 1); change one of these (global batch {} kept):\n{}",
            human(budget),
            human(at_1.per_process()),
            plan.batch.global,
            render(&report)
        );
    };
    plan.memory_budget = Some(budget);
    plan.set_micro(best.knobs.micro)?;
    eprintln!(
        "batch.micro = \"auto\": micro {} × K {} × W {} (global {}) plans {} per process under the budget of {}",
        plan.batch.micro,
        plan.batch.accumulation_steps,
        plan.batch.world_size,
        plan.batch.global,
        human(best.per_process()),
        human(budget)
    );
    Ok(())
}
