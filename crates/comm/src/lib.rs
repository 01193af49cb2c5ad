//! Communication for data and pipeline parallelism.
//!
//! [`Communicator`] is what the engine sees: sum all-reduce (f32 gradients,
//! f64 statistics), reduce-scatter, all-gather, broadcast and barrier, plus
//! point-to-point messages and sub-groups. A collective is called by all
//! ranks of the group in the same order with the same lengths, or the group
//! fails with an error naming the rank — never an endless hang.
//!
//! Point-to-point ([`Communicator::send`], [`Communicator::recv`]): a send is
//! buffered — it copies the payload and returns without waiting for the
//! receiver, so two ranks that both send to each other before receiving
//! cannot deadlock. Messages from one rank to another under one tag arrive in
//! the order sent; different tags are independent queues. A receive names its
//! source and tag, needs a buffer of exactly the sent length (else
//! [`CommError::BadLength`], the message being consumed), and waits at most
//! the group's timeout (MPI then aborts the job naming the source, as it does
//! for a collective); a source that failed or left makes it fail promptly.
//! [`Communicator::flush_sends`] waits until the transport holds every
//! message sent (the end of an optimizer step). Sends are counted in [`CommCounters::p2p_messages`] and
//! [`CommCounters::p2p_bytes_sent`], never as collectives.
//!
//! Sub-groups ([`Communicator::split`]): a collective over the group in which
//! the ranks passing the same color form a new group, ranked by key, then by
//! their rank in the parent, with the parent's timeout; it counts as one
//! collective call without payload. The failure of a rank
//! is seen in every group it belongs to and in the groups derived from the
//! same world: the threads backend marks them all failed, MPI aborts the job.
//!
//! Backends: [`SingleProcess`] (default), [`threads`] (ranks as threads in one
//! process: one machine, and the engine of the tests) and MPI (crate
//! `macrobatch-comm-mpi`, feature `mpi`: processes started by `mpirun`,
//! across machines).

pub mod launcher;
pub mod threads;

use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use thiserror::Error;

/// Why a collective, a send or a receive failed.
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
    /// The backend cannot do what was asked of it here.
    #[error("{0}")]
    Unsupported(String),
    /// A receive from this rank itself with nothing queued: no message can
    /// ever arrive, so waiting would only hang.
    #[error("rank {me} receives from itself under tag {tag} but sent nothing under it")]
    NothingToReceive {
        /// The tag.
        tag: u32,
        /// The reporting rank (also the source).
        me: usize,
    },
}

/// Calls and payload bytes this rank handed to collectives and sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommCounters {
    /// Number of collective calls.
    pub n_calls: u64,
    /// Bytes of input this rank contributed to collectives (the logical
    /// payload; a ring all-reduce moves about 2·(W−1)/W of it over the wire
    /// per rank).
    pub bytes_sent: u64,
    /// Number of point-to-point messages sent.
    pub p2p_messages: u64,
    /// Payload bytes of the point-to-point messages sent.
    pub p2p_bytes_sent: u64,
    /// Wall time spent inside collectives, in nanoseconds: the transfer and
    /// the wait for the slowest rank (what a profile shows as gradient
    /// synchronisation).
    pub collective_ns: u64,
}

impl CommCounters {
    /// Counts one point-to-point message of `n` f32 elements.
    pub fn count_send(&mut self, n: usize) {
        self.p2p_messages += 1;
        self.p2p_bytes_sent += 4 * n as u64;
    }
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
    /// Bytes this rank's communicator keeps for staging collectives and sends in flight.
    fn buffer_bytes(&self) -> usize {
        0
    }
    /// Point-to-point: sends `buf` to rank `dest` of this group under `tag`.
    /// Returns once the data is handed off — it never waits for the receiver to
    /// post its receive, so two ranks that both send to each other first cannot
    /// deadlock. Messages from one rank to another under the same tag arrive in
    /// the order sent.
    fn send(&mut self, buf: &[f32], dest: usize, tag: u32) -> Result<(), CommError>;
    /// Receives the next message from `src` under `tag` into `buf`, which must
    /// have exactly the sent length (else `CommError::BadLength` naming both
    /// lengths). Waits at most the group's timeout (then `CommError::Timeout`
    /// naming `src`); a failed/departed `src` gives `RankFailed` promptly.
    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u32) -> Result<(), CommError>;
    /// Waits until every message this rank sent has been handed to the
    /// transport (MPI: all outstanding Isends complete). Called at the end of
    /// an optimizer step.
    fn flush_sends(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    /// A collective over this group: ranks passing the same `color` form a new
    /// group; ranks in it are ordered by `key`, then by their rank here. Every
    /// rank of this group must call it (same order of calls).
    fn split(&mut self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError>;
    /// A collective over this group: a second handle on the same ranks, in
    /// the same order, that another thread may own. It runs the same
    /// collective algorithms as this one (so a sum of the same buffer has
    /// the same bits) on its own stream of messages, so the two handles may
    /// be used at the same time. Every rank must call it (same order of calls).
    /// `CommError::Unsupported` where the backend cannot (MPI without
    /// `MPI_THREAD_MULTIPLE`).
    fn duplicate(&mut self) -> Result<Box<dyn Communicator + Send>, CommError>;
}

/// Checks that `rank` (the `role` of a call: destination, source or root)
/// names a rank of a group of `world`.
pub fn check_rank(op: &'static str, role: &str, rank: usize, world: usize) -> Result<(), CommError> {
    if rank < world {
        Ok(())
    } else {
        Err(CommError::BadLength { op, detail: format!("{role} {rank} in a group of {world}") })
    }
}

/// The error of a receive whose buffer does not have the length of the message.
pub fn recv_length_error(src: usize, tag: u32, sent: usize, buf: usize) -> CommError {
    CommError::BadLength {
        op: "recv",
        detail: format!("rank {src} sent {sent} elements under tag {tag} but the receive buffer holds {buf}"),
    }
}

/// Checks the lengths of a reduce-scatter or all-gather: `big = W · small`.
pub fn check_blocks(op: &'static str, big: usize, small: usize, world: usize) -> Result<(), CommError> {
    if big == small * world {
        Ok(())
    } else {
        Err(CommError::BadLength { op, detail: format!("{big} elements for {world} blocks of {small}") })
    }
}

/// One process, one rank: every collective is the identity, and a message
/// sent to rank 0 is queued for this rank's own receive.
#[derive(Debug, Default)]
pub struct SingleProcess {
    counters: CommCounters,
    /// Messages sent to itself, per tag, oldest first.
    mailbox: HashMap<u32, VecDeque<Vec<f32>>>,
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
        check_rank("broadcast", "root", root, 1)?;
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
    fn send(&mut self, buf: &[f32], dest: usize, tag: u32) -> Result<(), CommError> {
        check_rank("send", "destination", dest, 1)?;
        self.counters.count_send(buf.len());
        self.mailbox.entry(tag).or_default().push_back(buf.to_vec());
        Ok(())
    }
    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u32) -> Result<(), CommError> {
        check_rank("recv", "source", src, 1)?;
        let msg = self.mailbox.get_mut(&tag).and_then(VecDeque::pop_front);
        let msg = msg.ok_or(CommError::NothingToReceive { tag, me: 0 })?;
        if msg.len() != buf.len() {
            return Err(recv_length_error(src, tag, msg.len(), buf.len()));
        }
        buf.copy_from_slice(&msg);
        Ok(())
    }
    fn split(&mut self, _color: usize, _key: usize) -> Result<Box<dyn Communicator>, CommError> {
        self.count(0);
        Ok(Box::new(SingleProcess::new()))
    }
    fn duplicate(&mut self) -> Result<Box<dyn Communicator + Send>, CommError> {
        self.count(0);
        Ok(Box::new(SingleProcess::new()))
    }
}

/// Default time a rank waits in a collective before declaring the others lost.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_process_receives_what_it_sent_to_itself() {
        let mut c = SingleProcess::new();
        c.send(&[1.0, 2.0], 0, 3).unwrap();
        c.send(&[3.0], 0, 3).unwrap();
        c.send(&[9.0], 0, 4).unwrap();
        let (mut a, mut b, mut d) = ([0.0; 2], [0.0], [0.0]);
        c.recv(&mut d, 0, 4).unwrap();
        c.recv(&mut a, 0, 3).unwrap();
        c.recv(&mut b, 0, 3).unwrap();
        assert_eq!((a, b, d), ([1.0, 2.0], [3.0], [9.0]));
        assert_eq!(c.recv(&mut b, 0, 3), Err(CommError::NothingToReceive { tag: 3, me: 0 }));
        c.send(&[1.0, 2.0], 0, 3).unwrap();
        let e = c.recv(&mut b, 0, 3).unwrap_err();
        assert!(e.to_string().contains("sent 2 elements under tag 3 but the receive buffer holds 1"), "{e}");
        assert!(matches!(c.send(&b, 1, 0), Err(CommError::BadLength { op: "send", .. })));
        assert_eq!(
            c.counters(),
            CommCounters { n_calls: 0, bytes_sent: 0, p2p_messages: 4, p2p_bytes_sent: 24, collective_ns: 0 }
        );
        let sub = c.split(7, 1).unwrap();
        assert_eq!((sub.rank(), sub.world_size()), (0, 1));
    }
}
