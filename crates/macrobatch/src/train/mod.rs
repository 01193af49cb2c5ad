//! `macrobatch train`: validate the whole plan, then run optimizer steps on
//! every rank.
//!
//! [`run`] finds where the run starts ([`start`]: a new run, `--resume`,
//! `--init-from`), validates the plan ([`crate::setup`]), plans the run
//! folder ([`outputs`]) and runs the ranks. Each rank runs the loop of
//! [`rank`], whose parts live beside it (the rank's groups and its part
//! of the model are [`crate::setup::RankComms`]): evaluation ([`eval`]), checkpoint
//! policy and the final save ([`checkpointing`]), metrics and memory
//! reports ([`reports`]), the stop agreement ([`stop`]) and `--dump-steps`
//! ([`dump`]).

mod checkpointing;
mod dump;
mod ema;
mod eval;
mod outputs;
mod pieces;
mod rank;
mod reports;
pub(crate) mod start;
pub use start::plan_from_pretrained;
mod stop;
mod val_watch;

use crate::dist::{self, Backend, Fault};
use crate::folder;
use crate::planning::check_memory;
use crate::planning::plan;
use crate::ranks::run_thread_ranks;
use crate::setup::{load_config, Plan};
use crate::TrainArgs;
use anyhow::{bail, Context, Result};
use comm::Communicator;
use outputs::{open_outputs, RunFolder};
use rank::train_rank;
use start::{Handoff, Start};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use stop::StopRequests;

/// How a training invocation ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// All `train.steps` done and the model saved.
    Finished,
    /// Stopped early by `--stop-after` (checkpoint written).
    StoppedAfter,
    /// Stopped by a signal (checkpoint written): exit 128 + its number.
    Signalled(i32),
}

/// `macrobatch train`.
pub fn run(args: TrainArgs) -> Result<Outcome> {
    // First: a signal while the config, data or model load is honoured like
    // one during a step (stop after the first step, with a checkpoint)
    // instead of ending the process silently.
    let stop = StopRequests::install(args.stop_after)?;
    let writes_folder = folder::writes_run_folder()?;
    let resume_dir = start::resume_dir(&args)?;
    // A resumed folder's lock is taken before anything in it is read, and
    // held (in the run folder) until this function returns.
    let (mut cfg, mut resume, resume_lock) = match &resume_dir {
        Some(dir) => {
            let (cfg, loaded, lock) = start::load_resumed(dir, &args, writes_folder)?;
            (cfg, Some(loaded), lock)
        }
        None => (load_config(args.config.as_deref(), &args.set, &args.deepspeed)?, None, None),
    };
    if args.tensorboard.is_some() {
        cfg.train.tensorboard = true;
    }
    // Checked before anything is read or created.
    cfg.validate()?;
    if let Some(dir) = &args.tensorboard {
        crate::tensorboard::check_writable(dir)?;
    }
    // Before anything runs on the pool: packing a frozen base at
    // `--init-from` already does.
    if cfg.train.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.train.threads)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let fault = Fault::from_env()?;
    if let Some(delay) = fault.as_ref().and_then(Fault::load_delay) {
        eprintln!("injected fault: loading takes {:.1} s longer", delay.as_secs_f64());
        std::thread::sleep(delay);
    }
    let init_params = start::init_from(args.init_from.as_deref(), &args.set, &mut cfg, resume.is_some())?;
    let backend = dist::detect(cfg.dist.world_size)?;
    let plan = Arc::new(plan(cfg, backend)?);
    if let Some(l) = &mut resume {
        start::check_resume(&plan, l)?;
        start::onto_run_layout(&plan, l)?;
    }
    let base = start::base_reference(&plan, resume.as_ref(), (args.init_from.as_deref(), writes_folder))?;
    let cfg = &plan.cfg;
    if args.dump_steps.is_some() && plan.backend.world_size() > 1 {
        bail!("--dump-steps records one rank's run; use dist.world_size = 1 (and dist.pipeline_parallel = 1)");
    }
    for w in cfg.warnings() {
        eprintln!("warning: {w}");
    }
    check_memory(&plan)?;
    let run_id = start::run_id(resume_dir.as_deref(), resume.as_ref(), writes_folder)?;
    let folder = RunFolder::plan(&args, resume_dir, &run_id, resume_lock)?;
    let resume_step = resume.as_ref().map(|l| l.state.step);
    // Every rank of this process takes the start once; the last lets it go.
    let ranks_here = backend.ranks_per_process();
    let start = Start {
        resume: resume.map(|l| Handoff::new(l, ranks_here)),
        init_params: init_params.map(|p| Handoff::new(p, ranks_here)),
        stop: stop.clone(),
        fault,
        run_id: run_id.clone(),
        dump_steps: args.dump_steps.clone(),
        merge: args.merge,
        base,
        tensorboard: args.tensorboard.clone(),
        offload_root: folder.offload_root.clone(),
    };
    let result = run_ranks(&plan, &folder, &start, resume_step);
    folder.after_run(&result);
    result?;
    Ok(stop.outcome())
}

/// Runs every rank of `plan` in this process: one, `W` threads, or this
/// process's MPI rank. Rank 0 creates the run folder and writes its
/// outputs; every rank checked the folder before.
fn run_ranks(plan: &Arc<Plan>, folder: &RunFolder, start: &Start, resume_step: Option<u64>) -> Result<()> {
    let timeout = Duration::from_secs_f64(plan.cfg.dist.timeout_s);
    let rank0_outputs = || {
        folder.make().and_then(|dir| open_outputs(plan, &dir, resume_step, &start.run_id, start.tensorboard.as_deref()))
    };
    match plan.backend {
        Backend::Single => {
            rank0_outputs().and_then(|out| train_rank(plan, &mut comm::SingleProcess::new(), Some(out), start))
        }
        Backend::Threads(world) => rank0_outputs().and_then(|out| {
            let outputs = Mutex::new(Some(out));
            let plan = plan.clone();
            let start = start.clone();
            run_thread_ranks(world, timeout, move |c| {
                let out = if c.rank() == 0 { outputs.lock().ok().and_then(|mut o| o.take()) } else { None };
                train_rank(&plan, c, out, &start)
            })
        }),
        Backend::Mpi(n) => {
            // A second thread calls MPI only to overlap a group of several ranks.
            let mut c = dist::mpi_comm(timeout, plan.cfg.dist.overlap_comm && n > 1)?;
            let r = match c.rank() {
                0 => rank0_outputs().and_then(|out| train_rank(plan, c.as_mut(), Some(out), start)),
                _ => {
                    folder.follow();
                    train_rank(plan, c.as_mut(), None, start)
                }
            };
            if let Err(e) = &r {
                c.abort(&format!("{e:#}"));
            }
            r
        }
    }
}
