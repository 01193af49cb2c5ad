//! `macrobatch plan`: the memory a configured run needs per rank and
//! process, the largest micro-batch under a memory size at the same global
//! batch, and what to change when nothing fits (the model is in
//! [`crate::planning`]).

use crate::memory::{self, Available};
use crate::planning::{compute_threads, largest_fitting, render, report, runtime_bytes, Backend, Knobs};
use crate::setup;
use anyhow::{bail, Context, Result};

/// `macrobatch plan`.
pub fn run(args: crate::PlanArgs) -> Result<()> {
    runtime_bytes();
    // The planned world is known before a DeepSpeed batch triple is checked against it.
    let mut sets = args.set.clone();
    sets.extend(args.world_size.map(|w| format!("dist.world_size={w}")));
    let mut cfg = setup::load_config(args.config.as_deref(), &sets, &args.deepspeed)?;
    if let Some(w) = args.world_size {
        cfg.dist.world_size = w;
    }
    if let Some(path) = &args.init_from {
        crate::train::plan_from_pretrained(path, &args.set, &mut cfg)?;
    }
    let world = cfg.dist.world_size;
    let backend = if world > 1 { crate::dist::Backend::Threads(world) } else { crate::dist::Backend::Single };
    // "auto" is resolved below for the planned world and --memory, not by
    // `train`'s planner for this machine's threads and memory.
    let auto_micro = setup::start_auto_micro(&mut cfg)?;
    // The plan needs the data set's bytes, not a full global batch of it
    // (`train` checks that): a large batch is planned on the bundled corpus.
    cfg.data.drop_last = false;
    let (plan, _) = match args.no_data {
        true => setup::resolve_shapes(cfg, backend)?,
        false => setup::resolve(cfg, backend)?,
    };
    let mut knobs = Knobs::of(&plan);
    if args.world_size.is_some() {
        // A planned cluster: one rank per process (per GPU / node slot).
        knobs.ranks_per_process = 1;
        knobs.backend = if knobs.world_size > 1 { Backend::Mpi } else { Backend::Single };
    }
    // The same spellings as train.memory_budget: a size, or a share of what is available.
    let threads = memory::allocating_threads(compute_threads(&plan.cfg), knobs.ranks_per_process);
    let available =
        || Available::now().usable(threads).context("cannot read the available memory from /proc; give --memory SIZE");
    let memory = match &args.memory {
        Some(s) => match config::parse_budget(s).map_err(anyhow::Error::msg).context("--memory")? {
            config::Budget::Bytes(b) => b,
            config::Budget::Fraction(f) => (available()? as f64 * f) as u64,
        },
        None => available()?,
    };
    if args.base_batch == Some(0) {
        bail!("--base-batch 0: the batch the learning rate was tuned for is at least 1 sequence; give that batch (e.g. --base-batch 256), or leave --base-batch out");
    }
    if auto_micro {
        if let Some(best) = largest_fitting(&plan, knobs, memory)? {
            knobs.micro = best.knobs.micro;
        }
    }
    let mut r = report(&plan, knobs, memory, memory, args.base_batch)?;
    r.auto_micro = auto_micro;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", render(&r));
    }
    Ok(())
}
