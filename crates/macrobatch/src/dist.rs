//! Who the ranks are: single process, threads of this process, or MPI
//! processes; and the fault injection used by the failure tests.

use anyhow::{bail, Context, Result};
use comm::launcher::launcher_world_size;
use comm::{CommCounters, CommError, Communicator};
use engine::ScheduleKind;
use std::ops::DerefMut;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
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

    /// Where the world size comes from, for error messages.
    pub fn world_source(self) -> &'static str {
        match self {
            Backend::Single | Backend::Threads(_) => "dist.world_size",
            Backend::Mpi(_) => "the MPI launcher's process count",
        }
    }
}

/// How the world's ranks divide into pipeline stages, data-parallel ranks,
/// context-parallel ranks and tensor-parallel ranks (Megatron-LM's order:
/// pipeline outer, tensor innermost): rank r = stage · (D · C · T) + d ·
/// (C · T) + c · T + t, so the T ranks that split one replica's tensors are
/// neighbours, the C ranks splitting its sequences T apart, the D ranks
/// holding the same part of the model C · T apart and the P stages of one
/// pipeline D · C · T apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grid {
    /// Pipeline stages P (1: no pipeline).
    pub stages: usize,
    /// Tensor-parallel ranks T (1: no split).
    pub tensor: usize,
    /// The vocabulary split over the T ranks too (`dist.vocab_parallel`).
    pub vocab: bool,
    /// The residual stream's rows split over the T ranks (`dist.sequence_parallel`).
    pub seq: bool,
    /// Context-parallel ranks C (1: whole sequences).
    pub context: usize,
    /// How attention reaches the other context ranks' keys and values.
    pub context_attention: engine::ContextAttention,
    /// Data-parallel ranks D (= world / (P · C · T)).
    pub data: usize,
    /// The layers (blocks) each stage runs.
    pub cuts: Vec<Range<usize>>,
    /// The schedule every stage follows.
    pub schedule: ScheduleKind,
}

impl Grid {
    /// The grid of `dist` for a world of `world` ranks (`source`: where
    /// that number comes from) and a model of `n_layers` layers: P · T must
    /// divide the world and every stage needs a layer.
    pub fn new(dist: &config::DistConfig, world: usize, source: &str, n_layers: usize) -> Result<Self> {
        let data = dist.data_parallel(world, source)?;
        let cuts =
            engine::pipeline::partition_layers(n_layers, dist.pipeline_parallel, dist.pipeline_layers.as_deref())?;
        Ok(Self {
            stages: dist.pipeline_parallel,
            tensor: dist.tensor_parallel,
            vocab: dist.vocab_parallel,
            seq: dist.sequence_parallel,
            context: dist.context_parallel,
            context_attention: dist.context_attention,
            data,
            cuts,
            schedule: dist.pipeline_schedule,
        })
    }

    /// Whether the model is cut into more than one stage.
    pub fn is_pipeline(&self) -> bool {
        self.stages > 1
    }

    /// Whether tensors are split over more than one rank.
    pub fn is_tensor_parallel(&self) -> bool {
        self.tensor > 1
    }

    /// Whether a rank holds less than the whole model (a stage, a tensor
    /// slice or both): it then trains through the staged path.
    pub fn is_split(&self) -> bool {
        self.is_pipeline() || self.is_tensor_parallel() || self.context > 1
    }

    /// The stage of world rank `rank`.
    pub fn stage_of(&self, rank: usize) -> usize {
        rank / (self.data * self.context * self.tensor)
    }

    /// The data-parallel rank (which micro-batches it trains on) of world rank `rank`.
    pub fn data_rank_of(&self, rank: usize) -> usize {
        (rank / (self.context * self.tensor)) % self.data
    }

    /// The context-parallel rank (which positions of each sequence it runs) of world rank `rank`.
    pub fn context_rank_of(&self, rank: usize) -> usize {
        (rank / self.tensor) % self.context
    }

    /// The tensor-parallel rank (which slices it holds) of world rank `rank`.
    pub fn tensor_rank_of(&self, rank: usize) -> usize {
        rank % self.tensor
    }

    /// The tensor-parallel place of world rank `rank`: which slices its model holds.
    pub fn tp_rank(&self, rank: usize) -> engine::TpRank {
        engine::TpRank::new(self.tensor_rank_of(rank), self.tensor).with_vocab(self.vocab).with_seq(self.seq)
    }

    /// One line for the run header, e.g. `pipeline: P=2 (1f1b, layers 0-1 |
    /// 2-3), data parallel D=2; rank r = stage·2 + data`, or with a tensor
    /// split `3D: P=2 × T=2 × D=2; rank r = stage·4 + data·2 + tensor;
    /// pipeline 1f1b, layers 0-1 | 2-3`.
    pub fn describe(&self) -> String {
        let cuts: Vec<String> = self
            .cuts
            .iter()
            .map(|r| if r.len() == 1 { format!("{}", r.start) } else { format!("{}-{}", r.start, r.end - 1) })
            .collect();
        let (p, t, d) = (self.stages, self.tensor, self.data);
        if self.context > 1 {
            let c = self.context;
            let vocab = match (self.vocab && t > 1, self.seq && t > 1) {
                (true, true) => ", the vocabulary and the sequence split",
                (true, false) => ", the vocabulary split",
                (false, true) => ", the sequence split",
                (false, false) => "",
            };
            let attention = match self.context_attention {
                engine::ContextAttention::Ring => "keys and values around a ring",
                engine::ContextAttention::AllGather => "keys and values all-gathered",
            };
            return format!(
                "context parallel: C={c} (two chunks of each sequence per rank, {attention}) × P={p} × T={t}{vocab} × D={d}; rank r = stage·{} + data·{} + context·{t} + tensor; pipeline {}, layers {}",
                d * c * t,
                c * t,
                self.schedule,
                cuts.join(" | ")
            );
        }
        if t == 1 {
            return format!(
                "pipeline: P={p} ({}, layers {}), data parallel D={d}; rank r = stage·{d} + data",
                self.schedule,
                cuts.join(" | ")
            );
        }
        let data = if d > 1 { format!("data·{t} + ") } else { String::new() };
        let vocab = match (self.vocab, self.seq) {
            (true, true) => " (the vocabulary and the sequence split too)",
            (true, false) => " (the vocabulary split too)",
            (false, true) => " (the sequence split too)",
            (false, false) => "",
        };
        if p == 1 {
            return format!("tensor parallel: T={t}{vocab} × D={d}; rank r = {data}tensor");
        }
        format!(
            "3D: P={p} × T={t}{vocab} × D={d}; rank r = stage·{} + {data}tensor; pipeline {}, layers {}",
            d * t,
            self.schedule,
            cuts.join(" | ")
        )
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
pub fn mpi_comm(timeout: Duration, threaded: bool) -> Result<Box<dyn comm::Communicator>> {
    let comm = if threaded { comm_mpi::MpiComm::init_threaded(timeout) } else { comm_mpi::MpiComm::init(timeout) };
    Ok(Box::new(comm.context("cannot start MPI")?))
}

/// Without the feature there is no MPI to connect to ([`detect`] refuses first).
#[cfg(not(feature = "mpi"))]
pub fn mpi_comm(_timeout: Duration, _threaded: bool) -> Result<Box<dyn comm::Communicator>> {
    bail!("macrobatch was built without the `mpi` feature")
}

/// A failure injected for tests: `MACROBATCH_FAULT=rank=R,step=S,kind=K`
/// with K one of `panic`, `error`, `stall`, `kill` (fire at the start of
/// optimizer step S, 1-based, on rank R), `enospc` (from the start of step S
/// the disk is full after `bytes=N` more bytes), `slow_checkpoint` (the
/// checkpoint of step S takes `secs=X` longer), `nan` (the parameters saved
/// at step S hold a NaN), `oom` (step S allocates `bytes=N` more bytes than
/// the memory limit lets it: the out-of-memory report), `slow_load` (loading
/// the model takes `secs=X` longer, announced on stderr once the signal
/// handlers are in place). `phase=checkpoint` moves a panic, error, stall or
/// kill from the start of step S into its checkpoint's gather (a step with
/// a checkpoint due), `phase=save` into the final save's gather (S unused),
/// `phase=collective` (panic, stall or kill) into step S's first gradient
/// collective (an f32 all-reduce or reduce-scatter: the boundary's, after
/// the micro-steps, at ZeRO 0–2; at ZeRO-3 the first layer's in the last
/// backward), which the other ranks have entered ([`FaultyComm`]).
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    rank: usize,
    step: u64,
    kind: FaultKind,
    phase: FaultPhase,
    bytes: u64,
    secs: f64,
}

/// Where in a step a fault fires.
#[derive(Debug, Clone, Copy, PartialEq)]
enum FaultPhase {
    /// The start of the optimizer step, before its micro-steps.
    Step,
    /// The gather of the step's checkpoint.
    Checkpoint,
    /// The gather of the final save.
    Save,
    /// The step's first gradient collective.
    Collective,
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
    SlowLoad,
}

impl Fault {
    /// Reads `MACROBATCH_FAULT`, if set.
    pub fn from_env() -> Result<Option<Self>> {
        let Ok(spec) = std::env::var("MACROBATCH_FAULT") else { return Ok(None) };
        let mut f = Fault { rank: 0, step: 1, kind: FaultKind::Panic, phase: FaultPhase::Step, bytes: 0, secs: 0.0 };
        for part in spec.split(',') {
            let (k, v) =
                part.split_once('=').with_context(|| format!("MACROBATCH_FAULT: `{part}` is not key=value"))?;
            match k.trim() {
                "rank" => f.rank = v.trim().parse().context("MACROBATCH_FAULT rank")?,
                "step" => f.step = v.trim().parse().context("MACROBATCH_FAULT step")?,
                "bytes" => f.bytes = v.trim().parse().context("MACROBATCH_FAULT bytes")?,
                "secs" => f.secs = v.trim().parse().context("MACROBATCH_FAULT secs")?,
                "phase" => {
                    f.phase = match v.trim() {
                        "step" => FaultPhase::Step,
                        "checkpoint" => FaultPhase::Checkpoint,
                        "save" => FaultPhase::Save,
                        "collective" => FaultPhase::Collective,
                        other => bail!("MACROBATCH_FAULT phase `{other}`: use step, checkpoint, save or collective"),
                    }
                }
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
                        "slow_load" => FaultKind::SlowLoad,
                        other => bail!(
                            "MACROBATCH_FAULT kind `{other}`: use panic, error, stall, kill, enospc, slow_checkpoint, nan, oom or slow_load"
                        ),
                    }
                }
                other => bail!("MACROBATCH_FAULT: unknown key `{other}`"),
            }
        }
        if f.phase == FaultPhase::Collective && !matches!(f.kind, FaultKind::Panic | FaultKind::Stall | FaultKind::Kill)
        {
            bail!("MACROBATCH_FAULT phase=collective takes kind panic, stall or kill");
        }
        Ok(Some(f))
    }

    /// Whether this fault fires inside a collective (wrap the rank's
    /// communicator in a [`FaultyComm`]).
    pub fn in_collective(&self) -> bool {
        self.phase == FaultPhase::Collective
    }

    /// Fires if this is the chosen rank and step (at the step's start); with
    /// `phase=collective`, arms the [`FaultyComm`] instead.
    pub fn maybe_fire(&self, rank: usize, step: u64) -> Result<()> {
        if rank != self.rank || step != self.step {
            return Ok(());
        }
        match self.phase {
            FaultPhase::Step => self.fire(rank, step),
            FaultPhase::Collective => {
                COLLECTIVE_ARMED.store(true, Ordering::SeqCst);
                Ok(())
            }
            FaultPhase::Checkpoint | FaultPhase::Save => Ok(()),
        }
    }

    /// Fires if this is the chosen rank and step, in the gather of the
    /// step's checkpoint.
    pub fn maybe_fire_in_checkpoint(&self, rank: usize, step: u64) -> Result<()> {
        if rank != self.rank || step != self.step || self.phase != FaultPhase::Checkpoint {
            return Ok(());
        }
        self.fire(rank, step)
    }

    /// Fires if this is the chosen rank, in the gather of the final save
    /// after step `step`.
    pub fn maybe_fire_in_final_save(&self, rank: usize, step: u64) -> Result<()> {
        if rank != self.rank || self.phase != FaultPhase::Save {
            return Ok(());
        }
        self.fire(rank, step)
    }

    fn fire(&self, rank: usize, step: u64) -> Result<()> {
        match self.kind {
            FaultKind::Enospc => nn::io::set_write_budget(Some(self.bytes)),
            FaultKind::SlowCheckpoint | FaultKind::Nan | FaultKind::SlowLoad => {}
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

    /// Extra time loading the model takes (before the first step).
    pub fn load_delay(&self) -> Option<Duration> {
        (self.kind == FaultKind::SlowLoad).then(|| Duration::from_secs_f64(self.secs))
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

/// Set at the start of the faulty step on the faulty rank; the next
/// gradient collective of a [`FaultyComm`] takes it and fires.
static COLLECTIVE_ARMED: AtomicBool = AtomicBool::new(false);

/// A rank's communicator with a `phase=collective` fault: every call goes
/// to `inner`, except that once armed ([`Fault::maybe_fire`]) the next f32
/// all-reduce or reduce-scatter fires the fault instead (the groups split
/// from it are wrapped too). Only built when such a fault is set.
pub struct FaultyComm<C> {
    inner: C,
    fault: Fault,
    /// This rank's place in the world (a split group numbers it anew).
    world_rank: usize,
}

impl<C: DerefMut<Target = D>, D: Communicator + ?Sized> FaultyComm<C> {
    /// `inner`, the world's communicator, with `fault`'s collective phase.
    pub fn new(inner: C, fault: Fault) -> Self {
        let world_rank = inner.rank();
        Self { inner, fault, world_rank }
    }

    fn gradient_collective(&self) {
        // Thread ranks share the flag: only the faulty rank takes it.
        if self.world_rank == self.fault.rank && COLLECTIVE_ARMED.swap(false, Ordering::SeqCst) {
            let (rank, step) = (self.world_rank, self.fault.step);
            eprintln!("injected fault: rank {rank} in step {step}'s gradient collective");
            // panic, stall and kill only (from_env checks): fire never returns.
            let _ = self.fault.fire(rank, step);
        }
    }
}

impl<C: DerefMut<Target = D>, D: Communicator + ?Sized> Communicator for FaultyComm<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        self.gradient_collective();
        self.inner.all_reduce_sum(buf)
    }
    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CommError> {
        self.inner.all_reduce_sum_f64(buf)
    }
    fn reduce_scatter_sum(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.gradient_collective();
        self.inner.reduce_scatter_sum(input, output)
    }
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.inner.all_gather(input, output)
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.inner.broadcast(buf, root)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn counters(&self) -> CommCounters {
        self.inner.counters()
    }
    fn abort(&mut self, reason: &str) {
        self.inner.abort(reason)
    }
    fn buffer_bytes(&self) -> usize {
        self.inner.buffer_bytes()
    }
    fn send(&mut self, buf: &[f32], dest: usize, tag: u32) -> Result<(), CommError> {
        self.inner.send(buf, dest, tag)
    }
    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u32) -> Result<(), CommError> {
        self.inner.recv(buf, src, tag)
    }
    fn flush_sends(&mut self) -> Result<(), CommError> {
        self.inner.flush_sends()
    }
    fn split(&mut self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError> {
        let inner = self.inner.split(color, key)?;
        Ok(Box::new(FaultyComm { inner, fault: self.fault, world_rank: self.world_rank }))
    }
    fn duplicate(&mut self) -> Result<Box<dyn Communicator + Send>, CommError> {
        let inner = self.inner.duplicate()?;
        Ok(Box::new(FaultyComm { inner, fault: self.fault, world_rank: self.world_rank }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_stage_major_and_the_header_names_the_cut() {
        let mut dist = config::DistConfig { pipeline_parallel: 2, ..Default::default() };
        let g = Grid::new(&dist, 4, "dist.world_size", 5).unwrap();
        assert_eq!(g.cuts, vec![0..3, 3..5]);
        let place: Vec<(usize, usize)> = (0..4).map(|r| (g.stage_of(r), g.data_rank_of(r))).collect();
        assert_eq!(place, [(0, 0), (0, 1), (1, 0), (1, 1)]);
        assert_eq!(g.describe(), "pipeline: P=2 (1f1b, layers 0-2 | 3-4), data parallel D=2; rank r = stage·2 + data");
        dist.pipeline_parallel = 4;
        let e = Grid::new(&dist, 4, "dist.world_size", 2).unwrap_err().to_string();
        assert!(e.contains("4 stages") && e.contains("2 layers"), "{e}");
        let e = Grid::new(&dist, 6, "dist.world_size", 8).unwrap_err().to_string();
        assert!(e.contains("dist.pipeline_parallel = 4") && e.contains("world size 6"), "{e}");
        dist.pipeline_layers = Some(vec![1, 1, 1, 1]);
        let e = Grid::new(&dist, 4, "dist.world_size", 8).unwrap_err().to_string();
        assert!(e.contains("dist.pipeline_layers") && e.contains("8 layers"), "{e}");
    }

    #[test]
    fn ranks_are_stage_major_tensor_innermost_and_the_header_says_so() {
        let dist = config::DistConfig { pipeline_parallel: 2, tensor_parallel: 2, ..Default::default() };
        let g = Grid::new(&dist, 8, "dist.world_size", 4).unwrap();
        assert_eq!((g.stages, g.tensor, g.data), (2, 2, 2));
        let place: Vec<(usize, usize, usize)> =
            (0..8).map(|r| (g.stage_of(r), g.data_rank_of(r), g.tensor_rank_of(r))).collect();
        let want: Vec<(usize, usize, usize)> =
            (0..2).flat_map(|s| (0..2).flat_map(move |d| (0..2).map(move |t| (s, d, t)))).collect();
        assert_eq!(place, want, "r = s·4 + d·2 + t");
        assert_eq!(
            g.describe(),
            "3D: P=2 × T=2 × D=2; rank r = stage·4 + data·2 + tensor; pipeline 1f1b, layers 0-1 | 2-3"
        );
        assert!(g.is_split() && g.is_pipeline() && g.is_tensor_parallel());
        let dist = config::DistConfig { tensor_parallel: 2, ..Default::default() };
        let g = Grid::new(&dist, 4, "dist.world_size", 4).unwrap();
        assert_eq!(g.describe(), "tensor parallel: T=2 × D=2; rank r = data·2 + tensor");
        assert!(g.is_split() && !g.is_pipeline());
        let g = Grid::new(&dist, 2, "dist.world_size", 4).unwrap();
        assert_eq!(g.describe(), "tensor parallel: T=2 × D=1; rank r = tensor");
        let e = Grid::new(&dist, 3, "dist.world_size", 4).unwrap_err().to_string();
        assert!(e.contains("dist.tensor_parallel = 2") && e.contains("world size 3"), "{e}");
    }
}
