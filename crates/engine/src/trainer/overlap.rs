//! `dist.overlap_comm`: the boundary's gradient collectives start under the
//! last micro-step's backward, on a second handle of the data-parallel group
//! ([`comm::Communicator::duplicate`]) owned by a thread of their own.
//!
//! The collectives are the boundary's own, cut the same way: at stages 0–1
//! the buckets of `bucket_elems` over the local accumulator, all-reduced; at
//! stage 2 each segment, packed and reduce-scattered. Only *when* each starts
//! changes, so the sums, and everything after them, are bit-identical to
//! the boundary's (same buffers, same lengths, same algorithm).
//!
//! When is a unit's gradient final? The backward walks the segments in
//! descending order, except that a segment may come back later (a tied head
//! writes the embedding's segment first and the embedding again last). So a
//! `done(j)` only makes `j` *pending*; it is final once a `done(i)` with
//! `i < j` follows, or at the boundary. A unit starts once every segment
//! whose gradient it covers is final. Asking for a final segment again is an
//! error (its gradient was sent; a write would be lost), never silent.
//!
//! Per-segment reduction (ZeRO-3, `reduce_every_micro_step`): each
//! segment's reduce-scatter in `done` goes to the thread instead of
//! blocking, in every micro-step; its result is added into the shard
//! accumulator in the order started (so each element's sum keeps its
//! order). ZeRO-3 also gathers the segment the model will ask for next (the
//! previous micro-step's order of requests; nothing in the first) while the
//! current one computes; a gather is a copy, so a prefetch changes no bit.
//!
//! Ranks must visit segments in the same order (the `Model` contract): each
//! step's order of collectives is hashed into the boundary's statistics, and
//! ranks that differ stop with an error before anything is updated.
//!
//! Every rank runs the same model code (a rank without data on zero rows),
//! so every rank starts the collectives in the same order: the order the
//! second handle's collectives must have. At most `cap` staged elements are
//! in flight; starting past it first waits for the oldest.

use super::Trainer;
use crate::error::EngineError;
use crate::zero::{Partition, Reduction};
use comm::{CommError, Communicator};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Instant;

/// One collective of the boundary's gradient reduction.
#[derive(Debug, Clone, PartialEq)]
enum Unit {
    /// Stages 0–1: a bucket of the gradient space, all-reduced.
    Bucket(Range<usize>),
    /// Stage 2: a segment's gradient, packed `W · t` and reduce-scattered.
    Segment(usize),
}

/// A collective handed to the thread, with its staged input.
enum Job {
    /// An all-reduce in place.
    AllReduce(Vec<f32>),
    /// A reduce-scatter into this many elements.
    ReduceScatter(Vec<f32>, usize),
    /// An all-gather into this many elements.
    AllGather(Vec<f32>, usize),
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
    units: Vec<Unit>,
    /// Per segment: the units covering its gradient.
    seg_units: Vec<Vec<usize>>,
    /// Per unit: how many segments with a gradient it covers.
    unit_segs: Vec<usize>,
    /// Most staged elements in flight (a single larger unit still goes).
    cap: usize,
    /// Per-segment reduction (and with ZeRO-3, prefetching).
    per_segment: bool,
    prefetch: bool,
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
    launched: Vec<bool>,
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
    let units: Vec<usize> = match reduction {
        Reduction::AllReduce => {
            let b = bucket_elems.max(1);
            (0..part.space.n_grads.div_ceil(b)).map(|i| b.min(part.space.n_grads - i * b)).collect()
        }
        Reduction::ReduceScatter => (0..part.n_segments()).map(|j| part.grad_piece[j] * w).collect(),
        // A reduce-scatter's input, or (ZeRO-3) a gather's output.
        Reduction::Done if gathers => {
            (0..part.n_segments()).map(|j| (part.grad_piece[j] * w).max(part.piece[j] * w)).collect()
        }
        Reduction::Done => (0..part.n_segments()).map(|j| part.grad_piece[j] * w).collect(),
    };
    let largest = units.iter().copied().max().unwrap_or(0);
    let cap = (2 * largest).max(2 * crate::DEFAULT_BUCKET_ELEMS);
    match reduction {
        // Every micro-step sends again (a gathered segment waiting to be
        // asked for counts against the cap too).
        Reduction::Done => cap,
        // One step's units in all.
        _ => cap.min(units.iter().sum()),
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
        let units: Vec<Unit> = match reduction {
            Reduction::AllReduce => {
                let b = bucket_elems.max(1);
                (0..part.space.n_grads.div_ceil(b))
                    .map(|i| Unit::Bucket(i * b..((i + 1) * b).min(part.space.n_grads)))
                    .collect()
            }
            Reduction::ReduceScatter => {
                (0..part.n_segments()).filter(|&j| part.grad_piece[j] > 0).map(Unit::Segment).collect()
            }
            Reduction::Done => Vec::new(),
        };
        let mut seg_units = vec![Vec::new(); part.n_segments()];
        let mut unit_segs = vec![0; units.len()];
        for (j, su) in seg_units.iter_mut().enumerate() {
            let g = part.space.grad_segments[j].clone();
            if g.is_empty() {
                continue; // frozen: no gradient, never waited for
            }
            for (u, unit) in units.iter().enumerate() {
                let covers = match unit {
                    Unit::Bucket(b) => b.start < g.end && g.start < b.end,
                    Unit::Segment(s) => *s == j,
                };
                if covers {
                    su.push(u);
                    unit_segs[u] += 1;
                }
            }
        }
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
            prefetch,
            seen_before: Vec::new(),
            seen: Vec::new(),
            ready: None,
            step: None,
        })
    }

    /// A new step begins at `t0`.
    pub(crate) fn begin(&mut self, t0: Instant, n_segments: usize) {
        self.abandon();
        self.step = Some(StepOverlap {
            t0,
            final_seg: vec![false; n_segments],
            pending: Vec::new(),
            left: self.unit_segs.clone(),
            launched: vec![false; self.units.len()],
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

    /// Whether segment `seg`'s gradient was already sent this step (the
    /// boundary's units; a per-segment reduction sends each `done` anew).
    pub(crate) fn check_open(&self, seg: usize, step: u64) -> Result<(), EngineError> {
        match &self.step {
            Some(s) if s.final_seg[seg] && !self.per_segment => Err(EngineError::Overlap { step, seg }),
            _ => Ok(()),
        }
    }

    /// Whether this overlap reduces per segment (in every micro-step).
    pub(crate) fn per_segment(&self) -> bool {
        self.per_segment
    }

    /// A micro-step begins: the requests of the last one predict this one's.
    pub(crate) fn next_micro_step(&mut self) {
        if !self.seen.is_empty() {
            self.seen_before = std::mem::take(&mut self.seen);
        }
    }

    /// Per-segment reduction: hands segment `seg`'s packed gradient
    /// (`W · t` elements) to the thread; its reduced piece is added into
    /// `grads` (the shard accumulator) when it is back.
    pub(crate) fn scatter(
        &mut self,
        seg: usize,
        packed: &[f32],
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<(), EngineError> {
        let t = part.grad_piece[seg];
        self.start(Flight::Scatter(seg), Job::ReduceScatter(packed.to_vec(), t), packed.len(), part, grads, step)
    }

    /// ZeRO-3: if segment `seg` was gathered ahead, writes it into `out`
    /// (the `W · piece` gathered buffer) and returns true.
    pub(crate) fn take_gathered(
        &mut self,
        seg: usize,
        out: &mut [f32],
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<bool, EngineError> {
        let in_flight =
            |o: &Self| o.step.as_ref().is_some_and(|s| s.in_flight.iter().any(|f| f.0 == Flight::Gather(seg)));
        while in_flight(self) {
            self.complete_oldest(part, grads, step)?;
        }
        let Some((j, v)) = self.ready.take() else { return Ok(false) };
        let hit = j == seg; // else gathered for another segment: dropped
        if hit {
            out.copy_from_slice(&v);
        }
        if let Some(s) = self.step.as_mut() {
            s.staged -= v.len(); // counted until taken
            s.report.gathered_ahead += hit as u64;
        }
        Ok(hit)
    }

    /// ZeRO-3, after segment `seg` was asked for: gathers the segment the
    /// model will ask for next — the one the last micro-step asked for at
    /// this point, if this one has asked for the same so far (nothing in a
    /// run's first micro-step) — unless it is `seg` itself, or a gather is
    /// already waiting or in flight.
    pub(crate) fn prefetch_after(
        &mut self,
        seg: usize,
        part: &Partition,
        params: &[f32],
        grads: &mut [f32],
        step: u64,
    ) -> Result<(), EngineError> {
        if self.step.is_none() {
            return Ok(());
        }
        self.seen.push(seg);
        if !self.prefetch {
            return Ok(());
        }
        // What the last micro-step asked for next, if this one has followed it so far.
        let next = match self.seen_before.get(self.seen.len()) {
            Some(&n) if self.seen_before[..self.seen.len()] == self.seen[..] => n,
            _ => return Ok(()),
        };
        let busy = self.ready.is_some()
            || self.step.as_ref().is_some_and(|s| s.in_flight.iter().any(|f| matches!(f.0, Flight::Gather(_))));
        if next == seg || next >= part.n_segments() || busy {
            return Ok(());
        }
        let shard = params[part.shard_range(next)].to_vec();
        let n = part.piece[next] * part.world_size;
        self.start(Flight::Gather(next), Job::AllGather(shard, n), n, part, grads, step)
    }

    /// `done(seg)` of a backward in the last micro-step: segments above
    /// `seg` still pending are final now; `seg` becomes pending.
    pub(crate) fn segment_done(
        &mut self,
        seg: usize,
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<(), EngineError> {
        let Some(s) = self.step.as_mut() else { return Ok(()) };
        let mut now: Vec<usize> = s.pending.iter().copied().filter(|&p| p > seg).collect();
        s.pending.retain(|&p| p <= seg);
        if !s.pending.contains(&seg) {
            s.pending.push(seg);
        }
        now.sort_unstable_by(|a, b| b.cmp(a));
        for p in now {
            self.finalise(p, part, grads, step)?;
        }
        Ok(())
    }

    /// After the last micro-step (before the boundary's own collectives,
    /// which would otherwise queue behind nothing): every segment is final
    /// (pending ones, then those never done, each in descending order), so
    /// every unit is started.
    pub(crate) fn launch_rest(&mut self, part: &Partition, grads: &mut [f32], step: u64) -> Result<(), EngineError> {
        let Some(s) = self.step.as_mut() else { return Ok(()) };
        let mut order = std::mem::take(&mut s.pending);
        order.sort_unstable_by(|a, b| b.cmp(a));
        let rest: Vec<usize> =
            (0..part.n_segments()).rev().filter(|&j| !s.final_seg[j] && !order.contains(&j)).collect();
        for j in order.into_iter().chain(rest) {
            self.finalise(j, part, grads, step)?;
        }
        // Units covering no gradient segment (none today) would never start: start them too.
        for u in 0..self.units.len() {
            if !self.step.as_ref().is_some_and(|s| s.launched[u]) {
                self.launch(u, part, grads, step)?;
            }
        }
        Ok(())
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

    fn finalise(&mut self, seg: usize, part: &Partition, grads: &mut [f32], step: u64) -> Result<(), EngineError> {
        let Some(s) = self.step.as_mut() else { return Ok(()) };
        if s.final_seg[seg] {
            return Ok(());
        }
        s.final_seg[seg] = true;
        let mut ready = Vec::new();
        for &u in &self.seg_units[seg] {
            s.left[u] -= 1;
            if s.left[u] == 0 {
                ready.push(u);
            }
        }
        for u in ready {
            self.launch(u, part, grads, step)?;
        }
        Ok(())
    }

    /// Stages unit `u`'s input and hands it to the thread.
    fn launch(&mut self, u: usize, part: &Partition, grads: &mut [f32], step: u64) -> Result<(), EngineError> {
        let job = match &self.units[u] {
            Unit::Bucket(b) => Job::AllReduce(grads[b.clone()].to_vec()),
            Unit::Segment(j) => {
                let (t, g) = (part.grad_piece[*j], part.space.grad_segments[*j].clone());
                let mut buf = vec![0.0; (t * part.world_size).max(g.len())];
                buf[..g.len()].copy_from_slice(&grads[g]);
                part.pack_grads_in_place(*j, &mut buf[..t * part.world_size]);
                buf.truncate(t * part.world_size);
                Job::ReduceScatter(buf, t)
            }
        };
        let n = match &job {
            Job::AllReduce(b) | Job::ReduceScatter(b, _) => b.len(),
            Job::AllGather(_, n) => *n,
        };
        self.start(Flight::Unit(u), job, n, part, grads, step)?;
        if let Some(s) = self.step.as_mut() {
            s.launched[u] = true;
        }
        Ok(())
    }

    /// Hands `job` (`n` staged elements) to the thread, first waiting for
    /// the oldest collectives while the cap would be passed.
    fn start(
        &mut self,
        what: Flight,
        job: Job,
        n: usize,
        part: &Partition,
        grads: &mut [f32],
        step: u64,
    ) -> Result<(), EngineError> {
        loop {
            let s = self.step.as_ref().ok_or(EngineError::Internal("overlap launched outside a step"))?;
            if s.in_flight.is_empty() || s.staged + n <= self.cap {
                break;
            }
            self.complete_oldest(part, grads, step)?;
        }
        let lost = || EngineError::Comm {
            step,
            source: CommError::Launch("the gradient communication thread stopped".into()),
        };
        self.jobs.as_ref().ok_or_else(lost)?.send(job).map_err(|_| lost())?;
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
        let lost = || EngineError::Comm {
            step,
            source: CommError::Launch("the gradient communication thread stopped".into()),
        };
        let f = self.finished.recv().map_err(|_| lost())?;
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
            Flight::Unit(u) => match &self.units[u] {
                Unit::Bucket(b) => grads[b.clone()].copy_from_slice(&out),
                Unit::Segment(j) => {
                    let own = part.grad_owned(*j, part.rank);
                    grads[own.clone()].copy_from_slice(&out[..own.len()]);
                }
            },
            Flight::Scatter(j) => {
                let acc = &mut grads[part.grad_shard_range(j)];
                acc.iter_mut().zip(&out).for_each(|(a, o)| *a += o);
            }
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
