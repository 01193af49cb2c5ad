//! How the ranks of a run work together: thread ranks started and their
//! outcomes gathered, and rank-0-only work that the other ranks wait for
//! without tripping their timeout.

use anyhow::{anyhow, bail, Result};
use comm::Communicator;
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Runs `f(rank, comm)` on `world` thread ranks and gathers their outcomes.
/// A rank that panics or stalls does not hang the caller: the others fail
/// through their communicator, and stragglers get a short grace period.
pub fn run_thread_ranks<F>(world: usize, timeout: Duration, f: F) -> Result<()>
where
    F: Fn(&mut comm::threads::ThreadComm) -> Result<()> + Send + Sync + 'static,
{
    /// Sends the rank's outcome when the thread ends, also by panic.
    struct Outcome {
        rank: usize,
        tx: mpsc::Sender<(usize, Result<()>)>,
        result: Option<Result<()>>,
    }
    impl Drop for Outcome {
        fn drop(&mut self) {
            let r = self.result.take().unwrap_or_else(|| Err(anyhow!("rank {} panicked", self.rank)));
            let _ = self.tx.send((self.rank, r));
        }
    }
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for mut c in comm::threads::group(world, timeout) {
        let (f, tx) = (f.clone(), tx.clone());
        let rank = c.rank();
        std::thread::Builder::new().name(format!("rank-{rank}")).spawn(move || {
            let mut outcome = Outcome { rank, tx, result: None };
            let r = f(&mut c);
            if let Err(e) = &r {
                c.abort(&format!("{e:#}"));
            }
            drop(c);
            outcome.result = Some(r);
        })?;
    }
    drop(tx);
    let mut failures: Vec<(usize, anyhow::Error)> = Vec::new();
    let mut n_done = 0;
    while n_done < world {
        // Before any failure wait as long as training takes; after one, the
        // others stop within their timeout, so give them that plus a margin.
        let msg =
            if failures.is_empty() { rx.recv().ok() } else { rx.recv_timeout(timeout + Duration::from_secs(2)).ok() };
        let Some((rank, r)) = msg else { break };
        n_done += 1;
        if let Err(e) = r {
            failures.push((rank, e));
        }
    }
    if failures.is_empty() && n_done == world {
        return Ok(());
    }
    failures.sort_by_key(|(r, _)| *r);
    let mut msg: Vec<String> = failures.iter().map(|(r, e)| format!("rank {r}: {e:#}")).collect();
    if n_done < world {
        msg.push(format!("{} rank(s) never finished (stalled)", world - n_done));
    }
    bail!("training failed on {} of {world} ranks:\n  {}", failures.len() + (world - n_done), msg.join("\n  "))
}

/// Runs `work` on a thread of scope `s`; its result (a panic as the error
/// `panicked`) comes on the returned channel.
fn spawn_reporting<'s, T: Send + 's>(
    s: &'s std::thread::Scope<'s, '_>,
    work: impl FnOnce() -> Result<T> + Send + 's,
    panicked: &'static str,
) -> mpsc::Receiver<Result<T>> {
    let (tx, rx) = mpsc::channel();
    s.spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or_else(|_| Err(anyhow!(panicked)));
        let _ = tx.send(r);
    });
    rx
}

/// Runs every rank's own `work` (writing its share of a sharded
/// checkpoint) on a thread while the rank answers tiny all-reduces every
/// `interval` until every rank's work is done — so work of any length, and
/// ranks finishing far apart, never count against `dist.timeout_s`, while
/// a rank that dies is still noticed within it. Returns this rank's result
/// and how many ranks' work failed (the same count on every rank). Every
/// rank must call it at the same point.
pub fn all_ranks_phase<T: Send>(
    comm: &mut dyn Communicator,
    interval: Duration,
    work: impl FnOnce() -> Result<T> + Send,
) -> Result<(Result<T>, usize)> {
    std::thread::scope(|s| {
        let rx = spawn_reporting(s, work, "this rank's checkpoint writer panicked");
        let mut mine = None;
        loop {
            if mine.is_none() {
                mine = match rx.recv_timeout(interval) {
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Ok(r) => Some(r),
                    Err(mpsc::RecvTimeoutError::Disconnected) => Some(Err(anyhow!("the checkpoint writer vanished"))),
                };
            }
            let mut state = [mine.is_some() as u8 as f64, mine.as_ref().is_some_and(|r| r.is_err()) as u8 as f64];
            comm.all_reduce_sum_f64(&mut state)?;
            // Until every rank is done this rank keeps its result (and
            // answers without receiving again: its writer is gone).
            if state[0] as usize == comm.world_size() {
                let r = mine.take().unwrap_or_else(|| Err(anyhow!("this rank's result was lost")));
                return Ok((r, state[1] as usize));
            }
        }
    })
}

/// Runs `work` (rank 0's alone: writing a checkpoint) while every other rank
/// waits in tiny all-reduces that rank 0 answers every `interval` — so
/// rank-0-only work of any length never counts against the others'
/// `dist.timeout_s`, while a rank 0 that dies or stalls is still noticed
/// within it. Every rank must call it at the same point (`work` is `Some` on
/// rank 0 only).
pub fn rank0_phase<T: Send>(
    comm: &mut dyn Communicator,
    interval: Duration,
    work: Option<impl FnOnce() -> Result<T> + Send>,
) -> Result<Option<T>> {
    let Some(work) = work else {
        loop {
            let mut done = [0.0f64];
            comm.all_reduce_sum_f64(&mut done)?;
            if done[0] > 0.0 {
                return Ok(None);
            }
        }
    };
    if comm.world_size() == 1 {
        return work().map(Some);
    }
    std::thread::scope(|s| {
        let rx = spawn_reporting(s, work, "rank 0 panicked while writing a checkpoint");
        loop {
            let r = match rx.recv_timeout(interval) {
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Ok(r) => Some(r),
                Err(mpsc::RecvTimeoutError::Disconnected) => Some(Err(anyhow!("the checkpoint writer vanished"))),
            };
            let mut done = [r.is_some() as u8 as f64];
            comm.all_reduce_sum_f64(&mut done)?;
            if let Some(r) = r {
                return r.map(Some);
            }
        }
    })
}
