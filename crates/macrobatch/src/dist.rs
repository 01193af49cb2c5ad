//! Who the ranks are: single process, threads of this process, or MPI
//! processes; and the fault injection used by the failure tests.

use anyhow::{bail, Context, Result};
use comm::launcher::launcher_world_size;
use std::time::Duration;

/// How this run's ranks are provided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// One rank.
    Single,
    /// `n` ranks as threads of this process.
    Threads(usize),
    /// Started by an MPI launcher with `n` processes.
    Mpi(usize),
}

impl Backend {
    /// Ranks living in this process (thread ranks share it; one under MPI).
    pub fn ranks_per_process(self) -> usize {
        match self {
            Backend::Threads(n) => n,
            Backend::Single | Backend::Mpi(_) => 1,
        }
    }

    /// Ranks in the group.
    pub fn world_size(self) -> usize {
        match self {
            Backend::Single => 1,
            Backend::Threads(n) | Backend::Mpi(n) => n,
        }
    }
}

/// Picks the backend from the launcher's environment and `dist.world_size`.
pub fn detect(threads_world: usize) -> Result<Backend> {
    match launcher_world_size() {
        Some((n, var)) => {
            if !cfg!(feature = "mpi") {
                bail!(
                    "this process was started by an MPI launcher ({var}={n}) but macrobatch was built without MPI support, so each process would train alone; rebuild with `cargo build --release --features mpi`"
                );
            }
            if threads_world != 1 && threads_world != n {
                bail!("dist.world_size = {threads_world} but the MPI launcher started {n} processes; leave dist.world_size at 1 under mpirun");
            }
            Ok(Backend::Mpi(n))
        }
        None if threads_world > 1 => Ok(Backend::Threads(threads_world)),
        None => Ok(Backend::Single),
    }
}

/// Connects to MPI (feature `mpi`).
#[cfg(feature = "mpi")]
pub fn mpi_comm(timeout: Duration) -> Result<Box<dyn comm::Communicator>> {
    Ok(Box::new(comm::mpi_backend::MpiComm::init(timeout).context("cannot start MPI")?))
}

/// Without the feature there is no MPI to connect to ([`detect`] refuses first).
#[cfg(not(feature = "mpi"))]
pub fn mpi_comm(_timeout: Duration) -> Result<Box<dyn comm::Communicator>> {
    bail!("macrobatch was built without the `mpi` feature")
}

/// A failure injected for tests: `MACROBATCH_FAULT=rank=R,step=S,kind=K`
/// with K one of `panic`, `error`, `stall`, `kill` (fire at the start of
/// optimizer step S, 1-based, on rank R), `enospc` (from the start of step S
/// the disk is full after `bytes=N` more bytes), `slow_checkpoint` (the
/// checkpoint of step S takes `secs=X` longer), `nan` (the parameters saved
/// at step S hold a NaN), `oom` (step S allocates `bytes=N` more bytes than
/// the memory limit lets it: the out-of-memory report).
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    rank: usize,
    step: u64,
    kind: FaultKind,
    bytes: u64,
    secs: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum FaultKind {
    Panic,
    Error,
    Stall,
    Kill,
    Enospc,
    SlowCheckpoint,
    Nan,
    Oom,
}

impl Fault {
    /// Reads `MACROBATCH_FAULT`, if set.
    pub fn from_env() -> Result<Option<Self>> {
        let Ok(spec) = std::env::var("MACROBATCH_FAULT") else { return Ok(None) };
        let mut f = Fault { rank: 0, step: 1, kind: FaultKind::Panic, bytes: 0, secs: 0.0 };
        for part in spec.split(',') {
            let (k, v) =
                part.split_once('=').with_context(|| format!("MACROBATCH_FAULT: `{part}` is not key=value"))?;
            match k.trim() {
                "rank" => f.rank = v.trim().parse().context("MACROBATCH_FAULT rank")?,
                "step" => f.step = v.trim().parse().context("MACROBATCH_FAULT step")?,
                "bytes" => f.bytes = v.trim().parse().context("MACROBATCH_FAULT bytes")?,
                "secs" => f.secs = v.trim().parse().context("MACROBATCH_FAULT secs")?,
                "kind" => {
                    f.kind = match v.trim() {
                        "panic" => FaultKind::Panic,
                        "error" => FaultKind::Error,
                        "stall" => FaultKind::Stall,
                        "kill" => FaultKind::Kill,
                        "enospc" => FaultKind::Enospc,
                        "slow_checkpoint" => FaultKind::SlowCheckpoint,
                        "nan" => FaultKind::Nan,
                        "oom" => FaultKind::Oom,
                        other => bail!(
                            "MACROBATCH_FAULT kind `{other}`: use panic, error, stall, kill, enospc, slow_checkpoint, nan or oom"
                        ),
                    }
                }
                other => bail!("MACROBATCH_FAULT: unknown key `{other}`"),
            }
        }
        Ok(Some(f))
    }

    /// Fires if this is the chosen rank and step.
    pub fn maybe_fire(&self, rank: usize, step: u64) -> Result<()> {
        if rank != self.rank || step != self.step {
            return Ok(());
        }
        match self.kind {
            FaultKind::Enospc => gpt::hf::set_write_budget(Some(self.bytes)),
            FaultKind::SlowCheckpoint | FaultKind::Nan => {}
            FaultKind::Panic => panic!("injected fault: rank {rank} panics at step {step}"),
            FaultKind::Error => bail!("injected fault: rank {rank} fails at step {step}"),
            // An infallible allocation, as the kernels' buffers are.
            FaultKind::Oom => std::hint::black_box(vec![1u8; self.bytes as usize]).truncate(0),
            FaultKind::Stall => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            FaultKind::Kill => {
                let _ = std::process::Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
        }
        Ok(())
    }

    /// Extra time the checkpoint of `step` takes on `rank`.
    pub fn checkpoint_delay(&self, rank: usize, step: u64) -> Option<Duration> {
        (self.kind == FaultKind::SlowCheckpoint && rank == self.rank && step == self.step)
            .then(|| Duration::from_secs_f64(self.secs))
    }

    /// Whether the parameters saved at `step` get a NaN.
    pub fn poisons(&self, step: u64) -> bool {
        self.kind == FaultKind::Nan && step == self.step
    }
}
