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

    /// Runs one collective: deposit, wait for all, return the combined result.
    fn collective(
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
        Ok(Box::new(mine))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(ThreadComm) -> T + Sync,
    ) -> Vec<std::thread::Result<T>> {
        let comms = group(world, timeout);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
            handles.into_iter().map(|h| h.join()).collect()
        })
    }

    #[test]
    fn collectives_compute_the_right_values() {
        let out = run(3, Duration::from_secs(10), |mut c| {
            let r = c.rank() as f32;
            let mut a = vec![r, 1.0];
            c.all_reduce_sum(&mut a).unwrap();
            let mut rs = vec![0.0; 2];
            c.reduce_scatter_sum(&[r, r, 1.0, 1.0, 2.0 * r, 0.0], &mut rs).unwrap();
            let mut ag = vec![0.0; 3];
            c.all_gather(&[r * 10.0], &mut ag).unwrap();
            let mut b = vec![r; 2];
            c.broadcast(&mut b, 2).unwrap();
            let mut d = vec![0.1f64 * c.rank() as f64];
            c.all_reduce_sum_f64(&mut d).unwrap();
            c.barrier().unwrap();
            (a, rs, ag, b, d, c.counters().n_calls)
        });
        for (rank, o) in out.into_iter().enumerate() {
            let (a, rs, ag, b, d, n) = o.unwrap();
            assert_eq!(a, vec![3.0, 3.0]);
            let want_rs = [vec![3.0, 3.0], vec![3.0, 3.0], vec![6.0, 0.0]][rank].clone();
            assert_eq!(rs, want_rs, "rank {rank}");
            assert_eq!(ag, vec![0.0, 10.0, 20.0]);
            assert_eq!(b, vec![2.0, 2.0]);
            assert!((d[0] - 0.3).abs() < 1e-15);
            assert_eq!(n, 6);
        }
    }

    #[test]
    fn a_panicking_rank_is_named_and_nobody_hangs() {
        let t0 = Instant::now();
        let out = run(3, Duration::from_secs(30), |mut c| {
            if c.rank() == 1 {
                panic!("injected failure");
            }
            let mut a = vec![1.0];
            c.all_reduce_sum(&mut a)
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "failure must be noticed without waiting for the timeout");
        assert!(out[1].is_err());
        for r in [0, 2] {
            let e = out[r].as_ref().unwrap().as_ref().unwrap_err();
            assert!(matches!(e, CommError::RankFailed { rank: 1, .. }), "{e}");
            assert!(e.to_string().contains("rank 1 failed (panicked)"), "{e}");
        }
    }

    #[test]
    fn a_stalled_rank_is_named_after_the_timeout() {
        let t0 = Instant::now();
        let out = run(2, Duration::from_millis(300), |mut c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(2));
                return Ok(());
            }
            c.barrier()
        });
        let e = out[0].as_ref().unwrap().as_ref().unwrap_err().clone();
        assert!(matches!(e, CommError::Timeout { ref missing, .. } if missing == &vec![1]), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn mismatched_calls_are_errors() {
        let out = run(2, Duration::from_secs(5), |mut c| {
            let mut a = vec![0.0; 1 + c.rank()];
            c.all_reduce_sum(&mut a)
        });
        assert!(out.iter().any(|o| matches!(o, Ok(Err(CommError::Mismatch { .. })))));
        assert!(out.iter().all(|o| matches!(o, Ok(Err(_)))));
    }

    #[test]
    fn messages_arrive_in_order_per_tag_and_crossed_sends_do_not_deadlock() {
        let out = run(2, Duration::from_secs(10), |mut c| {
            let (me, peer) = (c.rank(), 1 - c.rank());
            // Both ranks send everything before receiving anything.
            for i in 0..3 {
                c.send(&[me as f32, i as f32], peer, 7)?;
            }
            c.send(&[10.0 + me as f32], peer, 9)?;
            // The later tag first: tags are independent queues.
            let mut b9 = [0.0];
            c.recv(&mut b9, peer, 9)?;
            let mut got = Vec::new();
            for _ in 0..3 {
                let mut b = [0.0; 2];
                c.recv(&mut b, peer, 7)?;
                got.push(b);
            }
            // Ping-pong: rank 0 serves, rank 1 returns the value plus one.
            let mut x = [0.0f32];
            for _ in 0..20 {
                if me == 0 {
                    c.send(&x, 1, 3)?;
                    c.recv(&mut x, 1, 3)?;
                } else {
                    c.recv(&mut x, 0, 3)?;
                    x[0] += 1.0;
                    c.send(&x, 0, 3)?;
                }
            }
            Ok::<_, CommError>((b9, got, x))
        });
        for (me, o) in out.into_iter().enumerate() {
            let (b9, got, x) = o.unwrap().unwrap();
            let peer = (1 - me) as f32;
            assert_eq!(b9, [10.0 + peer]);
            assert_eq!(got, vec![[peer, 0.0], [peer, 1.0], [peer, 2.0]], "rank {me}");
            assert_eq!(x, [20.0], "rank {me}");
        }
    }

    #[test]
    fn a_receive_of_the_wrong_length_names_both_lengths() {
        let out = run(2, Duration::from_secs(10), |mut c| {
            if c.rank() == 0 {
                c.send(&[1.0, 2.0, 3.0], 1, 0)?;
                c.send(&[4.0, 5.0], 1, 0)?;
                return Ok(None);
            }
            let mut short = [0.0; 2];
            let e = c.recv(&mut short, 0, 0).unwrap_err();
            // The mismatched message is consumed; the next one is received.
            c.recv(&mut short, 0, 0)?;
            Ok::<_, CommError>(Some((e, short)))
        });
        let (e, next) = out[1].as_ref().unwrap().as_ref().unwrap().clone().unwrap();
        assert!(matches!(e, CommError::BadLength { op: "recv", .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("sent 3 elements") && msg.contains("holds 2"), "{msg}");
        assert_eq!(next, [4.0, 5.0]);
    }

    #[test]
    fn a_departed_source_fails_a_receive_promptly() {
        let t0 = Instant::now();
        let out = run(2, Duration::from_secs(30), |mut c| {
            if c.rank() == 1 {
                // One message, then the rank leaves without the second.
                return c.send(&[5.0], 0, 1).map(|_| [0.0]);
            }
            let mut b = [0.0];
            c.recv(&mut b, 1, 1)?;
            assert_eq!(b, [5.0], "a message sent before leaving is still delivered");
            c.recv(&mut b, 1, 1).map(|_| b)
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
        let e = out[0].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(e, CommError::RankFailed { rank: 1, me: 0, .. }), "{e}");
        assert!(e.to_string().contains("left the group"), "{e}");
    }

    #[test]
    fn a_stalled_source_is_named_after_the_timeout() {
        let out = run(2, Duration::from_millis(300), |mut c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(1));
                return Ok(());
            }
            c.recv(&mut [0.0], 1, 4)
        });
        let e = out[0].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(e, CommError::Timeout { op: "recv", missing, .. } if missing == &vec![1]), "{e}");
    }

    #[test]
    fn receiving_from_itself_takes_its_own_messages_and_never_waits() {
        let mut c = group(1, Duration::from_secs(30)).pop().unwrap();
        c.send(&[1.0, 2.0], 0, 5).unwrap();
        let mut b = [0.0; 2];
        c.recv(&mut b, 0, 5).unwrap();
        assert_eq!(b, [1.0, 2.0]);
        let t0 = Instant::now();
        assert_eq!(c.recv(&mut b, 0, 5), Err(CommError::NothingToReceive { tag: 5, me: 0 }));
        assert!(t0.elapsed() < Duration::from_secs(1));
        assert!(matches!(c.send(&b, 1, 5), Err(CommError::BadLength { op: "send", .. })));
    }

    #[test]
    fn sends_count_as_point_to_point_not_as_collectives() {
        let out = run(2, Duration::from_secs(10), |mut c| {
            let peer = 1 - c.rank();
            c.all_reduce_sum(&mut [1.0; 4])?;
            let before = c.counters();
            c.send(&[0.0; 5], peer, 0)?;
            c.send(&[0.0; 3], peer, 1)?;
            c.recv(&mut [0.0; 5], peer, 0)?;
            c.recv(&mut [0.0; 3], peer, 1)?;
            Ok::<_, CommError>((before, c.counters()))
        });
        for o in out {
            let (before, after) = o.unwrap().unwrap();
            assert_eq!((before.n_calls, before.bytes_sent, before.p2p_messages), (1, 16, 0));
            assert_eq!(after, CommCounters { p2p_messages: 2, p2p_bytes_sent: 32, ..before });
        }
    }

    #[test]
    fn split_groups_reduce_over_their_members_only_ordered_by_key() {
        let out = run(4, Duration::from_secs(10), |mut c| {
            let me = c.rank();
            // Colors {0, 2} and {1, 3}; keys reverse the order within each.
            let mut sub = c.split(me % 2, 10 - me)?;
            let mut a = [me as f32];
            sub.all_reduce_sum(&mut a)?;
            // Point-to-point inside the sub-group uses its ranks.
            let peer = 1 - sub.rank();
            sub.send(&[100.0 + me as f32], peer, 0)?;
            let mut b = [0.0];
            sub.recv(&mut b, peer, 0)?;
            // A second split: the whole group under one color, ranked as here.
            let mut all = c.split(0, 0)?;
            let mut s = [1.0];
            all.all_reduce_sum(&mut s)?;
            Ok::<_, CommError>((sub.rank(), sub.world_size(), a, b, all.rank(), s))
        });
        let got: Vec<_> = out.into_iter().map(|o| o.unwrap().unwrap()).collect();
        assert_eq!(got[0], (1, 2, [2.0], [102.0], 0, [4.0]));
        assert_eq!(got[1], (1, 2, [4.0], [103.0], 1, [4.0]));
        assert_eq!(got[2], (0, 2, [2.0], [100.0], 2, [4.0]));
        assert_eq!(got[3], (0, 2, [4.0], [101.0], 3, [4.0]));
    }

    /// Rank 3 leaves after the split. Rank 2 waits for it in their sub-group's
    /// all-reduce and rank 0 in a receive from it; rank 1 waits in a receive
    /// from rank 0 of its sub-group, which stays alive after its error and so
    /// can only be noticed through the failure shared by all groups.
    #[test]
    fn a_departed_rank_fails_sub_group_collectives_and_receives_promptly() {
        let out = run(4, Duration::from_secs(60), |mut c| {
            let me = c.rank();
            let mut sub = c.split(me / 2, 0)?;
            let t0 = Instant::now();
            let r = match me {
                3 => return Ok((Duration::ZERO, Ok(()))),
                2 => sub.all_reduce_sum(&mut [1.0]),
                0 => c.recv(&mut [0.0], 3, 0),
                _ => sub.recv(&mut [0.0], 0, 0),
            };
            let waited = t0.elapsed();
            if me == 0 {
                std::thread::sleep(Duration::from_secs(3));
            }
            Ok::<_, CommError>((waited, r))
        });
        for (me, o) in out.into_iter().enumerate().take(3) {
            let (waited, r) = o.unwrap().unwrap();
            let e = r.unwrap_err();
            assert!(waited < Duration::from_secs(2), "rank {me} waited {waited:?}: {e}");
            assert!(matches!(e, CommError::RankFailed { .. }), "rank {me}: {e}");
            assert!(e.to_string().contains("left the group"), "rank {me}: {e}");
        }
    }

    #[test]
    fn an_abort_in_a_sub_group_stops_the_world() {
        let t0 = Instant::now();
        let out = run(4, Duration::from_secs(60), |mut c| {
            let me = c.rank();
            let mut sub = c.split(me / 2, 0)?;
            if me == 3 {
                sub.abort("injected");
                std::thread::sleep(Duration::from_secs(3));
                return Ok(());
            }
            c.barrier()
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
        for o in &out[..3] {
            let e = o.as_ref().unwrap().as_ref().unwrap_err();
            assert!(matches!(e, CommError::RankFailed { rank: 3, .. }), "{e}");
            assert!(e.to_string().contains("injected"), "{e}");
        }
    }
}
