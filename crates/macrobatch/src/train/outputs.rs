//! The run folder and rank 0's outputs in it: the folder planned on every
//! rank, created (or on `--resume` reused) and locked by rank 0 alone, the
//! run id, resolved config and tokenizer written into it, `metrics.jsonl`
//! (and with `train.tensorboard` the TensorBoard log) opened, and what a run that failed before its first step leaves behind
//! removed.

use crate::charts;
use crate::checkpoint;
use crate::family;
use crate::folder::{self, FolderLock, RUN_ID_FILE};
use crate::metrics::{Reporter, StepRecord};
use crate::setup::{remove_offload_root, Plan};
use crate::tensorboard::TensorBoard;
use crate::TrainArgs;
use anyhow::{anyhow, bail, Context, Result};
use config::Micro;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Rank 0's outputs.
pub struct Outputs {
    /// The run folder.
    pub dir: PathBuf,
    /// `metrics.jsonl` and the progress line.
    pub reporter: Reporter,
    /// `train.tensorboard`: the same numbers as TensorBoard scalars.
    pub tensorboard: Option<TensorBoard>,
    /// `train.mlflow`: the same numbers as MLflow metrics.
    pub mlflow: Option<crate::mlflow::Mlflow>,
}

impl Outputs {
    /// Records one step: its `metrics.jsonl` line, then its scalars.
    pub fn record(&mut self, r: &StepRecord) -> Result<()> {
        self.reporter.record(r)?;
        if let Some(m) = &mut self.mlflow {
            m.record(r)?;
        }
        match &mut self.tensorboard {
            Some(tb) => tb.record(r),
            None => Ok(()),
        }
    }
}

/// The folder a run writes: checked on every rank before anything runs,
/// created by rank 0 alone (under MPI the other ranks never touch the file
/// system), locked until the run ends.
pub struct RunFolder {
    /// `--resume DIR`, `--out DIR` or `runs/run-<id>`.
    planned: PathBuf,
    /// Whether the name was generated: created exclusively, with a suffix
    /// when taken.
    generated: bool,
    /// Whether the run continues the folder's checkpoint.
    resuming: bool,
    /// Whether this run creates the folder (nothing was there).
    creates: bool,
    /// The folder's lock, held until this value is dropped.
    lock: Mutex<Option<FolderLock>>,
    /// The folder, once rank 0 made it.
    made: OnceLock<PathBuf>,
    /// `dist.offload_optimizer = "disk"`: `offload/` in the folder, set once
    /// the folder is known.
    pub offload_root: Arc<OnceLock<PathBuf>>,
}

impl RunFolder {
    /// The folder of a run: `resume_dir` (whose `lock` is already held), or
    /// a new folder ([`output_dir`]) refused if it holds anything of the
    /// user's.
    pub fn plan(args: &TrainArgs, resume_dir: Option<PathBuf>, run_id: &str, lock: Option<FolderLock>) -> Result<Self> {
        let resuming = resume_dir.is_some();
        let (planned, generated) = match resume_dir {
            Some(d) => (d, false),
            None => output_dir(args, run_id)?,
        };
        let creates = !resuming && !planned.exists();
        Ok(Self {
            planned,
            generated,
            resuming,
            creates,
            lock: Mutex::new(lock),
            made: OnceLock::new(),
            offload_root: Arc::default(),
        })
    }

    /// Rank 0: creates and locks a new run's folder (or takes the resumed
    /// one) and returns it.
    pub fn make(&self) -> Result<PathBuf> {
        let d = if self.resuming {
            self.planned.clone()
        } else {
            let d = create_run_dir(&self.planned, self.generated)?;
            // Checked again under the lock: another process may have
            // started a run here since the check before the plan.
            let lock = folder::lock_then(&d, "train", || folder::check_new_run(&d, family::WEIGHTS_FILE))?;
            if folder::unstarted_run(&d) {
                eprintln!("{}: replacing what a run that never finished a step left there", d.display());
                folder::clear_unstarted(&d, false);
            }
            *self.lock.lock().map_err(|_| anyhow!("lock slot poisoned"))? = Some(lock);
            d
        };
        let _ = self.offload_root.set(d.join("offload"));
        let _ = self.made.set(d.clone());
        Ok(d)
    }

    /// Ranks of other processes: never create the folder (rank 0 has by the
    /// time the trainers' broadcast completes), but offload into it.
    pub fn follow(&self) {
        let _ = self.offload_root.set(self.planned.join("offload"));
    }

    /// After the ranks returned: the offload folder removed; a finished run
    /// plotted; after a failure, what a new run wrote removed (anything else
    /// that appeared meanwhile, such as a `tee DIR/log.txt`, stays, and so
    /// does a folder holding it).
    pub fn after_run(&self, result: &Result<()>) {
        if let Some(root) = self.offload_root.get() {
            remove_offload_root(root);
        }
        let Some(dir) = self.made.get() else { return };
        match result {
            Ok(()) => charts::after_train(dir),
            Err(_) if !self.resuming => folder::remove_unstarted(dir, self.creates),
            Err(_) => {}
        }
    }
}

/// Where a new run writes: `--out`, or `runs/run-<id>` (created exclusively
/// by [`RunFolder::make`]). Refuses a folder that holds anything but the
/// leftovers of an unstarted run of ours ([`folder::check_new_run`]).
fn output_dir(args: &TrainArgs, run_id: &str) -> Result<(PathBuf, bool)> {
    let Some(dir) = &args.out else { return Ok((PathBuf::from("runs").join(format!("run-{run_id}")), true)) };
    folder::check_new_run_unlocked(dir, family::WEIGHTS_FILE)?;
    Ok((dir.clone(), false))
}

/// The config with every derived value written out.
pub fn resolved_toml(plan: &Plan) -> String {
    let mut resolved = plan.cfg.clone();
    resolved.batch = config::BatchConfig {
        global: Some(plan.batch.global),
        micro: Some(Micro::Sequences(plan.batch.micro)),
        accumulation_steps: Some(plan.batch.accumulation_steps),
    };
    resolved.data.seq_len = Some(plan.train.seq_len());
    // A shape pinned from a model names its source, not a preset it did not use.
    if resolved.model.source.is_some() {
        resolved.model.preset = None;
    }
    resolved.to_toml()
}

/// Creates `dir` for a new run: exclusively for a generated name (two runs
/// started at once never share a folder), or as given by `--out`.
fn create_run_dir(dir: &Path, exclusive: bool) -> Result<PathBuf> {
    if !exclusive {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))?;
        return Ok(dir.to_path_buf());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create output directory {}", parent.display()))?;
    }
    for i in 0..1000 {
        let candidate = if i == 0 { dir.to_path_buf() } else { PathBuf::from(format!("{}-{i}", dir.display())) };
        match std::fs::create_dir(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create output directory {}", candidate.display())),
        }
    }
    bail!("cannot create a new output directory next to {}: 1000 names taken", dir.display())
}

/// Rank 0's outputs in `dir`: the run id (a new run), the resolved config
/// and tokenizer, and `metrics.jsonl` (cut back to `resume_step` on a
/// resume), announced by the run's first line; with `train.tensorboard`
/// the TensorBoard log into `tensorboard_dir` (default `dir/tensorboard`).
pub fn open_outputs(
    plan: &Plan,
    dir: &Path,
    resume_step: Option<u64>,
    run_id: &str,
    tensorboard_dir: Option<&Path>,
) -> Result<Outputs> {
    if resume_step.is_none() {
        nn::io::write_atomic(&dir.join(RUN_ID_FILE), format!("{run_id}\n").as_bytes())?;
    }
    nn::io::write_atomic(&dir.join(checkpoint::CONFIG), resolved_toml(plan).as_bytes())?;
    // The tokenizer travels with the run, so `generate` and transformers
    // read the model's text as it was trained.
    plan.tokenizer.save_pretrained(dir).with_context(|| format!("cannot save the tokenizer into {}", dir.display()))?;
    let metrics = dir.join("metrics.jsonl");
    if let Some(step) = resume_step {
        checkpoint::truncate_metrics(&metrics, step, |w| eprintln!("{w}"))?;
    }
    let reporter = Reporter::new(&metrics, plan.cfg.train.steps, plan.cfg.train.log_every, resume_step.is_some())?;
    reporter.println(&format!(
        "macrobatch: {} {} ({}, {}), batch {} = micro {} × K {} × {} {} ({:?}), seq {} | {} train / {} val sequences, {} steps/epoch | {} threads, {} | out {}",
        plan.family.name(),
        plan.cfg.model.label(),
        crate::family::params_label(&*plan.family),
        plan.family.describe(),
        plan.batch.global,
        plan.batch.micro,
        plan.batch.accumulation_steps,
        if plan.grid.is_split() { "D" } else { "W" },
        plan.batch.world_size,
        plan.backend,
        plan.train.seq_len(),
        plan.train.n_samples(),
        plan.val.n_samples(),
        plan.sampler.steps_per_epoch(),
        rayon::current_num_threads(),
        linalg::vector_isa(),
        dir.display()
    ));
    if plan.cfg.train.precision == engine::Precision::Bf16 {
        reporter.println(linalg::bf16::describe());
    }
    if plan.grid.is_split() {
        reporter.println(&plan.grid.describe());
    }
    if plan.grid.is_pipeline() {
        let schedule = engine::Schedule::new(plan.grid.schedule, plan.grid.stages, plan.batch.accumulation_steps)?;
        reporter.println(schedule.to_string().trim_end());
    }
    let tensorboard = plan.cfg.train.tensorboard.then(|| {
        let tb = tensorboard_dir.map_or_else(|| dir.join("tensorboard"), Path::to_path_buf);
        reporter.println(&format!("TensorBoard: tensorboard --logdir {}", tb.display()));
        TensorBoard::new(tb)
    });
    let mlflow = match &plan.cfg.train.mlflow {
        Some(uri) => {
            let root = crate::mlflow::tracking_dir(uri)?;
            let resolved: toml::Table = toml::from_str(&resolved_toml(plan)).context("the resolved config")?;
            let params = crate::mlflow::params(&resolved);
            let experiment = &plan.cfg.train.mlflow_experiment;
            let log = crate::mlflow::Mlflow::new((root, experiment), (dir, run_id), params, resume_step)?;
            reporter.println(&log.describe());
            Some(log)
        }
        None => None,
    };
    Ok(Outputs { dir: dir.to_path_buf(), reporter, tensorboard, mlflow })
}
