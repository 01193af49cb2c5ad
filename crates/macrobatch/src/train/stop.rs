//! Stopping before `train.steps`: `--stop-after N` and SIGINT / SIGTERM,
//! agreed on by every rank so that all stop after the same step, with a
//! checkpoint to continue from.

use super::Outcome;
use anyhow::{Context, Result};
use comm::Communicator;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// How soon after the first signal a second one is taken for a repeat of
/// it (ignored) rather than a request to exit at once.
pub const REPEAT_MS: u64 = 1000;

/// When the first signal arrived (`now_ms`).
static FIRST_SIGNAL_MS: AtomicU64 = AtomicU64::new(0);

/// Milliseconds on the monotonic clock (async-signal-safe).
fn now_ms() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given; it is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64).saturating_mul(1000).saturating_add(t.tv_nsec as u64 / 1_000_000)
}

/// What asks a run to stop early, and whether it did.
#[derive(Clone)]
pub struct StopRequests {
    /// `--stop-after`: stop after this many steps of this invocation.
    pub after: Option<u64>,
    /// Set by SIGINT / SIGTERM.
    pub signalled: Arc<AtomicBool>,
    /// The number of the signal that asked to stop (0: none).
    pub signal: Arc<AtomicUsize>,
    /// Set when the ranks stopped before `train.steps` (signal or --stop-after).
    pub stopped_early: Arc<AtomicBool>,
}

impl StopRequests {
    /// `--stop-after` and handlers for SIGINT / SIGTERM. The first signal
    /// asks every rank to stop after the step in progress, with a
    /// checkpoint. A repeat within [`REPEAT_MS`] of it (a double Ctrl-C, or a
    /// process manager signalling the whole group) changes nothing; a second
    /// signal later ends the process at once, saying on stderr that the
    /// steps since the last checkpoint are lost.
    pub fn install(after: Option<u64>) -> Result<Self> {
        let signalled = Arc::new(AtomicBool::new(false));
        let signal = Arc::new(AtomicUsize::new(0));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            let first = signalled.clone();
            let action = move || {
                // Async-signal-safe only: atomics, clock_gettime, write, _exit.
                let now = now_ms();
                if !first.load(Ordering::SeqCst) {
                    FIRST_SIGNAL_MS.store(now, Ordering::SeqCst);
                } else if now.saturating_sub(FIRST_SIGNAL_MS.load(Ordering::SeqCst)) >= REPEAT_MS {
                    let msg = b"\nerror: a second signal: exiting now, without a checkpoint of the steps since the last one (train --resume continues from that one)\n";
                    // SAFETY: write(2) on stderr with a valid buffer is async-signal-safe.
                    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
                    signal_hook::low_level::exit(128 + sig);
                }
            };
            // SAFETY: the action only touches atomics and async-signal-safe calls.
            unsafe { signal_hook::low_level::register(sig, action) }.context("cannot install signal handler")?;
            signal_hook::flag::register_usize(sig, signal.clone(), sig as usize)
                .context("cannot install signal handler")?;
            signal_hook::flag::register(sig, signalled.clone()).context("cannot install signal handler")?;
        }
        Ok(Self { after, signalled, signal, stopped_early: Arc::new(AtomicBool::new(false)) })
    }

    /// Whether every rank stops after this step, `steps_done` steps into
    /// this invocation: any rank's request counts (a collective when there
    /// are several ranks). Once agreed, the run is marked stopped early.
    pub fn agree(&self, comm: &mut dyn Communicator, steps_done: u64) -> Result<bool> {
        let mut stop = self.signalled.load(Ordering::SeqCst) as u8 as f64;
        if self.after.is_some_and(|n| steps_done >= n) {
            stop = 1.0;
        }
        if comm.world_size() > 1 {
            let mut v = [stop];
            comm.all_reduce_sum_f64(&mut v)?;
            stop = v[0];
        }
        let stop = stop > 0.0;
        if stop {
            // Agreed by every rank; an error later still wins over this.
            self.stopped_early.store(true, Ordering::SeqCst);
        }
        Ok(stop)
    }

    /// Tells the user the run stopped after `step` with `checkpoint` written,
    /// and how to continue it from `run_dir`.
    pub fn announce(&self, step: u64, checkpoint: &Path, run_dir: &Path) {
        let signal = self.signal.load(Ordering::SeqCst);
        let how = if signal != 0 { format!(" (signal {signal}: exit code {})", 128 + signal) } else { String::new() };
        eprintln!(
            "stopped after step {step}{how}; checkpoint {} written. Continue with: macrobatch train --resume {}",
            checkpoint.display(),
            run_dir.display()
        );
    }

    /// How the invocation ended, once every rank returned without error.
    pub fn outcome(&self) -> Outcome {
        match (self.stopped_early.load(Ordering::SeqCst), self.signal.load(Ordering::SeqCst)) {
            (false, _) => Outcome::Finished,
            (true, 0) => Outcome::StoppedAfter,
            (true, n) => Outcome::Signalled(n as i32),
        }
    }
}
