//! MPI backend (feature `mpi`): processes started by `mpirun`, on one machine
//! or many, through rsmpi on the system's MPI (OpenMPI or MPICH).
//!
//! Every collective is issued non-blocking and polled with a deadline, so a
//! rank that stalls makes the others print an error and abort the job instead
//! of hanging; a rank that dies is reported by `mpirun`, which ends the job.
//! A value is used by one thread at a time: the one that created it, or
//! for a [`Communicator::duplicate`] (`MPI_THREAD_MULTIPLE` only) the thread
//! it was moved to.
//!
//! Point-to-point: a send copies the payload into a buffer this value owns and
//! starts an `MPI_Isend` from it, so it returns without waiting for the
//! receiver. The outstanding sends are completed (and their buffers freed) by
//! [`Communicator::flush_sends`], on drop, and whenever a later call finds
//! them done. A receive polls `MPI_Improbe` for the source and tag against the
//! deadline (past it, it names the source and aborts the job like a
//! collective), then checks the message's length before receiving it; a
//! message of the wrong length is received and dropped, and the receive
//! fails. MPI keeps messages between two ranks on one communicator and tag in
//! the order sent. Tags must fit MPI's `int`.
//!
//! [`Communicator::split`] gathers every rank's (color, key) non-blocking
//! under the deadline, then calls `MPI_Comm_split`. The sub-communicator frees
//! its MPI communicator when dropped; only the last handle on the
//! `MPI_Init` (the world's, or a sub-communicator that outlives it) finalises
//! MPI, and a duplicate still alive then is a programming error that aborts
//! with a message (it would free its communicator after `MPI_Finalize`). An
//! abort or a timeout in any communicator aborts the whole job.

use comm::launcher::launcher_world_size;
use comm::{check_blocks, check_rank, recv_length_error, CommCounters, CommError, Communicator};
use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::request::{Request, Scope, StaticScope};
use mpi::topology::{Color, Communicator as _, SimpleCommunicator};
use mpi::traits::*;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// One MPI process of `MPI_COMM_WORLD`, or of a communicator split from it.
pub struct MpiComm {
    comm: SimpleCommunicator,
    /// World rank of each rank of `comm`.
    world_ranks: Vec<usize>,
    /// Whether `comm` is a sub-communicator (messages then name world ranks too).
    sub: bool,
    timeout: Duration,
    scratch: Vec<f32>,
    scratch_f64: Vec<f64>,
    counters: CommCounters,
    /// Nanoseconds spent completing collectives (counted where only `&self` is held).
    collective_ns: std::cell::Cell<u64>,
    /// Sends not yet known to be complete.
    pending: Vec<PendingSend>,
    /// Whether MPI runs under `MPI_THREAD_MULTIPLE` ([`MpiComm::init_threaded`]).
    threads: bool,
    // Dropped after `comm`: the last handle finalises MPI. None in a
    // [`Communicator::duplicate`], which must be dropped before the world's.
    universe: Option<Rc<Universe>>,
}

/// [`Communicator::duplicate`]'s handle: an `MPI_Comm_dup` of a group, moved
/// to the thread that uses it.
struct Threaded(MpiComm);

// SAFETY: MPI was initialised with MPI_THREAD_MULTIPLE (`duplicate` refuses
// otherwise), so any thread may call it; the value is moved, never shared
// (no `Sync`), so its `Cell` and its sends' buffers have one user at a time;
// and it holds no `Rc` (`universe` is None), whose count other threads touch.
unsafe impl Send for Threaded {}

impl std::ops::Deref for Threaded {
    type Target = MpiComm;
    fn deref(&self) -> &MpiComm {
        &self.0
    }
}

impl std::ops::DerefMut for Threaded {
    fn deref_mut(&mut self) -> &mut MpiComm {
        &mut self.0
    }
}

/// An `MPI_Isend` and the copy of the payload it reads.
struct PendingSend {
    req: Request<'static, [f32], StaticScope>,
    /// Owned by this value (from `Box::into_raw`) until `req` completes.
    buf: *mut [f32],
    dest: usize,
}

impl PendingSend {
    fn start(comm: &SimpleCommunicator, payload: &[f32], dest: usize, tag: i32) -> Self {
        let buf = Box::into_raw(payload.to_vec().into_boxed_slice());
        // SAFETY: `buf` stays allocated, and is neither written nor freed,
        // until `req` has completed (`test` frees it only then), so the
        // reference never dangles while MPI may read it.
        let data: &'static [f32] = unsafe { &*buf };
        let req = comm.process_at_rank(dest as i32).immediate_send_with_tag(StaticScope, data, tag);
        Self { req, buf, dest }
    }

    /// Tests the send: when complete, frees the payload and returns `None`.
    fn test(self) -> Option<Self> {
        match self.req.test() {
            Ok(_) => {
                // SAFETY: the request is complete and consumed, so nothing
                // refers to the payload any more; `buf` came from `Box::into_raw`.
                drop(unsafe { Box::from_raw(self.buf) });
                None
            }
            Err(req) => Some(Self { req, ..self }),
        }
    }
}

/// Polls with a deadline without burning a core: spins briefly (ranks that
/// are in step complete within microseconds), then sleeps with a growing
/// pause up to 1 ms, so a rank waiting for another (rank 0 evaluating or
/// writing a checkpoint) leaves the CPU to it.
struct Backoff {
    deadline: Instant,
    pause: Duration,
    spins: u32,
}

impl Backoff {
    fn new(timeout: Duration) -> Self {
        Self { deadline: Instant::now() + timeout, pause: Duration::from_micros(20), spins: 0 }
    }

    /// Waits a little before the next poll; false once the deadline has passed.
    fn wait(&mut self) -> bool {
        if Instant::now() >= self.deadline {
            return false;
        }
        if self.spins < 100 {
            self.spins += 1;
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.pause);
            self.pause = (self.pause * 2).min(Duration::from_millis(1));
        }
        true
    }
}

/// A tag as MPI's `int`.
fn mpi_tag(op: &'static str, tag: u32) -> Result<i32, CommError> {
    i32::try_from(tag).map_err(|_| CommError::BadLength { op, detail: format!("tag {tag} above MPI's {}", i32::MAX) })
}

impl MpiComm {
    /// Initialises MPI (funneled: only this thread calls it) and checks that
    /// the launcher and the library agree on the world size.
    pub fn init(timeout: Duration) -> Result<Self, CommError> {
        Self::init_at(timeout, mpi::Threading::Funneled)
    }

    /// [`MpiComm::init`] under `MPI_THREAD_MULTIPLE`, so that
    /// [`Communicator::duplicate`] can hand a group to another thread; an
    /// error if this MPI library does not provide it.
    pub fn init_threaded(timeout: Duration) -> Result<Self, CommError> {
        Self::init_at(timeout, mpi::Threading::Multiple)
    }

    fn init_at(timeout: Duration, level: mpi::Threading) -> Result<Self, CommError> {
        let (universe, provided) = mpi::initialize_with_threading(level)
            .ok_or_else(|| CommError::Launch("MPI was already initialised in this process".into()))?;
        if level == mpi::Threading::Multiple && provided < level {
            return Err(CommError::Unsupported(format!(
                "this MPI library provides thread level {provided:?}, below the {level:?} asked for (dist.overlap_comm needs MPI_THREAD_MULTIPLE); use an MPI built with thread support (OpenMPI ≥ 3 and MPICH are) or set dist.overlap_comm = false"
            )));
        }
        let world = universe.world();
        let size = world.size() as usize;
        if let Some((n, var)) = launcher_world_size() {
            if n != size {
                return Err(CommError::Launch(format!(
                    "the launcher set {var}={n} but MPI reports a world of {size}: this binary was built against a different MPI than the mpirun that started it (OpenMPI vs MPICH); rebuild against the MPI whose mpirun you use"
                )));
            }
        }
        let threads = level == mpi::Threading::Multiple;
        Ok(Self::over(world, (0..size).collect(), false, timeout, threads, Some(Rc::new(universe))))
    }

    fn over(
        comm: SimpleCommunicator,
        world_ranks: Vec<usize>,
        sub: bool,
        timeout: Duration,
        threads: bool,
        universe: Option<Rc<Universe>>,
    ) -> Self {
        Self {
            comm,
            world_ranks,
            sub,
            timeout,
            scratch: Vec::new(),
            scratch_f64: Vec::new(),
            counters: CommCounters::default(),
            collective_ns: std::cell::Cell::new(0),
            pending: Vec::new(),
            threads,
            universe,
        }
    }

    /// How messages name rank `rank` of this communicator.
    fn name(&self, rank: usize) -> String {
        if self.sub {
            format!("rank {rank} (world rank {})", self.world_ranks[rank])
        } else {
            format!("rank {rank}")
        }
    }

    /// Reports `what` this rank waited for and aborts the whole job.
    fn die(&self, what: std::fmt::Arguments) -> ! {
        eprintln!(
            "error: {} waited {:.1}s {what}, which never arrived (stalled or dead); aborting the MPI job (raise dist.timeout_s if ranks are just slow)",
            self.name(self.rank()),
            self.timeout.as_secs_f64()
        );
        SimpleCommunicator::world().abort(3)
    }

    /// Polls `req` until it completes; past the deadline, reports and aborts
    /// the whole job (an outstanding MPI collective cannot be cancelled).
    fn finish<'a, D: ?Sized, S: Scope<'a>>(&self, n_call: u64, op: &str, mut req: Request<'a, D, S>) {
        let mut wait = Backoff::new(self.timeout);
        let t0 = std::time::Instant::now();
        loop {
            match req.test() {
                Ok(_) => {
                    self.collective_ns.set(self.collective_ns.get() + t0.elapsed().as_nanos() as u64);
                    return;
                }
                Err(r) => req = r,
            }
            if !wait.wait() {
                self.die(format_args!("in {op} (collective #{n_call}) for a rank"));
            }
        }
    }

    /// Frees the sends that have completed.
    fn reap_sends(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        self.pending = pending.into_iter().filter_map(PendingSend::test).collect();
    }

    fn count(&mut self, n_bytes: usize) -> u64 {
        self.reap_sends();
        self.counters.n_calls += 1;
        self.counters.bytes_sent += n_bytes as u64;
        self.counters.n_calls
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // A request must complete before its buffer is freed.
        let _ = self.flush_sends();
        let last = self.universe.as_ref().is_some_and(|u| Rc::strong_count(u) == 1);
        if last && LIVE_DUPLICATES.load(Ordering::SeqCst) > 0 {
            eprintln!(
                "error: MPI is finalising while a communicator duplicated for another thread is alive; drop the duplicate (the trainer holding it) before the world's communicator"
            );
            std::process::abort();
        }
    }
}

/// [`Communicator::duplicate`]s alive (they hold no share of `MPI_Init`).
static LIVE_DUPLICATES: AtomicUsize = AtomicUsize::new(0);

impl Drop for Threaded {
    fn drop(&mut self) {
        LIVE_DUPLICATES.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let n = self.count(4 * buf.len());
        // rsmpi's safe API has no MPI_IN_PLACE: reduce from a copy.
        self.scratch.clear();
        self.scratch.extend_from_slice(buf);
        let this = &*self;
        mpi::request::scope(|sc| {
            let req = this.comm.immediate_all_reduce_into(sc, &this.scratch[..], buf, SystemOperation::sum());
            this.finish(n, "all_reduce", req);
        });
        Ok(())
    }

    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CommError> {
        let n = self.count(8 * buf.len());
        self.scratch_f64.clear();
        self.scratch_f64.extend_from_slice(buf);
        let this = &*self;
        mpi::request::scope(|sc| {
            let req = this.comm.immediate_all_reduce_into(sc, &this.scratch_f64[..], buf, SystemOperation::sum());
            this.finish(n, "all_reduce_f64", req);
        });
        Ok(())
    }

    fn reduce_scatter_sum(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        check_blocks("reduce_scatter", input.len(), output.len(), self.world_size())?;
        let n = self.count(4 * input.len());
        let this = &*self;
        mpi::request::scope(|sc| {
            let req = this.comm.immediate_reduce_scatter_block_into(sc, input, output, SystemOperation::sum());
            this.finish(n, "reduce_scatter", req);
        });
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        check_blocks("all_gather", output.len(), input.len(), self.world_size())?;
        let n = self.count(4 * input.len());
        let this = &*self;
        mpi::request::scope(|sc| {
            let req = this.comm.immediate_all_gather_into(sc, input, output);
            this.finish(n, "all_gather", req);
        });
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        check_rank("broadcast", "root", root, self.world_size())?;
        let bytes = if self.rank() == root { 4 * buf.len() } else { 0 };
        let n = self.count(bytes);
        let this = &*self;
        mpi::request::scope(|sc| {
            let req = this.comm.process_at_rank(root as i32).immediate_broadcast_into(sc, buf);
            this.finish(n, "broadcast", req);
        });
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let n = self.count(0);
        let req = self.comm.immediate_barrier();
        self.finish(n, "barrier", req);
        Ok(())
    }

    fn counters(&self) -> CommCounters {
        CommCounters { collective_ns: self.collective_ns.get(), ..self.counters }
    }

    fn buffer_bytes(&self) -> usize {
        let in_flight: usize = self.pending.iter().map(|p| p.buf.len()).sum();
        4 * self.scratch.capacity() + 8 * self.scratch_f64.capacity() + 4 * in_flight
    }

    fn abort(&mut self, reason: &str) {
        eprintln!("error: {} failed: {reason}; aborting the MPI job", self.name(self.rank()));
        SimpleCommunicator::world().abort(2);
    }

    fn send(&mut self, buf: &[f32], dest: usize, tag: u32) -> Result<(), CommError> {
        check_rank("send", "destination", dest, self.world_size())?;
        let mpi_tag = mpi_tag("send", tag)?;
        self.reap_sends();
        self.counters.count_send(buf.len());
        self.pending.push(PendingSend::start(&self.comm, buf, dest, mpi_tag));
        Ok(())
    }

    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u32) -> Result<(), CommError> {
        check_rank("recv", "source", src, self.world_size())?;
        let mpi_tag = mpi_tag("recv", tag)?;
        self.reap_sends();
        let source = self.comm.process_at_rank(src as i32);
        let mut wait = Backoff::new(self.timeout);
        let (msg, status) = loop {
            if let Some(m) = source.immediate_matched_probe_with_tag(mpi_tag) {
                break m;
            }
            if !wait.wait() {
                self.die(format_args!("in recv for a message from {} under tag {tag}", self.name(src)));
            }
        };
        // A message of f32s has a whole count; anything else cannot match.
        let sent = usize::try_from(status.count(f32::equivalent_datatype())).unwrap_or(usize::MAX);
        if sent != buf.len() {
            let (_dropped, _): (Vec<u8>, _) = (msg, status).matched_receive_vec();
            return Err(recv_length_error(src, tag, sent, buf.len()));
        }
        msg.matched_receive_into(buf);
        Ok(())
    }

    fn flush_sends(&mut self) -> Result<(), CommError> {
        let mut wait = Backoff::new(self.timeout);
        loop {
            self.reap_sends();
            if self.pending.is_empty() {
                return Ok(());
            }
            if !wait.wait() {
                let dests: Vec<String> = self.pending.iter().map(|p| self.name(p.dest)).collect();
                self.die(format_args!("in flush_sends for {} to receive", dests.join(", ")));
            }
        }
    }

    fn split(&mut self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError> {
        let as_int = |what: &str, x: usize| {
            i32::try_from(x).map_err(|_| CommError::BadLength {
                op: "split",
                detail: format!("{what} {x} above MPI's {}", i32::MAX),
            })
        };
        let mine = [as_int("color", color)?, as_int("key", key)?];
        let n = self.count(0);
        // MPI_Comm_split blocks: gather every rank's (color, key) first under
        // the deadline, so that a rank that never arrives is named, not waited on forever.
        let mut all = vec![0i32; 2 * self.world_size()];
        let this = &*self;
        mpi::request::scope(|sc| {
            let req = this.comm.immediate_all_gather_into(sc, &mine[..], &mut all[..]);
            this.finish(n, "split", req);
        });
        let comm = self
            .comm
            .split_by_color_with_key(Color::with_value(mine[0]), mine[1])
            .ok_or_else(|| CommError::Launch("MPI_Comm_split returned no communicator".into()))?;
        let pairs: Vec<[i32; 2]> = all.chunks(2).map(|p| [p[0], p[1]]).collect();
        let mut members: Vec<usize> = (0..pairs.len()).filter(|&r| pairs[r][0] == mine[0]).collect();
        members.sort_by_key(|&r| (pairs[r][1], r));
        let world_ranks: Vec<usize> = members.iter().map(|&r| self.world_ranks[r]).collect();
        if world_ranks.get(comm.rank() as usize) != Some(&self.world_ranks[self.rank()]) {
            return Err(CommError::Launch(format!(
                "MPI_Comm_split placed {} at rank {} of its group, not where (key, rank) orders it",
                self.name(self.rank()),
                comm.rank()
            )));
        }
        Ok(Box::new(Self::over(comm, world_ranks, true, self.timeout, self.threads, self.universe.clone())))
    }

    fn duplicate(&mut self) -> Result<Box<dyn Communicator + Send>, CommError> {
        if !self.threads {
            return Err(CommError::Unsupported(
                "MPI was started for one thread (funneled); a communicator for another thread needs MpiComm::init_threaded (MPI_THREAD_MULTIPLE)".into(),
            ));
        }
        let n = self.count(0);
        // MPI_Comm_dup blocks: meet every rank first under the deadline.
        let req = self.comm.immediate_barrier();
        self.finish(n, "duplicate", req);
        let comm = self.comm.duplicate();
        let dup = Self::over(comm, self.world_ranks.clone(), self.sub, self.timeout, true, None);
        LIVE_DUPLICATES.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(Threaded(dup)))
    }
}

impl Communicator for Threaded {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        self.0.all_reduce_sum(buf)
    }
    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CommError> {
        self.0.all_reduce_sum_f64(buf)
    }
    fn reduce_scatter_sum(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.0.reduce_scatter_sum(input, output)
    }
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.0.all_gather(input, output)
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.0.broadcast(buf, root)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.0.barrier()
    }
    fn counters(&self) -> CommCounters {
        self.0.counters()
    }
    fn abort(&mut self, reason: &str) {
        self.0.abort(reason)
    }
    fn buffer_bytes(&self) -> usize {
        self.0.buffer_bytes()
    }
    fn send(&mut self, buf: &[f32], dest: usize, tag: u32) -> Result<(), CommError> {
        self.0.send(buf, dest, tag)
    }
    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u32) -> Result<(), CommError> {
        self.0.recv(buf, src, tag)
    }
    fn flush_sends(&mut self) -> Result<(), CommError> {
        self.0.flush_sends()
    }
    fn split(&mut self, _color: usize, _key: usize) -> Result<Box<dyn Communicator>, CommError> {
        Err(CommError::Unsupported("a duplicated MPI communicator is not split further".into()))
    }
    fn duplicate(&mut self) -> Result<Box<dyn Communicator + Send>, CommError> {
        Err(CommError::Unsupported("a duplicated MPI communicator is not duplicated further".into()))
    }
}
