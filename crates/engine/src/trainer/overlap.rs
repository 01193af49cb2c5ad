//! `dist.overlap_comm`: the boundary's gradient collectives start under the
//! last micro-step's backward, on a second handle of the data-parallel group
//! ([`comm::Communicator::duplicate`]) owned by a thread of their own.
//!
//! What starts when: `units` (the boundary's buckets or segments at ZeRO
//! 0–2, each once the last backward is past it) and `per_segment` (ZeRO-3
//! and `reduce_every_micro_step`: every `done`'s reduce-scatter, and ZeRO-3's
//! gathers ahead). The collectives are the ones the run makes without
//! overlap, on the same values and lengths, so the sums, and everything after
//! them, are bit-identical.
//!
//! Ranks must visit segments in the same order (the `Model` contract): each
//! step's order of collectives is hashed into the boundary's statistics, and
//! ranks that differ stop with an error before anything is updated.
//!
//! Every rank runs the same model code (a rank without data on zero rows),
//! so every rank starts the collectives in the same order: the order the
//! second handle's collectives must have. At most `cap` staged elements are
//! in flight; starting past it first waits for the oldest.

mod per_segment;
mod units;

use super::Trainer;
use crate::error::EngineError;
use crate::zero::{Partition, Reduction};
use comm::{CommError, Communicator};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Instant;

/// A collective handed to the thread, with its staged input.
enum Job {
    /// An all-reduce in place.
    AllReduce(Vec<f32>),
    /// A reduce-scatter into this many elements.
    ReduceScatter(Vec<f32>, usize),
    /// An all-gather into this many elements.
    AllGather(Vec<f32>, usize),
}

impl Job {
    /// Elements staged for it while in flight: its input, or a gather's output.
    fn staged(&self) -> usize {
        match self {
            Job::AllReduce(b) | Job::ReduceScatter(b, _) => b.len(),
            Job::AllGather(_, n) => *n,
        }
    }
}

/// The error of a thread that is gone.
fn thread_lost(step: u64) -> EngineError {
    EngineError::Comm { step, source: CommError::Launch("the gradient communication thread stopped".into()) }
}

/// The order hash's modulus: small enough that every rank's hash and its
/// square sum exactly in f64.
const ORDER_MODULUS: u64 = 1_000_003;

/// What a collective in flight is for.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Flight {
    /// A boundary unit (stages 0–2).
    Unit(usize),
    /// A segment's reduce-scatter, added into the shard accumulator.
    Scatter(usize),
    /// A segment's parameters, gathered ahead of use (ZeRO-3).
    Gather(usize),
}

/// A finished collective: its result and when it ran.
struct Finished {
    result: Result<Vec<f32>, CommError>,
    started: Instant,
    ended: Instant,
}

/// What one step's overlap did, for the step's report (rank-local).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct OverlapReport {
    /// Seconds from the step's start to the end of its last micro-step.
    pub backward_end_s: f64,
    /// Each gradient collective in the order started: seconds from the
    /// step's start to when it was handed to the thread, when the thread
    /// started it, and when it finished.
    pub collectives: Vec<[f64; 3]>,
    /// Seconds this rank's step waited for them (the exposed part).
    pub waited_s: f64,
    /// Seconds the thread spent inside them.
    pub collective_s: f64,
    /// Bytes this rank handed to them.
    pub bytes: u64,
    /// ZeRO-3: segments the model found gathered ahead.
    pub gathered_ahead: u64,
}

/// The thread, its handle on the group, and the units (fixed for the trainer's life).
pub(crate) struct Overlap {
    jobs: Option<mpsc::Sender<Job>>,
    finished: mpsc::Receiver<Finished>,
    /// Set when the trainer goes: the thread skips what is queued.
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    units: Vec<units::Unit>,
    /// Per segment: the units covering its gradient.
    seg_units: Vec<Vec<usize>>,
    /// Per unit: how many segments with a gradient it covers.
    unit_segs: Vec<usize>,
    /// Most staged elements in flight (a single larger unit still goes).
    cap: usize,
    /// Per-segment reduction (ZeRO-3 and `reduce_every_micro_step`).
    per_segment: bool,
    /// The segments asked for in the last micro-step, in order, and in this one.
    seen_before: Vec<usize>,
    seen: Vec<usize>,
    /// A prefetched segment's gathered values, not yet asked for.
    ready: Option<(usize, Vec<f32>)>,
    step: Option<StepOverlap>,
}

impl std::fmt::Debug for Overlap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overlap").field("units", &self.units.len()).field("cap", &self.cap).finish()
    }
}

/// One step's progress.
struct StepOverlap {
    t0: Instant,
    final_seg: Vec<bool>,
    /// Segments done in this micro-step but not yet final.
    pending: Vec<usize>,
    /// Per unit: segments not yet final.
    left: Vec<usize>,
    /// Collectives in flight, oldest first, with their staged lengths.
    in_flight: VecDeque<(Flight, usize)>,
    staged: usize,
    /// The collectives started, in order, hashed (each rank's must agree).
    order: u64,
    report: OverlapReport,
}

/// Staged elements the overlap may hold at once: two of its largest
/// units, and at least two default buckets (50 MiB; small buckets would
/// otherwise make the backward wait for the link), at a boundary reduction
/// never more than all of them. What the planner counts.
pub(crate) fn staging_elems(part: &Partition, (reduction, gathers): (Reduction, bool), bucket_elems: usize) -> usize {
    let w = part.world_size;
    // The largest unit and all of them, counted without listing the units
    // (a plan may ask for shapes of millions of buckets).
    let per_segment = |len: &dyn Fn(usize) -> usize| {
        (0..part.n_segments()).map(len).fold((0, 0), |(m, t): (usize, usize), l| (m.max(l), t + l))
    };
    let (largest, all) = match reduction {
        Reduction::AllReduce => (bucket_elems.max(1).min(part.space.n_grads), part.space.n_grads),
        Reduction::ReduceScatter => per_segment(&|j| part.grad_piece[j] * w),
        // A reduce-scatter's input, or (ZeRO-3) a gather's output.
        Reduction::Done => per_segment(&|j| (part.grad_piece[j] * w).max(gathers as usize * part.piece[j] * w)),
    };
    let cap = (2 * largest).max(2 * crate::DEFAULT_BUCKET_ELEMS);
    match reduction {
        // Every micro-step sends again (a gathered segment waiting to be
        // asked for counts against the cap too).
        Reduction::Done => cap,
        // One step's units in all.
        _ => cap.min(all),
    }
}

impl Overlap {
    /// Starts the thread on `comm` (a duplicate of the data-parallel group).
    pub(crate) fn new(
        comm: Box<dyn Communicator + Send>,
        part: &Partition,
        (reduction, prefetch): (Reduction, bool),
        bucket_elems: usize,
    ) -> std::io::Result<Self> {
        let units = units::Unit::all(part, reduction, bucket_elems);
        let seg_units = units::units_of_segments(part, &units);
        let mut unit_segs = vec![0; units.len()];
        seg_units.iter().flatten().for_each(|&u| unit_segs[u] += 1);
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (done_tx, finished) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new().name("grad-comm".into()).spawn(move || {
            let mut comm = comm;
            for job in job_rx {
                if stopped.load(Ordering::Acquire) {
                    break; // the trainer is gone: what is queued is nobody's
                }
                let started = Instant::now();
                let result = match job {
                    Job::AllReduce(mut buf) => comm.all_reduce_sum(&mut buf).map(|()| buf),
                    Job::ReduceScatter(buf, n) => {
                        let mut out = vec![0.0; n];
                        comm.reduce_scatter_sum(&buf, &mut out).map(|()| out)
                    }
                    Job::AllGather(buf, n) => {
                        let mut out = vec![0.0; n];
                        comm.all_gather(&buf, &mut out).map(|()| out)
                    }
                };
                if done_tx.send(Finished { result, started, ended: Instant::now() }).is_err() {
                    break;
                }
            }
        })?;
        Ok(Self {
            jobs: Some(jobs),
            finished,
            stop,
            thread: Some(thread),
            units,
            seg_units,
            unit_segs,
            cap: staging_elems(part, (reduction, prefetch), bucket_elems),
            per_segment: reduction == Reduction::Done,
            seen_before: Vec::new(),
            seen: Vec::new(),
            ready: None,
            step: None,
        })
    }

    /// A new step begins at `t0` (the trainer abandoned any earlier one).
    pub(crate) fn begin(&mut self, t0: Instant, n_segments: usize) {
        self.step = Some(StepOverlap {
            t0,
            final_seg: vec![false; n_segments],
            pending: Vec::new(),
            left: self.unit_segs.clone(),
            in_flight: VecDeque::new(),
            staged: 0,
            order: 0,
            report: OverlapReport::default(),
        });
    }

    /// Forgets a step that failed midway (an error between `begin` and the
    /// boundary): waits for its collectives, which every rank started, and
    /// drops their results, which are not the next step's.
    pub(crate) fn abandon(&mut self) {
        if let Some(old) = self.step.take() {
            for _ in &old.in_flight {
                let _ = self.finished.recv();
            }
        }
        self.ready = None;
    }

    /// `[h, h²]` of this step's order of collectives (zeros outside a step):
    /// summed over the ranks with the boundary's statistics, `W · Σh² =
    /// (Σh)²` holds exactly when every rank's `h` is the same.
    pub(crate) fn order_check(&self) -> [f64; 2] {
        self.step.as_ref().map_or([0.0; 2], |s| [s.order as f64, (s.order * s.order) as f64])
    }

    /// Whether a step's last micro-step has begun (and the boundary not run).
    pub(crate) fn in_step(&self) -> bool {
        self.step.is_some()
    }

    /// At the boundary: starts what is left ([`Overlap::launch_rest`]),
    /// waits for every collective and writes its result into `grads`.
    /// Returns the step's report.
    pub(crate) fn finish(
        &mut self,
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<OverlapReport, EngineError> {
        self.launch_rest(part, grads, step)?;
        while self.step.as_ref().is_some_and(|s| !s.in_flight.is_empty()) {
            self.complete_oldest(part, grads, step)?;
        }
        self.ready = None; // the update changes the parameters it holds
        Ok(self.step.take().map(|s| s.report).unwrap_or_default())
    }

    /// Records when the last micro-step ended.
    pub(crate) fn backward_ended(&mut self) {
        if let Some(s) = self.step.as_mut() {
            s.report.backward_end_s = s.t0.elapsed().as_secs_f64();
        }
    }

    /// Hands `job` to the thread, first waiting for the oldest collectives
    /// while its staging would pass the cap.
    fn start(
        &mut self,
        what: Flight,
        job: Job,
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<(), EngineError> {
        let n = job.staged();
        loop {
            let s = self.step.as_ref().ok_or(EngineError::Internal("overlap launched outside a step"))?;
            if s.in_flight.is_empty() || s.staged + n <= self.cap {
                break;
            }
            self.complete_oldest(part, grads, step)?;
        }
        self.jobs.as_ref().ok_or_else(|| thread_lost(step))?.send(job).map_err(|_| thread_lost(step))?;
        let s = self.step.as_mut().ok_or(EngineError::Internal("overlap launched outside a step"))?;
        s.in_flight.push_back((what, n));
        let code = match what {
            Flight::Unit(u) => 3 * u as u64,
            Flight::Scatter(j) => 3 * j as u64 + 1,
            Flight::Gather(j) => 3 * j as u64 + 2,
        };
        s.order = (s.order * 31 + code + 1) % ORDER_MODULUS;
        s.staged += n;
        s.report.bytes += 4 * n as u64;
        s.report.collectives.push([s.t0.elapsed().as_secs_f64(), 0.0, 0.0]);
        Ok(())
    }

    /// Waits for the oldest collective in flight and writes its result.
    fn complete_oldest(&mut self, part: &Partition, grads: &mut [f32], step: u64) -> Result<(), EngineError> {
        let waited = Instant::now();
        let f = self.finished.recv().map_err(|_| thread_lost(step))?;
        let s = self.step.as_mut().ok_or(EngineError::Internal("overlap completed outside a step"))?;
        s.report.waited_s += waited.elapsed().as_secs_f64();
        let (what, n) = s.in_flight.pop_front().ok_or(EngineError::Internal("a result with nothing in flight"))?;
        if !matches!(what, Flight::Gather(_)) {
            s.staged -= n; // a gathered segment stays counted while it waits in `ready`
        }
        let i = s.report.collectives.len() - s.in_flight.len() - 1;
        let at = |t: Instant| t.saturating_duration_since(s.t0).as_secs_f64();
        s.report.collectives[i][1] = at(f.started);
        s.report.collectives[i][2] = at(f.ended);
        s.report.collective_s += (f.ended - f.started).as_secs_f64();
        let out = f.result.map_err(|source| EngineError::Comm { step, source })?;
        match what {
            Flight::Unit(u) => self.apply(u, part, &out, grads),
            Flight::Scatter(j) => part.add_reduced(j, &out, grads),
            Flight::Gather(j) => self.ready = Some((j, out)),
        }
        Ok(())
    }
}

impl Drop for Overlap {
    fn drop(&mut self) {
        // Closing the queue ends the thread, which drops its handle on the
        // group there (before the world's: the trainer goes first). A
        // trainer dropped midway (an error) skips what is still queued, so
        // the rank reports its error without first waiting out collectives
        // the others may never join.
        self.stop.store(true, Ordering::Release);
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Trainer {
    /// Whether this step's gradient collectives may start under the
    /// backward: asked for, and more than one data rank.
    pub(super) fn overlap_applies(&self, dp_world: usize) -> bool {
        self.options.overlap_comm && dp_world > 1
    }

    /// Starts the thread on first use (a collective: every rank's first step).
    pub(super) fn overlap_start(&mut self, comm: &mut dyn Communicator) -> Result<(), EngineError> {
        if self.overlap.is_none() {
            let step = self.n_steps + 1;
            let dup = comm.duplicate().map_err(|source| EngineError::Comm { step, source })?;
            let modes = (self.zero_stage.reduction(), self.zero_stage.shards_parameters());
            let o = Overlap::new(dup, &self.part, modes, self.options.bucket_elems).map_err(|e| EngineError::Comm {
                step,
                source: CommError::Launch(format!("cannot start the gradient communication thread: {e}")),
            })?;
            self.overlap = Some(o);
        }
        Ok(())
    }
}
