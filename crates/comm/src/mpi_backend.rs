//! MPI backend (feature `mpi`): processes started by `mpirun`, on one machine
//! or many, through rsmpi on the system's MPI (OpenMPI or MPICH).
//!
//! Every collective is issued non-blocking and polled with a deadline, so a
//! rank that stalls makes the others print an error and abort the job instead
//! of hanging; a rank that dies is reported by `mpirun`, which ends the job.
//! MPI is only ever called from the thread that created this value.

use crate::launcher::launcher_world_size;
use crate::{check_blocks, CommCounters, CommError, Communicator};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::*;
use std::time::{Duration, Instant};

/// One MPI process of `MPI_COMM_WORLD`.
pub struct MpiComm {
    world: SimpleCommunicator,
    timeout: Duration,
    scratch: Vec<f32>,
    scratch_f64: Vec<f64>,
    counters: CommCounters,
    // Dropped last: finalises MPI.
    _universe: Universe,
}

impl MpiComm {
    /// Initialises MPI (funneled: only this thread calls it) and checks that
    /// the launcher and the library agree on the world size.
    pub fn init(timeout: Duration) -> Result<Self, CommError> {
        let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| CommError::Launch("MPI was already initialised in this process".into()))?;
        let world = universe.world();
        let size = world.size() as usize;
        if let Some((n, var)) = launcher_world_size() {
            if n != size {
                return Err(CommError::Launch(format!(
                    "the launcher set {var}={n} but MPI reports a world of {size}: this binary was built against a different MPI than the mpirun that started it (OpenMPI vs MPICH); rebuild against the MPI whose mpirun you use"
                )));
            }
        }
        Ok(Self {
            world,
            timeout,
            scratch: Vec::new(),
            scratch_f64: Vec::new(),
            counters: CommCounters::default(),
            _universe: universe,
        })
    }

    /// Polls `req` until it completes; past the deadline, reports and aborts
    /// the whole job (an outstanding MPI collective cannot be cancelled).
    fn finish<'a, D: ?Sized, S: Scope<'a>>(
        world: &SimpleCommunicator,
        timeout: Duration,
        n_call: u64,
        op: &str,
        mut req: Request<'a, D, S>,
    ) {
        let deadline = Instant::now() + timeout;
        // Poll without burning a core: spin briefly (collectives between
        // ranks that are in step complete within microseconds), then sleep
        // with a growing pause up to 1 ms, so a rank waiting for another
        // (rank 0 evaluating or writing a checkpoint) leaves the CPU to it.
        let mut pause = Duration::from_micros(20);
        let mut spins = 0u32;
        loop {
            match req.test() {
                Ok(_) => return,
                Err(r) => req = r,
            }
            if Instant::now() >= deadline {
                eprintln!(
                    "error: rank {} waited {:.1}s in {op} (collective #{n_call}) for a rank that never arrived (stalled or dead); aborting the MPI job (raise dist.timeout_s if ranks are just slow)",
                    world.rank(),
                    timeout.as_secs_f64()
                );
                world.abort(3);
            }
            if spins < 100 {
                spins += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }

    fn count(&mut self, n_bytes: usize) -> u64 {
        self.counters.n_calls += 1;
        self.counters.bytes_sent += n_bytes as u64;
        self.counters.n_calls
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let n = self.count(4 * buf.len());
        // rsmpi's safe API has no MPI_IN_PLACE: reduce from a copy.
        self.scratch.clear();
        self.scratch.extend_from_slice(buf);
        let (world, timeout, send) = (&self.world, self.timeout, &self.scratch);
        mpi::request::scope(|sc| {
            let req = world.immediate_all_reduce_into(sc, &send[..], buf, SystemOperation::sum());
            Self::finish(world, timeout, n, "all_reduce", req);
        });
        Ok(())
    }

    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CommError> {
        let n = self.count(8 * buf.len());
        self.scratch_f64.clear();
        self.scratch_f64.extend_from_slice(buf);
        let (world, timeout, send) = (&self.world, self.timeout, &self.scratch_f64);
        mpi::request::scope(|sc| {
            let req = world.immediate_all_reduce_into(sc, &send[..], buf, SystemOperation::sum());
            Self::finish(world, timeout, n, "all_reduce_f64", req);
        });
        Ok(())
    }

    fn reduce_scatter_sum(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        check_blocks("reduce_scatter", input.len(), output.len(), self.world_size())?;
        let n = self.count(4 * input.len());
        let (world, timeout) = (&self.world, self.timeout);
        mpi::request::scope(|sc| {
            let req = world.immediate_reduce_scatter_block_into(sc, input, output, SystemOperation::sum());
            Self::finish(world, timeout, n, "reduce_scatter", req);
        });
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        check_blocks("all_gather", output.len(), input.len(), self.world_size())?;
        let n = self.count(4 * input.len());
        let (world, timeout) = (&self.world, self.timeout);
        mpi::request::scope(|sc| {
            let req = world.immediate_all_gather_into(sc, input, output);
            Self::finish(world, timeout, n, "all_gather", req);
        });
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.world_size() {
            return Err(CommError::BadLength {
                op: "broadcast",
                detail: format!("root {root} in a group of {}", self.world_size()),
            });
        }
        let bytes = if self.rank() == root { 4 * buf.len() } else { 0 };
        let n = self.count(bytes);
        let (world, timeout) = (&self.world, self.timeout);
        mpi::request::scope(|sc| {
            let req = world.process_at_rank(root as i32).immediate_broadcast_into(sc, buf);
            Self::finish(world, timeout, n, "broadcast", req);
        });
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let n = self.count(0);
        let req = self.world.immediate_barrier();
        Self::finish(&self.world, self.timeout, n, "barrier", req);
        Ok(())
    }

    fn counters(&self) -> CommCounters {
        self.counters
    }

    fn buffer_bytes(&self) -> usize {
        4 * self.scratch.capacity() + 8 * self.scratch_f64.capacity()
    }

    fn abort(&mut self, reason: &str) {
        eprintln!("error: rank {} failed: {reason}; aborting the MPI job", self.rank());
        self.world.abort(2);
    }
}
