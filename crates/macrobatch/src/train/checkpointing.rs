//! Checkpoint policy: when a step is saved (every `train.checkpoint_every`
//! steps, the last step, and whenever the ranks agreed to stop), the full
//! state gathered to rank 0, written while the other ranks wait, the
//! newest `train.keep_checkpoints` kept; and the final save of the model.

use super::ema::Ema;
use super::outputs::{resolved_toml, Outputs};
use super::start::Start;
use crate::checkpoint::{self, TrainerState, ValWatchState};
use crate::family::base_ref::{self, BaseRef};
use crate::family::{Build, Family};
use crate::heap::{self, Phase};
use crate::ranks::{all_ranks_phase, rank0_phase};
use crate::setup::{FullState, Plan, RankComms};
use anyhow::{bail, Context, Result};
use comm::Communicator;
use engine::{ParamLayout, Trainer};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a checkpoint holds besides the trainer's state, and which older
/// checkpoint pruning spares.
#[derive(Default)]
pub struct Extras<'e> {
    /// Early stopping's and keep-best's history.
    pub val_watch: Option<ValWatchState>,
    /// The best checkpoint's step (`train.keep_best`): never pruned.
    pub spare: Option<u64>,
    /// The moving average of the weights (`train.ema_decay`).
    pub ema: Option<&'e Ema>,
}

/// When and how a run's checkpoints are written.
pub struct Checkpoints<'a> {
    plan: &'a Plan,
    start: &'a Start,
    /// Wherever the master weights are sharded, gathering them is a
    /// collective every rank joins.
    all_ranks_gather: bool,
    /// Heartbeat of rank-0-only phases: well inside every rank's timeout.
    heartbeat: Duration,
    /// The config saved into every checkpoint.
    config_toml: String,
    /// Rank 0, with `train.checkpoint_async`: the step and writer of the
    /// checkpoint in flight (at most one).
    pending: Option<(u64, Writer)>,
}

impl<'a> Checkpoints<'a> {
    /// The policy of `plan` for a rank holding `trainer`.
    pub fn new(plan: &'a Plan, start: &'a Start, trainer: &Trainer) -> Self {
        Self {
            plan,
            start,
            all_ranks_gather: trainer.master_sharded(),
            heartbeat: Duration::from_secs_f64((plan.cfg.dist.timeout_s / 4.0).clamp(0.001, 1.0)),
            config_toml: resolved_toml(plan),
            pending: None,
        }
    }

    /// Whether step `step` is saved: every `train.checkpoint_every` steps
    /// and the last, and whenever the ranks agreed to `stop`.
    pub fn due(&self, step: u64, stop: bool) -> bool {
        let (every, last) = (self.plan.cfg.train.checkpoint_every, step == self.plan.cfg.train.steps);
        // A sharded run's final model is its last checkpoint.
        stop || (every > 0 && step.is_multiple_of(every)) || (last && (every > 0 || self.sharded()))
    }

    /// This rank's part in gathering the full state of a `due` step (a
    /// collective at ZeRO ≥ 1, with sharded master weights, and over a
    /// pipeline's stages); rank 0 gets it, model-wide at any pipeline width.
    pub fn gather(
        &self,
        due: bool,
        step: u64,
        trainer: &mut Trainer,
        comms: &mut RankComms,
    ) -> Result<Option<FullState>> {
        if !(due && self.takes_part(comms)) {
            return Ok(None);
        }
        heap::set_phase(Phase::Checkpoint);
        let what = || format!("writing the checkpoint of step {step}: {}", heap::advice(Phase::Checkpoint));
        comms.full_state(trainer).with_context(what)
    }

    /// Whether this rank holds part of what a gather assembles: the
    /// data-parallel rank 0 of each stage (rank 0 without a pipeline), and
    /// every rank wherever the state is sharded.
    fn takes_part(&self, comms: &RankComms) -> bool {
        comms.dp_rank() == 0 || self.plan.cfg.dist.zero_stage >= 1 || self.all_ranks_gather
    }

    /// Ranks other than 0 on a `due` step: wait, exchanging heartbeats,
    /// while rank 0 writes.
    pub fn wait_for_rank0(&self, due: bool, comm: &mut dyn Communicator) -> Result<()> {
        if due {
            rank0_phase(comm, self.heartbeat, None::<fn() -> Result<()>>)?;
        }
        Ok(())
    }

    /// Rank 0 on a `due` step without the full state (which cannot happen):
    /// the phase the other ranks wait in, kept paired.
    pub fn skip_write(&self, comm: &mut dyn Communicator) -> Result<()> {
        rank0_phase(comm, self.heartbeat, Some(|| Ok(())))?;
        Ok(())
    }

    /// Rank 0: what writing step `step`'s checkpoint into `out.dir` takes
    /// (`best`: the new best, linked as `checkpoints/best` once written).
    #[allow(clippy::too_many_arguments)]
    fn job<'e>(
        &self,
        out: &Outputs,
        step: u64,
        state: FullState,
        trainer: &Trainer,
        layout: &ParamLayout,
        extras: Extras<'e>,
        best: bool,
        rank: usize,
    ) -> Job<'e> {
        let (plan, cfg, fault) = (self.plan, &self.plan.cfg, self.start.fault);
        let (mut params, optimizer) = state;
        if fault.is_some_and(|f| f.poisons(step)) {
            let last = params.len() - 1;
            params[last] = f32::NAN;
        }
        let ema = extras.ema.map(|e| e.tensors().into_iter().map(|(n, s, v)| (n, s, Cow::Borrowed(v))).collect());
        let state = self.trainer_state(step, trainer, &extras);
        Job {
            dir: out.dir.clone(),
            family: plan.family.clone(),
            base: self.start.base.clone(),
            layout: layout.clone(),
            params,
            optimizer,
            state,
            config_toml: self.config_toml.clone(),
            ema,
            keep: (cfg.train.keep_checkpoints, extras.spare),
            best,
            delay: fault.and_then(|f| f.checkpoint_delay(rank, step)),
        }
    }

    /// What a checkpoint of step `step` records besides tensors.
    fn trainer_state(&self, step: u64, trainer: &Trainer, extras: &Extras<'_>) -> TrainerState {
        let (plan, cfg) = (self.plan, &self.plan.cfg);
        let (epoch, step_in_epoch) = plan.sampler.position(step);
        TrainerState {
            step,
            n_updates: trainer.optimizer().n_updates(),
            epoch,
            step_in_epoch,
            seed: cfg.train.seed,
            global_batch: plan.batch.global,
            world_size: plan.batch.world_size,
            optimizer: cfg.optim.name,
            schedule_step: Some(trainer.n_steps()),
            loss_scaler: trainer.loss_scaler().map(|s| checkpoint::ScalerState {
                scale: s.scale,
                good_steps: s.good_steps,
                hysteresis_left: s.hysteresis_left,
                n_skipped: s.n_skipped,
            }),
            run_id: Some(self.start.run_id.clone()),
            val_watch: extras.val_watch,
            mixture_drawn: plan.sampler.mixture_drawn(step),
        }
    }

    /// Whether checkpoints are sharded (`train.checkpoint_sharded`).
    pub fn sharded(&self) -> bool {
        self.plan.cfg.train.checkpoint_sharded
    }

    /// Every rank, on a `due` step of a sharded run: writes its share of
    /// the state as pieces (in parallel, nothing gathered) into the
    /// checkpoint's temporary folder, which rank 0 (holding `out`) gets
    /// back to [`Checkpoints::commit_sharded`] once every rank succeeded.
    /// A rank that fails fails the step on every rank, and nothing is
    /// published.
    pub fn write_pieces(
        &self,
        step: u64,
        trainer: &mut Trainer,
        comms: &mut RankComms,
        out: Option<&Outputs>,
        whole: &ParamLayout,
    ) -> Result<(Option<PathBuf>, u64)> {
        heap::set_phase(Phase::Checkpoint);
        // Rank 0's run folder: another process may have planned another name.
        let run_dir = broadcast_path(comms.world, out.map(|o| o.dir.as_path()))?;
        let tmp = checkpoint::sharded_tmp(&run_dir, step);
        // A folder rank 0 could not make fails its own write, so the
        // failure is every rank's (the others' writes fail too).
        let prepare = out.map(|_| {
            || -> Result<Result<()>> {
                Ok((|| {
                    if tmp.exists() {
                        std::fs::remove_dir_all(&tmp).with_context(|| format!("cannot clear {}", tmp.display()))?;
                    }
                    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))
                })())
            }
        });
        let prepared = rank0_phase(comms.world, self.heartbeat, prepare)?.unwrap_or(Ok(()));
        let (fault, rank) = (self.start.fault, comms.world.rank());
        let poison = out.is_some() && fault.is_some_and(|f| f.poisons(step));
        let share = super::pieces::Share::of(comms, trainer);
        // On a thread of its own (its heap counted there): every rank
        // heartbeats until all are done, however long the slowest takes.
        let work = || -> Result<u64> {
            prepared?;
            // A test fault: this rank's share takes longer.
            if let Some(d) = fault.and_then(|f| f.checkpoint_delay(rank, step)) {
                std::thread::sleep(d);
            }
            let base = heap::mark();
            super::pieces::write(&share, trainer, whole, &tmp, poison)?;
            // A test fault: the rank dies or fails with its pieces written.
            if let Some(f) = fault {
                f.maybe_fire_in_checkpoint(rank, step)?;
            }
            Ok((heap::peak_since_mark() - base).max(0) as u64)
        };
        let (mine, failed) = all_ranks_phase(comms.world, self.heartbeat, work)?;
        let mine = mine.with_context(|| format!("writing this rank's pieces of the checkpoint of step {step}"));
        if failed > 0 {
            if out.is_some() {
                checkpoint::discard(&run_dir, &tmp);
            }
            mine?;
            bail!(
                "{failed} rank(s) could not write their pieces of the checkpoint of step {step} (see their errors); nothing was published and the previous checkpoints stay"
            );
        }
        Ok((out.map(|_| tmp), mine?))
    }

    /// Rank 0, after [`Checkpoints::write_pieces`], while the other ranks
    /// wait ([`Checkpoints::wait_for_rank0`]): publishes the pieces in
    /// `tmp` as step `step`'s checkpoint, prunes the old ones and marks
    /// the best; returns its folder.
    #[allow(clippy::too_many_arguments)]
    pub fn commit_sharded(
        &self,
        comm: &mut dyn Communicator,
        out: &Outputs,
        (step, tmp): (u64, PathBuf),
        trainer: &Trainer,
        whole: &ParamLayout,
        (extras, best): (Extras<'_>, bool),
    ) -> Result<PathBuf> {
        let state = self.trainer_state(step, trainer, &extras);
        let slots = trainer.optimizer().slot_names();
        let ranks = comm.world_size();
        let ema: Option<Vec<checkpoint::NamedTensor<'_>>> = extras.ema.map(|e| e.tensors());
        let (family, keep) = (self.plan.family.as_ref(), (self.plan.cfg.train.keep_checkpoints, extras.spare));
        let commit = || -> Result<PathBuf> {
            let path = checkpoint::commit_sharded(
                &out.dir,
                &tmp,
                family,
                (whole, &slots, ranks),
                &state,
                &self.config_toml,
                ema.as_deref(),
            )?;
            checkpoint::prune(&out.dir, keep.0, keep.1)?;
            if best {
                checkpoint::mark_best(&out.dir, step)?;
            }
            Ok(path)
        };
        rank0_phase(comm, self.heartbeat, Some(commit))?.context("rank 0 wrote no checkpoint")
    }

    /// Whether a `due` checkpoint is written in the background
    /// (`train.checkpoint_async`, except the one a stop asks for: the
    /// process exits after it).
    pub fn in_background(&self, stop: bool) -> bool {
        self.plan.cfg.train.checkpoint_async && !stop
    }

    /// Rank 0: writes step `step`'s checkpoint into `out.dir` and prunes
    /// the old ones: in place while the other ranks wait, returning its
    /// folder; or, `in_background`, handed to a writer thread with the
    /// state (which comes back to be freed on this thread, whose heap
    /// counted it; with `train.ema_decay` a copy of the average goes
    /// too), returning `None` at once.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &mut self,
        comm: &mut dyn Communicator,
        out: &Outputs,
        (step, state, in_background): (u64, FullState, bool),
        trainer: &Trainer,
        layout: &ParamLayout,
        (extras, best): (Extras<'_>, bool),
    ) -> Result<Option<PathBuf>> {
        let job = self.job(out, step, state, trainer, layout, extras, best, comm.rank());
        if !in_background {
            let path = rank0_phase(comm, self.heartbeat, Some(|| job.run()))?;
            return path.context("rank 0 wrote no checkpoint").map(Some);
        }
        let job = job.into_owned();
        let writer = std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(move || (job.run(), job))
            .context("cannot start the checkpoint writer thread")?;
        self.pending = Some((step, writer));
        Ok(None)
    }

    /// Rank 0, once a step: a background checkpoint that is done is
    /// joined (its state freed, its failure the run's).
    pub fn poll(&mut self) -> Result<()> {
        match &self.pending {
            Some((_, w)) if w.is_finished() => self.join(),
            _ => Ok(()),
        }
    }

    /// Every rank, with `train.checkpoint_async`, before the next
    /// checkpoint's gather, a stop and the final save: rank 0 (`rank0`)
    /// waits for the checkpoint in flight while the others wait for it —
    /// exchanging heartbeats, as for a checkpoint written in place.
    pub fn finish_pending(&mut self, comm: &mut dyn Communicator, rank0: bool) -> Result<()> {
        if !self.plan.cfg.train.checkpoint_async {
            return Ok(());
        }
        match rank0 {
            true => rank0_phase(comm, self.heartbeat, Some(|| self.join()))?,
            false => rank0_phase(comm, self.heartbeat, None::<fn() -> Result<()>>)?,
        };
        Ok(())
    }

    /// Waits for the background checkpoint, if any.
    fn join(&mut self) -> Result<()> {
        let Some((step, writer)) = self.pending.take() else { return Ok(()) };
        let (written, job) = writer.join().map_err(|_| anyhow::anyhow!("the writer of checkpoint {step} panicked"))?;
        // Freed here, on the thread whose heap counted it.
        drop(job);
        written.map(drop).with_context(|| format!("writing the checkpoint of step {step} in the background"))
    }

    /// After the last step: this rank's part in gathering the final
    /// parameters (every rank's where the master weights are sharded); rank
    /// 0 gets them.
    pub fn gather_final(&self, trainer: &mut Trainer, comms: &mut RankComms) -> Result<Option<Vec<f32>>> {
        heap::set_phase(Phase::Save);
        if !(comms.dp_rank() == 0 || self.all_ranks_gather) {
            return Ok(None);
        }
        let what = || format!("saving the model: {}", heap::advice(Phase::Save));
        comms.full_params(trainer).with_context(what)
    }

    /// The averaged model (`train.ema_decay`) into `ema/`.
    fn save_ema(&self, out: &Outputs, layout: &ParamLayout, params: &[f32], ema: &Ema) -> Result<()> {
        let dir = out.dir.join(super::ema::DIR);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let averaged = ema.model(params);
        checkpoint::check_finite(layout, &averaged, "the moving average of the weights")?;
        self.plan.family.save_hf(&dir, layout, &averaged)?;
        self.plan.tokenizer.save_pretrained(&dir)?;
        eprintln!("moving average of the weights (train.ema_decay) saved to {}", dir.display());
        Ok(())
    }

    /// The error of a final save that failed: says the model was not saved
    /// and what is kept (the newest checkpoint, if any), and first tries to
    /// keep the weights elsewhere — in the system's temporary folder, often
    /// another file system when the run's is full — saying where.
    fn final_save_failed(
        &self,
        dir: &Path,
        layout: &ParamLayout,
        params: &[f32],
        steps_done: u64,
        cause: anyhow::Error,
    ) -> anyhow::Error {
        let newest = crate::checkpoint::list(dir).ok().and_then(|l| l.last().map(|&(step, _)| step));
        let kept = match newest {
            Some(step) => format!(
                "the checkpoint of step {step} in {} is kept: `macrobatch train --resume {}` continues from it",
                dir.join("checkpoints").display(),
                dir.display()
            ),
            None => "no checkpoint was written (train.checkpoint_every)".to_string(),
        };
        let spare = std::env::temp_dir().join(format!("macrobatch-unsaved-{}", self.start.run_id));
        let elsewhere = match std::fs::create_dir_all(&spare)
            .map_err(anyhow::Error::from)
            .and_then(|()| self.plan.family.save_hf(&spare, layout, params).map_err(Into::into))
        {
            Ok(()) => format!(
                "the final weights were saved instead to {} (config.json and model.safetensors: move them into {} once there is space)",
                spare.display(),
                dir.display()
            ),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&spare);
                format!("saving them to {} failed too ({e:#})", spare.display())
            }
        };
        cause.context(format!(
            "the final model of step {steps_done} was NOT saved to {}; {kept}; {elsewhere}",
            dir.display()
        ))
    }

    /// Rank 0: saves the final model (checked finite) into the run folder
    /// (a sharded run: points it at its last checkpoint, which holds the
    /// model; `params` then serve only the moving average),
    /// with `train.ema_decay` the averaged model into `ema/`, with
    /// `--merge` also the model with its adapters folded in, and says
    /// where it went; `steps_done`: the run's last step.
    pub fn save_final(
        &self,
        out: Outputs,
        layout: &ParamLayout,
        params: &[f32],
        (started, steps_done): (Instant, u64),
        ema: Option<&Ema>,
    ) -> Result<()> {
        let plan = self.plan;
        out.reporter.finish();
        let mut saved_as = String::new();
        if self.sharded() {
            // The last step's checkpoint holds the model: no rank gathers it.
            checkpoint::write_final_pointer(&out.dir, steps_done)?;
            saved_as = format!(" as the sharded checkpoint of step {steps_done}");
        } else {
            checkpoint::check_finite(layout, params, "final parameters")?;
            let saved = match &self.start.base {
                Some(base) => base_ref::save(&out.dir, plan.family.as_ref(), (layout, params), base),
                None => plan.family.save_hf(&out.dir, layout, params).map_err(Into::into),
            };
            if let Err(e) = saved {
                return Err(self.final_save_failed(&out.dir, layout, params, steps_done, e));
            }
        }
        // The other kind's final model, from an earlier part of this run, is superseded.
        let stale: &[&str] = match self.sharded() {
            true => &[crate::family::WEIGHTS_FILE, crate::family::CONFIG_FILE],
            false => &[checkpoint::FINAL_POINTER],
        };
        for f in stale {
            let _ = std::fs::remove_file(out.dir.join(f));
        }
        if let Some(ema) = ema {
            self.save_ema(&out, layout, params, ema)?;
        }
        if self.start.merge {
            match plan.family.merged(params)? {
                Some((family, merged)) => {
                    let dir = out.dir.join("merged");
                    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
                    let layout = family.build(Build::default())?.layout().clone();
                    family.save_hf(&dir, &layout, &merged)?;
                    plan.tokenizer.save_pretrained(&dir)?;
                    eprintln!("merged model (adapters folded into the weights) saved to {}", dir.display());
                }
                None => eprintln!("warning: --merge: this run has no LoRA adapters to merge; nothing written"),
            }
        }
        eprintln!(
            "done: {} steps in {:.1}s; model saved to {}{saved_as} (try: macrobatch generate {} --prompt \"Call me\")",
            steps_done,
            started.elapsed().as_secs_f64(),
            out.dir.display(),
            out.dir.display()
        );
        // The MLflow run is FINISHED once its model is saved.
        match &out.mlflow {
            Some(m) => m.finish(),
            None => Ok(()),
        }
    }
}

/// Rank 0's `path` on every rank of `comm` (a collective; `Some` on rank
/// 0 only), sent as its bytes.
fn broadcast_path(comm: &mut dyn Communicator, path: Option<&Path>) -> Result<PathBuf> {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    const MAX: usize = 4096;
    let mut buf = vec![0.0f32; MAX + 1];
    // Absolute: another process may run from another folder. A path that
    // cannot be resolved goes as empty: every rank refuses it alike.
    if let Some(p) = path.and_then(|p| std::path::absolute(p).ok()) {
        let bytes = p.as_os_str().as_bytes();
        // Longer: sent as empty, which every rank refuses alike.
        if bytes.len() <= MAX {
            buf[0] = bytes.len() as f32;
            buf[1..=bytes.len()].iter_mut().zip(bytes).for_each(|(d, &b)| *d = f32::from(b));
        }
    }
    comm.broadcast(&mut buf, 0)?;
    let n = buf[0] as usize;
    if n == 0 {
        bail!("the run folder's path is empty or longer than {MAX} bytes; use a shorter --out");
    }
    let bytes: Vec<u8> = buf[1..=n].iter().map(|&b| b as u8).collect();
    Ok(PathBuf::from(std::ffi::OsString::from_vec(bytes)))
}

/// The thread writing a checkpoint in the background: it hands back the
/// checkpoint's folder and everything it wrote, to be freed by rank 0.
type Writer = std::thread::JoinHandle<(Result<PathBuf>, Job<'static>)>;

/// A tensor of the moving average: its name, shape and values.
type EmaTensor<'e> = (String, Vec<usize>, Cow<'e, [f32]>);

/// A checkpoint to write: everything it holds, owned, so a writer thread
/// can take it.
struct Job<'e> {
    dir: PathBuf,
    family: Arc<dyn Family>,
    base: Option<BaseRef>,
    layout: ParamLayout,
    params: Vec<f32>,
    optimizer: Vec<(String, Vec<f32>)>,
    state: TrainerState,
    config_toml: String,
    ema: Option<Vec<EmaTensor<'e>>>,
    /// `train.keep_checkpoints`, and the step pruning spares.
    keep: (usize, Option<u64>),
    /// Link it as `checkpoints/best` once written.
    best: bool,
    /// Injected delay (`slow_checkpoint`).
    delay: Option<Duration>,
}

impl Job<'_> {
    /// The job with its moving average copied (a writer thread outlives the borrow).
    fn into_owned(self) -> Job<'static> {
        let ema = self.ema.map(|e| e.into_iter().map(|(n, s, v)| (n, s, Cow::Owned(v.into_owned()))).collect());
        Job { ema, ..self }
    }

    /// Writes the checkpoint, prunes the old ones and marks the best;
    /// returns its folder.
    fn run(&self) -> Result<PathBuf> {
        if let Some(d) = self.delay {
            std::thread::sleep(d);
        }
        let ema: Option<Vec<checkpoint::NamedTensor<'_>>> =
            self.ema.as_ref().map(|e| e.iter().map(|(n, s, v)| (n.clone(), s.clone(), &v[..])).collect());
        let path = checkpoint::save(
            &self.dir,
            (self.family.as_ref(), self.base.as_ref()),
            &self.layout,
            &self.params,
            &self.optimizer,
            &self.state,
            &self.config_toml,
            ema.as_deref(),
        )?;
        checkpoint::prune(&self.dir, self.keep.0, self.keep.1)?;
        if self.best {
            checkpoint::mark_best(&self.dir, self.state.step)?;
        }
        Ok(path)
    }
}
