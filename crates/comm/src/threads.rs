//! Ranks as threads of one process, sharing memory.
//!
//! Each collective: every rank deposits its contribution in its own slot; the
//! last to arrive combines the slots *in rank order* (sums in f64), so the
//! result is deterministic and identical on every rank. A rank that is
//! dropped (it returned, or panicked) marks itself departed and wakes the
//! others, who then fail with an error naming it instead of waiting forever;
//! a rank that stalls is named by the others after the timeout.
//!
//! Point-to-point: a send appends a copy of the payload to the mailbox of
//! (source, destination, tag), a FIFO, and returns at once; a receive takes
//! the oldest message of its mailbox, waiting on the group's condition
//! variable for at most the timeout. It fails promptly when the group has
//! failed, or when the source has departed with nothing left in the mailbox.
//!
//! [`Communicator::split`] is a collective that gathers every rank's (color,
//! key); the first rank to return from it builds one fresh group per color and
//! parks the handles in the parent's state under the split's index, and each
//! rank takes its own. All groups derived from one [`group`] share a hub that
//! holds the first failure: a rank that aborts, times out or is found departed
//! in any of them fails every collective and receive of all of them, woken
//! through each group's condition variable.

use crate::{check_blocks, check_rank, recv_length_error, CommCounters, CommError, Communicator};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq)]
struct Call {
    op: &'static str,
    len: usize,
    root: usize,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}(len {})", self.op, self.len)
    }
}

/// Locks `m`. A panicking rank never holds a lock across user code, so a
/// poisoned mutex still holds consistent state.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
struct State {
    /// Completed collectives.
    generation: u64,
    /// Ranks that deposited for the current collective.
    present: Vec<bool>,
    slots: Vec<Vec<f64>>,
    call: Option<Call>,
    result: Arc<Vec<f64>>,
    /// Ranks that left the group, and why.
    departed: Vec<Option<String>>,
    /// Messages sent and not yet received, per (source, destination, tag), oldest first.
    mail: HashMap<(usize, usize, u32), VecDeque<Vec<f32>>>,
    /// Handles to the groups a split made, per split index, until each rank took its own.
    parked: HashMap<u64, Vec<Option<ThreadComm>>>,
}

/// What all groups derived from one world share: the first failure.
#[derive(Debug, Default)]
struct Hub {
    /// World rank that failed, and why; set once, then every call of every group fails.
    failure: Mutex<Option<(usize, String)>>,
    /// The groups to wake when a failure is raised.
    groups: Mutex<Vec<Weak<Shared>>>,
}

impl Hub {
    fn failure(&self) -> Option<(usize, String)> {
        lock(&self.failure).clone()
    }

    /// Records that world rank `rank` failed (unless a failure is recorded
    /// already), wakes every group, and returns the recorded failure. The
    /// caller must not hold any group's lock.
    fn raise(&self, rank: usize, reason: String) -> (usize, String) {
        let recorded = lock(&self.failure).get_or_insert((rank, reason)).clone();
        let groups: Vec<Arc<Shared>> = lock(&self.groups).iter().filter_map(Weak::upgrade).collect();
        for g in groups {
            let _st = lock(&g.state);
            g.cv.notify_all();
        }
        recorded
    }

    fn register(&self, group: &Arc<Shared>) {
        let mut groups = lock(&self.groups);
        groups.retain(|g| g.strong_count() > 0);
        groups.push(Arc::downgrade(group));
    }
}

#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    /// World rank of each rank of this group.
    members: Vec<usize>,
    hub: Arc<Hub>,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    /// The error a rank `me` of this group reports for a failure of world rank `failed`.
    fn failure_error(&self, failed: usize, reason: String, me: usize) -> CommError {
        match self.members.iter().position(|&m| m == failed) {
            Some(rank) => CommError::RankFailed { rank, reason, me },
            None => CommError::RankFailed {
                rank: failed,
                reason: format!("{reason}; world rank {failed}, outside this group"),
                me,
            },
        }
    }

    /// One fresh group per color of `pairs` (color, key of each rank here):
    /// the handle of each rank of this group, at its index.
    fn split_groups(&self, pairs: &[(usize, usize)]) -> Vec<Option<ThreadComm>> {
        let mut order: Vec<usize> = (0..pairs.len()).collect();
        order.sort_by_key(|&r| (pairs[r], r));
        let mut handles: Vec<Option<ThreadComm>> = (0..pairs.len()).map(|_| None).collect();
        for ranks in order.chunk_by(|&a, &b| pairs[a].0 == pairs[b].0) {
            let members = ranks.iter().map(|&r| self.members[r]).collect();
            for (&r, comm) in ranks.iter().zip(new_group(members, self.timeout, &self.hub)) {
                handles[r] = Some(comm);
            }
        }
        handles
    }
}

/// One rank of an in-process group.
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    counters: CommCounters,
    /// Splits this rank has made (all ranks make them in the same order).
    n_splits: u64,
}

/// Creates `world` connected ranks; hand one to each thread.
pub fn group(world: usize, timeout: Duration) -> Vec<ThreadComm> {
    new_group((0..world).collect(), timeout, &Arc::new(Hub::default()))
}

/// A group of the world ranks `members` (in group-rank order) under `hub`.
fn new_group(members: Vec<usize>, timeout: Duration, hub: &Arc<Hub>) -> Vec<ThreadComm> {
    let world = members.len();
    let state = State {
        generation: 0,
        present: vec![false; world],
        slots: vec![Vec::new(); world],
        call: None,
        result: Arc::new(Vec::new()),
        departed: vec![None; world],
        mail: HashMap::new(),
        parked: HashMap::new(),
    };
    let shared =
        Arc::new(Shared { world, timeout, members, hub: hub.clone(), state: Mutex::new(state), cv: Condvar::new() });
    hub.register(&shared);
    (0..world)
        .map(|rank| ThreadComm { rank, shared: shared.clone(), counters: CommCounters::default(), n_splits: 0 })
        .collect()
}

/// A usize as two f64 words that hold it exactly (a collective's payload is f64).
fn to_words(x: usize) -> [f64; 2] {
    let x = x as u64;
    [(x >> 32) as f64, (x & 0xffff_ffff) as f64]
}

fn from_words(w: &[f64]) -> usize {
    (((w[0] as u64) << 32) | w[1] as u64) as usize
}

impl ThreadComm {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.shared.state)
    }

    fn failed(&self) -> Option<CommError> {
        let (rank, reason) = self.shared.hub.failure()?;
        Some(self.shared.failure_error(rank, reason, self.rank))
    }

    /// Marks rank `rank` of this group failed in every group of the world and
    /// returns the error this rank reports. The caller must not hold the lock.
    fn fail(&self, rank: usize, reason: String) -> CommError {
        let (rank, reason) = self.shared.hub.raise(self.shared.members[rank], reason);
        self.shared.failure_error(rank, reason, self.rank)
    }

    /// Runs one collective: deposit, wait for all, return the combined
    /// result; its wall time is counted.
    fn collective(
        &mut self,
        call: Call,
        contribution: Vec<f64>,
        combine: impl FnOnce(&[Vec<f64>]) -> Vec<f64>,
    ) -> Result<Arc<Vec<f64>>, CommError> {
        let t0 = std::time::Instant::now();
        let r = self.collective_untimed(call, contribution, combine);
        self.counters.collective_ns += t0.elapsed().as_nanos() as u64;
        r
    }

    fn collective_untimed(
        &mut self,
        call: Call,
        contribution: Vec<f64>,
        combine: impl FnOnce(&[Vec<f64>]) -> Vec<f64>,
    ) -> Result<Arc<Vec<f64>>, CommError> {
        self.counters.n_calls += 1;
        let world = self.shared.world;
        let mut st = self.lock();
        if let Some(e) = self.failed() {
            return Err(e);
        }
        match &st.call {
            Some(c) if *c != call => {
                let e = CommError::Mismatch {
                    index: st.generation,
                    mine: call.to_string(),
                    other: c.to_string(),
                    me: self.rank,
                };
                drop(st);
                self.fail(self.rank, format!("collective mismatch: {e}"));
                return Err(e);
            }
            Some(_) => {}
            None => st.call = Some(call.clone()),
        }
        st.slots[self.rank] = contribution;
        st.present[self.rank] = true;
        let my_gen = st.generation;
        if st.present.iter().all(|&p| p) {
            let result = Arc::new(combine(&st.slots));
            st.result = result.clone();
            st.present.iter_mut().for_each(|p| *p = false);
            st.slots.iter_mut().for_each(Vec::clear);
            st.call = None;
            st.generation += 1;
            self.shared.cv.notify_all();
            return Ok(result);
        }
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if st.generation > my_gen {
                return Ok(st.result.clone());
            }
            if let Some(e) = self.failed() {
                return Err(e);
            }
            // A rank that left cannot arrive any more.
            if let Some((rank, why)) =
                (0..world).find_map(|r| (!st.present[r]).then(|| st.departed[r].clone().map(|w| (r, w))).flatten())
            {
                drop(st);
                return Err(self.fail(rank, why));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..world).filter(|&r| !st.present[r]).collect();
                drop(st);
                let seconds = self.shared.timeout.as_secs_f64();
                self.fail(missing[0], format!("did not reach {} within {seconds:.1}s", call.op));
                return Err(CommError::Timeout { op: call.op, missing, seconds, me: self.rank });
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let reason = if std::thread::panicking() { "panicked" } else { "left the group" };
        let mut st = self.lock();
        st.departed[self.rank] = Some(reason.to_string());
        self.shared.cv.notify_all();
    }
}

fn sum_in_rank_order(slots: &[Vec<f64>]) -> Vec<f64> {
    let mut out = slots[0].clone();
    for s in &slots[1..] {
        out.iter_mut().zip(s).for_each(|(o, x)| *o += x);
    }
    out
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        self.counters.bytes_sent += 4 * buf.len() as u64;
        let r = self.collective(
            Call { op: "all_reduce", len: buf.len(), root: 0 },
            buf.iter().map(|&x| x as f64).collect(),
            sum_in_rank_order,
        )?;
        buf.iter_mut().zip(r.iter()).for_each(|(b, &x)| *b = x as f32);
        Ok(())
    }

    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CommError> {
        self.counters.bytes_sent += 8 * buf.len() as u64;
        let r =
            self.collective(Call { op: "all_reduce_f64", len: buf.len(), root: 0 }, buf.to_vec(), sum_in_rank_order)?;
        buf.copy_from_slice(&r);
        Ok(())
    }

    fn reduce_scatter_sum(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        check_blocks("reduce_scatter", input.len(), output.len(), self.shared.world)?;
        self.counters.bytes_sent += 4 * input.len() as u64;
        let r = self.collective(
            Call { op: "reduce_scatter", len: input.len(), root: 0 },
            input.iter().map(|&x| x as f64).collect(),
            sum_in_rank_order,
        )?;
        let n = output.len();
        output.iter_mut().zip(&r[self.rank * n..(self.rank + 1) * n]).for_each(|(o, &x)| *o = x as f32);
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        check_blocks("all_gather", output.len(), input.len(), self.shared.world)?;
        self.counters.bytes_sent += 4 * input.len() as u64;
        let r = self.collective(
            Call { op: "all_gather", len: input.len(), root: 0 },
            input.iter().map(|&x| x as f64).collect(),
            |s| s.concat(),
        )?;
        output.iter_mut().zip(r.iter()).for_each(|(o, &x)| *o = x as f32);
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        check_rank("broadcast", "root", root, self.shared.world)?;
        let mine: Vec<f64> = if self.rank == root {
            self.counters.bytes_sent += 4 * buf.len() as u64;
            buf.iter().map(|&x| x as f64).collect()
        } else {
            Vec::new()
        };
        let r = self.collective(Call { op: "broadcast", len: buf.len(), root }, mine, move |s| s[root].clone())?;
        buf.iter_mut().zip(r.iter()).for_each(|(b, &x)| *b = x as f32);
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.collective(Call { op: "barrier", len: 0, root: 0 }, Vec::new(), |_| Vec::new()).map(|_| ())
    }

    fn counters(&self) -> CommCounters {
        self.counters
    }

    fn buffer_bytes(&self) -> usize {
        // This rank's slot keeps the capacity of the largest contribution (f64).
        8 * self.lock().slots[self.rank].capacity()
    }

    fn abort(&mut self, reason: &str) {
        self.shared.hub.raise(self.shared.members[self.rank], reason.to_string());
    }

    fn send(&mut self, buf: &[f32], dest: usize, tag: u32) -> Result<(), CommError> {
        check_rank("send", "destination", dest, self.shared.world)?;
        let mut st = lock(&self.shared.state);
        if let Some(e) = self.failed() {
            return Err(e);
        }
        self.counters.count_send(buf.len());
        st.mail.entry((self.rank, dest, tag)).or_default().push_back(buf.to_vec());
        self.shared.cv.notify_all();
        Ok(())
    }

    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u32) -> Result<(), CommError> {
        check_rank("recv", "source", src, self.shared.world)?;
        let key = (src, self.rank, tag);
        let deadline = Instant::now() + self.shared.timeout;
        let mut st = self.lock();
        loop {
            if let Some(e) = self.failed() {
                return Err(e);
            }
            if let Some(queue) = st.mail.get_mut(&key) {
                let msg = queue.pop_front();
                if queue.is_empty() {
                    st.mail.remove(&key);
                }
                if let Some(msg) = msg {
                    drop(st);
                    if msg.len() != buf.len() {
                        return Err(recv_length_error(src, tag, msg.len(), buf.len()));
                    }
                    buf.copy_from_slice(&msg);
                    return Ok(());
                }
            }
            if src == self.rank {
                return Err(CommError::NothingToReceive { tag, me: self.rank });
            }
            // A rank that left sends nothing more.
            if let Some(why) = st.departed[src].clone() {
                drop(st);
                return Err(self.fail(src, format!("{why} without sending under tag {tag}")));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                let seconds = self.shared.timeout.as_secs_f64();
                self.fail(src, format!("sent nothing under tag {tag} within {seconds:.1}s"));
                return Err(CommError::Timeout { op: "recv", missing: vec![src], seconds, me: self.rank });
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn split(&mut self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError> {
        Ok(Box::new(self.split_handle(color, key)?))
    }

    fn duplicate(&mut self) -> Result<Box<dyn Communicator + Send>, CommError> {
        // One color, keyed by rank: the same members in the same order, a new group.
        let rank = self.rank;
        Ok(Box::new(self.split_handle(0, rank)?))
    }
}

impl ThreadComm {
    /// [`Communicator::split`]'s new handle.
    fn split_handle(&mut self, color: usize, key: usize) -> Result<ThreadComm, CommError> {
        let words = [to_words(color), to_words(key)].concat();
        let all = self.collective(Call { op: "split", len: words.len(), root: 0 }, words, |s| s.concat())?;
        let pairs: Vec<(usize, usize)> = all.chunks(4).map(|w| (from_words(&w[..2]), from_words(&w[2..]))).collect();
        let index = self.n_splits;
        self.n_splits += 1;
        let mut st = self.lock();
        let handles = st.parked.entry(index).or_insert_with(|| self.shared.split_groups(&pairs));
        let mine = handles[self.rank].take().expect("a split hands each rank one handle, taken once");
        if handles.iter().all(Option::is_none) {
            st.parked.remove(&index);
        }
        Ok(mine)
    }
}

#[cfg(test)]
mod tests;
