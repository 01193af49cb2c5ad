//! Ranks as threads of one process, sharing memory.
//!
//! Each collective: every rank deposits its contribution in its own slot; the
//! last to arrive combines the slots *in rank order* (sums in f64), so the
//! result is deterministic and identical on every rank. A rank that is
//! dropped (it returned, or panicked) marks itself departed and wakes the
//! others, who then fail with an error naming it instead of waiting forever;
//! a rank that stalls is named by the others after the timeout.

use crate::{check_blocks, CommCounters, CommError, Communicator};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
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
    /// Set once the group has failed; every later call fails the same way.
    failure: Option<(usize, String)>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group.
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    counters: CommCounters,
}

/// Creates `world` connected ranks; hand one to each thread.
pub fn group(world: usize, timeout: Duration) -> Vec<ThreadComm> {
    let state = State {
        generation: 0,
        present: vec![false; world],
        slots: vec![Vec::new(); world],
        call: None,
        result: Arc::new(Vec::new()),
        departed: vec![None; world],
        failure: None,
    };
    let shared = Arc::new(Shared { world, timeout, state: Mutex::new(state), cv: Condvar::new() });
    (0..world).map(|rank| ThreadComm { rank, shared: shared.clone(), counters: CommCounters::default() }).collect()
}

impl ThreadComm {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking rank never holds the lock across user code, so a
        // poisoned mutex still holds consistent state.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failed(&self, st: &State) -> Option<CommError> {
        st.failure.as_ref().map(|(rank, reason)| CommError::RankFailed {
            rank: *rank,
            reason: reason.clone(),
            me: self.rank,
        })
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
        if let Some(e) = self.failed(&st) {
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
                st.failure = Some((self.rank, format!("collective mismatch: {e}")));
                self.shared.cv.notify_all();
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
            if let Some(e) = self.failed(&st) {
                return Err(e);
            }
            // A rank that left cannot arrive any more.
            if let Some((rank, why)) =
                (0..world).find_map(|r| (!st.present[r]).then(|| st.departed[r].clone().map(|w| (r, w))).flatten())
            {
                st.failure = Some((rank, why));
                self.shared.cv.notify_all();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..world).filter(|&r| !st.present[r]).collect();
                let e = CommError::Timeout {
                    op: call.op,
                    missing: missing.clone(),
                    seconds: self.shared.timeout.as_secs_f64(),
                    me: self.rank,
                };
                st.failure = Some((
                    missing[0],
                    format!("did not reach {} within {:.1}s", call.op, self.shared.timeout.as_secs_f64()),
                ));
                self.shared.cv.notify_all();
                return Err(e);
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
        if root >= self.shared.world {
            return Err(CommError::BadLength {
                op: "broadcast",
                detail: format!("root {root} in a group of {}", self.shared.world),
            });
        }
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
        let mut st = self.lock();
        if st.failure.is_none() {
            st.failure = Some((self.rank, reason.to_string()));
        }
        self.shared.cv.notify_all();
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
}
