//! Collective communication for data parallelism.
//!
//! [`Communicator`] is what the engine sees: sum all-reduce (f32 gradients,
//! f64 statistics), reduce-scatter, all-gather, broadcast and barrier. Every
//! call is a collective: all ranks make the same calls in the same order with
//! the same lengths, or the group fails with an error naming the rank — never
//! an endless hang.
//!
//! Backends: [`SingleProcess`] (default), [`threads`] (ranks as threads in one
//! process: one machine, and the engine of the tests) and `mpi` (feature
//! `mpi`: processes started by `mpirun`, across machines).

pub mod launcher;
#[cfg(feature = "mpi")]
pub mod mpi_backend;
pub mod threads;

use std::time::Duration;
use thiserror::Error;

/// Why a collective failed.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CommError {
    /// Another rank panicked, returned an error, or exited.
    #[error("rank {rank} failed ({reason}); rank {me} stops too")]
    RankFailed {
        /// The failed rank.
        rank: usize,
        /// What happened to it.
        reason: String,
        /// The reporting rank.
        me: usize,
    },
    /// Some ranks did not reach a collective in time.
    #[error("rank {me} waited {seconds:.1}s in {op} for rank(s) {missing:?}, which never arrived (stalled or dead); raise dist.timeout_s if they are just slow")]
    Timeout {
        /// The collective.
        op: &'static str,
        /// Ranks that did not arrive.
        missing: Vec<usize>,
        /// The timeout.
        seconds: f64,
        /// The reporting rank.
        me: usize,
    },
    /// Ranks called different collectives or lengths at the same point.
    #[error("ranks disagree at collective #{index}: rank {me} called {mine}, another rank called {other}")]
    Mismatch {
        /// Sequence number of the collective.
        index: u64,
        /// This rank's call.
        mine: String,
        /// The other call.
        other: String,
        /// The reporting rank.
        me: usize,
    },
    /// A buffer length does not fit the collective.
    #[error("{op}: {detail}")]
    BadLength {
        /// The collective.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The launcher and the binary disagree, or MPI failed to start.
    #[error("{0}")]
    Launch(String),
}

/// Calls and payload bytes this rank handed to collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommCounters {
    /// Number of collective calls.
    pub n_calls: u64,
    /// Bytes of input this rank contributed (the logical payload; a ring
    /// all-reduce moves about 2·(W−1)/W of it over the wire per rank).
    pub bytes_sent: u64,
    /// Point-to-point messages sent.
    pub p2p_messages: u64,
    /// Bytes sent in point-to-point messages.
    pub p2p_bytes_sent: u64,
}

/// A group of ranks that run collectives together.
pub trait Communicator {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Element-wise sum over ranks, in place.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError>;
    /// Element-wise sum over ranks, in place, in f64 (loss sums, token counts, norms).
    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CommError>;
    /// Sum over ranks of `input` (length W·n); rank r receives block r into `output` (length n).
    fn reduce_scatter_sum(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;
    /// Concatenation over ranks of `input` (length n) into `output` (length W·n).
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;
    /// Copies `buf` of rank `root` to every rank.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Waits for every rank.
    fn barrier(&mut self) -> Result<(), CommError>;
    /// What this rank has sent so far.
    fn counters(&self) -> CommCounters;
    /// This rank has failed outside a collective: make the others stop now
    /// rather than at their timeout. MPI aborts the job; threads mark the group failed.
    fn abort(&mut self, reason: &str);
    /// Bytes this rank's communicator keeps for staging collectives.
    fn buffer_bytes(&self) -> usize {
        0
    }
    /// Point-to-point: sends `buf` to rank `dest` under `tag` (buffered).
    fn send(&mut self, _buf: &[f32], _dest: usize, _tag: u32) -> Result<(), CommError> {
        Err(CommError::Launch("point-to-point messages are not supported by this backend".into()))
    }
    /// Receives the next message from `src` under `tag` into `buf`.
    fn recv(&mut self, _buf: &mut [f32], _src: usize, _tag: u32) -> Result<(), CommError> {
        Err(CommError::Launch("point-to-point messages are not supported by this backend".into()))
    }
    /// Waits until every message this rank sent has been handed off.
    fn flush_sends(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    /// Ranks with the same `color` form a new group, ordered by `key`.
    fn split(&mut self, _color: usize, _key: usize) -> Result<Box<dyn Communicator>, CommError> {
        Err(CommError::Launch("sub-communicators are not supported by this backend".into()))
    }
}

/// Checks the lengths of a reduce-scatter or all-gather: `big = W · small`.
pub(crate) fn check_blocks(op: &'static str, big: usize, small: usize, world: usize) -> Result<(), CommError> {
    if big == small * world {
        Ok(())
    } else {
        Err(CommError::BadLength { op, detail: format!("{big} elements for {world} blocks of {small}") })
    }
}

/// One process, one rank: every collective is the identity.
#[derive(Debug, Default)]
pub struct SingleProcess {
    counters: CommCounters,
}

impl SingleProcess {
    /// The trivial group.
    pub fn new() -> Self {
        Self::default()
    }

    fn count(&mut self, n_bytes: usize) {
        self.counters.n_calls += 1;
        self.counters.bytes_sent += n_bytes as u64;
    }
}

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        self.count(4 * buf.len());
        Ok(())
    }
    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CommError> {
        self.count(8 * buf.len());
        Ok(())
    }
    fn reduce_scatter_sum(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        check_blocks("reduce_scatter", input.len(), output.len(), 1)?;
        self.count(4 * input.len());
        output.copy_from_slice(input);
        Ok(())
    }
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        check_blocks("all_gather", output.len(), input.len(), 1)?;
        self.count(4 * input.len());
        output.copy_from_slice(input);
        Ok(())
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root != 0 {
            return Err(CommError::BadLength { op: "broadcast", detail: format!("root {root} in a group of 1") });
        }
        self.count(4 * buf.len());
        Ok(())
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.count(0);
        Ok(())
    }
    fn counters(&self) -> CommCounters {
        self.counters
    }
    fn abort(&mut self, _reason: &str) {}
}

/// Default time a rank waits in a collective before declaring the others lost.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
