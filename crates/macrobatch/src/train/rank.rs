//! The training loop of one rank: build, then per step the fault hook,
//! the step's batches, the optimizer step, the stop agreement, evaluation,
//! the checkpoint and the metrics line; after the last step the memory
//! report and the final save.

use super::checkpointing::{Checkpoints, Extras};
use super::dump::dump_step;
use super::ema::Ema;
use super::eval::maybe_evaluate;
use super::outputs::Outputs;
use super::reports::{self, MemoryWatch, StepContext};
use super::start::Start;
use super::val_watch::ValWatch;
use crate::checkpoint::ValWatchState;
use crate::dist::{Fault, FaultyComm};
use crate::heap::{self, Phase};
use crate::setup::{model_for_rank, rank_batches, Initial, Plan, RankComms};
use anyhow::{bail, Context, Result};
use comm::Communicator;
use config::TrainConfig;
use data::EpochOrder;
use engine::{Model, StagedModel, TokenBatch, Trainer};
use std::path::Path;
use std::time::Instant;

/// The training loop of one rank. Rank 0 (holding `outputs`) evaluates,
/// records metrics, writes checkpoints and saves the model.
pub fn train_rank(plan: &Plan, comm: &mut dyn Communicator, mut outputs: Option<Outputs>, start: &Start) -> Result<()> {
    let rank = comm.rank();
    let cfg = &plan.cfg;
    // The rank's own heap, from here on (a single rank's thread also holds
    // the data set and the program's allocations from before).
    let heap_base = heap::reset_peak();
    heap::set_phase(Phase::Build);
    let mut model = model_for_rank(plan, plan.grid.tp_rank(rank))?;
    // A `phase=collective` fault sits between the rank and its collectives.
    let mut faulty;
    let comm: &mut dyn Communicator = match start.fault.filter(Fault::in_collective) {
        Some(f) => {
            faulty = FaultyComm::new(comm, f);
            &mut faulty
        }
        None => comm,
    };
    let mut comms = RankComms::new(plan, &mut model, comm)?;
    // What checkpoints and the saved model are written in (a tensor-parallel
    // rank's own layout holds only its slices).
    let whole = comms.whole_layout(model.layout()).clone();
    let mut memory = MemoryWatch::new(plan, heap_base)?;
    let offload_root = start.offload_root.get().context("the run folder is not known yet")?;
    let load_base = heap::mark();
    let (mut trainer, first_step, resumed) = start_trainer(plan, &model, &mut comms, start, offload_root)?;
    if start.resume.is_some() && plan.cfg.train.checkpoint_sharded {
        memory.load_heap = Some((heap::peak_since_mark() - load_base).max(0) as u64);
    }
    let mut watch = ValWatch::new(&cfg.train, resumed.val_watch);
    // Rank 0 keeps the moving average (it holds every f32 weight; config
    // validation refuses the layouts where it does not).
    let mut ema = match (cfg.train.ema_decay > 0.0, &outputs) {
        (true, Some(_)) => Some(Ema::new(cfg.train.ema_decay, &whole, trainer.params(), resumed.ema.as_ref())?),
        _ => None,
    };
    drop(resumed);
    let mem = trainer.memory();
    if let Some(out) = &outputs {
        reports::print_memory(out, cfg.dist.zero_stage, &mem, offload_root);
    }
    let mut checkpoints = Checkpoints::new(plan, start, &trainer);
    let started = Instant::now();
    let mut orders = EpochOrders::new(plan);
    let mut floor_skips = FloorSkips::default();
    let mut last_step = cfg.train.steps;
    for step_idx in first_step..cfg.train.steps {
        let step = step_idx + 1;
        heap::set_phase(Phase::Step);
        fault_hook(start.fault.as_ref(), rank, step)?;
        let (epoch, batches, input_tokens) = orders.step_batches(step_idx, comms.data_rank(), outputs.is_some())?;
        if let Some(dir) = &start.dump_steps {
            dump_step(dir, step, &batches, (step_idx == first_step).then(|| (&trainer, model.layout())))?;
        }
        let step_base = heap::mark();
        let t0 = Instant::now();
        let report = comms.step(&mut trainer, &mut model, &batches)?;
        let step_s = t0.elapsed().as_secs_f64();
        let overlap_ranks = reports::overlap_by_rank(cfg.dist.overlap_comm, comms.world, &report, step_s)?;
        floor_skips.check(step, report.skipped, &trainer, &cfg.train)?;
        if let (Some(e), false) = (ema.as_mut(), report.skipped) {
            e.update(trainer.params());
        }
        if memory.first_step_pending() {
            drop(batches);
            memory.after_first_step(plan, &trainer, model.activation_bytes(), comms.buffer_bytes(), step_base)?;
        }
        if cfg.dist.check_every > 0 && step % cfg.dist.check_every == 0 {
            comms.check_params_agree(&mut trainer)?;
        }
        let stop = start.stop.agree(comms.world, step - first_step)?;
        let val_loss = maybe_evaluate(plan, step, &mut trainer, &mut model, &mut comms)?;
        let verdict = watch.observe(step, val_loss, comms.world)?;
        let early_stop = verdict.stop.is_some();
        let checkpoint_due = checkpoints.due(step, stop || early_stop) || verdict.new_best;
        // Sharded, the fault fires once the rank's pieces are written.
        if let (Some(f), true) = (start.fault.as_ref(), checkpoint_due && !checkpoints.sharded()) {
            f.maybe_fire_in_checkpoint(rank, step)?;
        }
        if outputs.is_some() {
            checkpoints.poll()?;
        }
        if checkpoint_due {
            checkpoints.finish_pending(comms.world, outputs.is_some())?;
        }
        let in_background = checkpoints.in_background(stop);
        let sharded = checkpoint_due && checkpoints.sharded();
        let full_state = checkpoints.gather(checkpoint_due && !sharded, step, &mut trainer, &mut comms)?;
        let pieces = match sharded {
            true => {
                let (tmp, grew) = checkpoints.write_pieces(step, &mut trainer, &mut comms, outputs.as_ref(), &whole)?;
                memory.checkpoint_heap = Some(memory.checkpoint_heap.unwrap_or(0).max(grew));
                tmp
            }
            false => None,
        };
        let Some(out) = outputs.as_mut() else {
            checkpoints.wait_for_rank0(checkpoint_due && !in_background, comms.world)?;
            if stop {
                return Ok(());
            }
            if early_stop {
                last_step = step;
                break;
            }
            continue;
        };
        let dpo = cfg.train.objective == config::Objective::Dpo;
        let elapsed_s = started.elapsed().as_secs_f64();
        let at = StepContext { step, epoch, input_tokens, step_s, elapsed_s, val_loss, dpo };
        let terms = cfg.train.label_smoothing > 0.0 || cfg.train.z_loss > 0.0 || report.aux_loss != 0.0;
        let loss_total = terms.then_some(report.loss + report.aux_loss);
        let expert_load = plan.family.expert_load(&report.step_stats);
        let mut record = reports::step_record(at, report, &mem, model.activation_bytes(), &memory.predicted);
        record.expert_load = expert_load;
        record.loss_total = loss_total;
        record.overlap_ranks = overlap_ranks;
        record.stop_reason = verdict.stop.clone();
        out.record(&record)?;
        let extras = || Extras { val_watch: watch.state(), spare: watch.best_step(), ema: ema.as_ref() };
        let written = if let Some(state) = full_state {
            let at = (step, state, in_background);
            checkpoints.write(comms.world, out, at, &trainer, &whole, (extras(), verdict.new_best))?
        } else if let Some(tmp) = pieces {
            let at = (step, tmp);
            Some(checkpoints.commit_sharded(comms.world, out, at, &trainer, &whole, (extras(), verdict.new_best))?)
        } else {
            if checkpoint_due && !in_background {
                checkpoints.skip_write(comms.world)?;
            }
            None
        };
        if let (Some(path), true) = (written, stop) {
            out.reporter.finish();
            start.stop.announce(step, &path, &out.dir);
            return Ok(());
        }
        if stop {
            return Ok(());
        }
        if let Some(reason) = &verdict.stop {
            out.reporter.finish();
            eprintln!("stopped after step {step} of {}: {reason}", cfg.train.steps);
            last_step = step;
            break;
        }
    }
    // A checkpoint still being written is finished first.
    checkpoints.finish_pending(comms.world, outputs.is_some())?;
    // Per-rank memory to rank 0, then the final parameters — without the
    // model's activations, which the save does not need.
    let per_rank = memory.gather(comms.world, &trainer)?;
    drop(model);
    if let Some(f) = start.fault.as_ref() {
        f.maybe_fire_in_final_save(rank, last_step)?;
    }
    if checkpoints.sharded() {
        if let Some(out) = outputs {
            memory.write_file(&out, plan, whole.n_params(), &trainer, &per_rank)?;
            let params = if ema.is_some() { trainer.params() } else { &[] };
            checkpoints.save_final(out, &whole, params, (started, last_step), ema.as_ref())?;
        }
        return Ok(());
    }
    let params = checkpoints.gather_final(&mut trainer, &mut comms)?;
    if let Some(out) = &outputs {
        memory.write_file(out, plan, whole.n_params(), &trainer, &per_rank)?;
    }
    if let (Some(out), Some(params)) = (outputs, params) {
        checkpoints.save_final(out, &whole, &params, (started, last_step), ema.as_ref())?;
    }
    Ok(())
}

/// What a checkpoint carries for the loop besides the trainer.
#[derive(Default)]
struct Resumed {
    val_watch: Option<ValWatchState>,
    ema: Option<std::collections::HashMap<String, Vec<f32>>>,
}

/// This rank's trainer — from a checkpoint, pretrained parameters or a
/// fresh initialisation, offloading under `offload_root` — with the
/// parameters checked equal on every rank holding them; the step it
/// starts after; and what the checkpoint holds for the loop. A checkpoint
/// is model-wide: each pipeline stage keeps its part, so it resumes at any
/// pipeline width.
fn start_trainer(
    plan: &Plan,
    model: &impl StagedModel,
    comms: &mut RankComms,
    start: &Start,
    offload_root: &Path,
) -> Result<(Trainer, u64, Resumed)> {
    // A checkpoint or pretrained parameters: each rank takes them once and
    // the last lets them go, so they are not held for the whole run.
    let resume = start.resume.as_ref().and_then(|h| h.take());
    let pretrained = start.init_params.as_ref().and_then(|h| h.take());
    // A sharded checkpoint: each segment read when the trainer asks for it.
    let whole = comms.whole_layout(model.layout()).clone();
    let pieces = resume.as_ref().and_then(|l| l.sharded.clone());
    let source = match &pieces {
        Some(reader) => Some(super::pieces::ParamSource::new(reader, &whole, &comms.piece_map(model.layout(), false))?),
        None => None,
    };
    // The trainer takes each segment from data rank 0 (a broadcast): the
    // other data ranks read nothing.
    let reads = comms.dp_place().0 == 0;
    let read_segment = |range: std::ops::Range<usize>| match (&source, reads) {
        (Some(s), true) => s.segment(range),
        _ => Ok(vec![0.0; range.len()]),
    };
    let initial = match (&resume, &pretrained, &source) {
        (_, _, Some(_)) => Initial::Segments(&read_segment),
        (Some(l), _, None) => Initial::Params(&l.params),
        (None, Some(p), None) => Initial::Params(p),
        (None, None, None) => Initial::Fresh,
    };
    let mut trainer = comms.trainer(plan, model, initial, offload_root)?;
    drop(pretrained);
    let mut first_step = 0;
    let mut resumed = Resumed::default();
    if let Some(l) = resume {
        resumed.val_watch = l.state.val_watch;
        if plan.cfg.train.ema_decay > 0.0 && comms.world.rank() == 0 {
            resumed.ema = Some(l.ema.clone().with_context(|| {
                format!("train.ema_decay is on, but {} holds no moving average (ema.safetensors): it was written with train.ema_decay = 0; resume with --set train.ema_decay=0", l.dir.display())
            })?);
        }
        let st = &l.state;
        let position = (st.schedule_step.unwrap_or(st.step), st.n_updates);
        if let Some(reader) = &pieces {
            super::pieces::restore_optimizer(comms, &mut trainer, reader, position)
                .with_context(|| format!("the optimizer state of {}", l.dir.display()))?;
        } else {
            // Each slot's part for this rank, one slot at a time.
            let mut bad = None;
            let restored = trainer.restore_optimizer(position.0, position.1, |name| {
                comms.own_state(l.optimizer.get(name)?).map_err(|e| bad = Some(e)).ok()
            });
            if let Some(e) = bad {
                return Err(e.context(format!("the optimizer state of {}", l.dir.display())));
            }
            restored?;
        }
        if let Some(sc) = &st.loss_scaler {
            trainer.set_loss_scaler(sc.scale, sc.good_steps, sc.hysteresis_left, sc.n_skipped);
        }
        first_step = st.step;
    }
    comms.check_params_agree(&mut trainer)?;
    Ok((trainer, first_step, resumed))
}

/// Test fault injection (`MACROBATCH_FAULT`): fires at its rank and step.
fn fault_hook(fault: Option<&Fault>, rank: usize, step: u64) -> Result<()> {
    match fault {
        Some(f) => f.maybe_fire(rank, step),
        None => Ok(()),
    }
}

/// The sample order of the epoch being trained, made when the epoch starts.
struct EpochOrders<'a> {
    plan: &'a Plan,
    current: Option<(u64, EpochOrder)>,
}

impl<'a> EpochOrders<'a> {
    fn new(plan: &'a Plan) -> Self {
        Self { plan, current: None }
    }

    /// Step `step_idx`'s epoch, the K micro-batches of data rank `rank`
    /// (every stage of a pipeline trains on the same), and (with
    /// `count_inputs`, for rank 0's metrics) every data rank's input
    /// positions, from the indices alone (no collective).
    fn step_batches(&mut self, step_idx: u64, rank: usize, count_inputs: bool) -> Result<(u64, Vec<TokenBatch>, u64)> {
        let plan = self.plan;
        let (epoch, step_in_epoch) = plan.sampler.position(step_idx);
        if self.current.as_ref().map(|o| o.0) != Some(epoch) {
            self.current = Some((epoch, plan.sampler.epoch_order(epoch)));
        }
        let Some((_, ord)) = self.current.as_ref() else { bail!("no sample order for epoch {epoch}") };
        let batches = rank_batches(plan, &plan.sampler, ord, step_in_epoch, rank)?;
        let input_tokens = if count_inputs {
            let shape = plan.sampler.shape();
            (0..shape.world_size)
                .flat_map(|r| (0..shape.accumulation_steps).map(move |k| (r, k)))
                .map(|(r, k)| plan.train.input_positions(&plan.sampler.micro_batch(ord, step_in_epoch, k, r)) as u64)
                .sum()
        } else {
            0
        };
        Ok((epoch, batches, input_tokens))
    }
}

/// f16: a loss scale stuck at its floor that still overflows skips every
/// step, and the run makes no progress. (Every rank skips alike.)
#[derive(Default)]
struct FloorSkips {
    in_a_row: u64,
}

impl FloorSkips {
    /// Counts step `step` (`skipped` or not); an error once
    /// `train.max_skips_at_min_scale` steps in a row were skipped at the floor.
    fn check(&mut self, step: u64, skipped: bool, trainer: &Trainer, cfg: &TrainConfig) -> Result<()> {
        let at_floor = trainer.loss_scaler().is_some_and(|s| s.scale <= cfg.min_loss_scale);
        self.in_a_row = if skipped && at_floor { self.in_a_row + 1 } else { 0 };
        let max_skips = cfg.max_skips_at_min_scale;
        if max_skips > 0 && self.in_a_row >= max_skips {
            bail!(
                "step {step}: {} steps in a row were skipped for non-finite gradients at the minimum loss scale ({}); the run cannot make progress (lower optim.lr, enable train.grad_clip, use train.precision=bf16, or lower train.min_loss_scale; train.max_skips_at_min_scale sets this limit)",
                self.in_a_row,
                cfg.min_loss_scale
            );
        }
        Ok(())
    }
}
