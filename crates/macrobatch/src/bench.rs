//! `macrobatch bench`: steady-state speed of the configured training step.
//!
//! Warm-up steps, then measured optimizer steps; ms/step (median, min, max),
//! tokens/s, achieved GFLOP/s and MFU, the share of a step spent outside the
//! model's forward/backward (engine overhead), and for K ∈ {1, 2, 4, 8} at a
//! fixed global batch the step time relative to K = 1. With
//! `dist.tensor_parallel = T` (and `dist.world_size = T`) the T thread
//! ranks that split the model are measured together, and the model's
//! tensor-parallel all-reduces (time, bytes, calls per step) are reported.

use crate::dist::Backend;
use crate::planning::plan;
use crate::ranks::run_thread_ranks;
use crate::setup::{load_config, model_for_rank, rank_batches, scratch_offload_root, Initial, Plan, RankComms};
use crate::train::start::{init_from, Handoff};
use crate::BenchArgs;
use anyhow::{anyhow, bail, Context, Result};
use comm::Communicator;
use data::{BatchShape, Sampler};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Interleaved rounds of the K sweep.
const K_SWEEP_ROUNDS: usize = 5;

/// A core's peak f32 FLOP per cycle and the micro-architecture it was taken for.
#[derive(Debug, Clone, PartialEq, Serialize)]
struct CorePeak {
    flop_per_cycle: f64,
    /// How it was chosen (vendor, family/model, the FMA width).
    basis: String,
}

/// The f32 FLOP per cycle and core of the FMA pipes the CPU issues to, from
/// /proc/cpuinfo's vendor, family, model and flags (FMA = 2 FLOP per lane):
/// - AVX-512 with two 512-bit FMA pipes (Intel server cores from
///   Skylake-SP, AMD Zen 5 desktop and server): 64;
/// - AVX-512 on 256-bit datapaths (AMD Zen 4, Zen 5 mobile) or with one
///   512-bit pipe (Intel client cores: Ice Lake, Tiger Lake, Rocket Lake):
///   32;
/// - AVX2 + FMA with two 256-bit pipes (Haswell on, Zen 2 and 3): 32; Zen 1
///   (two 128-bit pipes): 16;
/// - without FMA: 16 with AVX (an add and a mul pipe of 8 lanes), 8 with SSE.
fn core_peak(vendor: &str, family: u32, model: u32, flags: &[&str]) -> CorePeak {
    let has = |f: &str| flags.contains(&f);
    let amd = vendor == "AuthenticAMD";
    let (flop, what) = if has("avx512f") {
        match (amd, family) {
            (true, 0x19) => (32.0, "AMD Zen 4: AVX-512 on two 256-bit FMA pipes"),
            (true, 0x1a) if matches!(model, 0x20..=0x2f | 0x60..=0x6f) => {
                (32.0, "AMD Zen 5 mobile: AVX-512 on 256-bit datapaths")
            }
            (true, _) => (64.0, "AMD Zen 5: two 512-bit FMA pipes"),
            // Intel client cores with AVX-512: one 512-bit FMA pipe.
            (false, 6) if matches!(model, 0x66 | 0x7d | 0x7e | 0x8c | 0x8d | 0xa7) => {
                (32.0, "Intel client core: one 512-bit FMA pipe")
            }
            (false, _) => (64.0, "Intel server core: two 512-bit FMA pipes"),
        }
    } else if has("avx2") && has("fma") {
        match (amd, family) {
            (true, 0x17) if model < 0x30 => (16.0, "AMD Zen 1: two 128-bit FMA pipes"),
            _ => (32.0, "AVX2: two 256-bit FMA pipes"),
        }
    } else if has("avx") {
        (16.0, "AVX without FMA: a 256-bit add and a 256-bit mul pipe")
    } else {
        (8.0, "SSE: a 128-bit add and a 128-bit mul pipe")
    };
    let vendor = if vendor.is_empty() { "unknown vendor" } else { vendor };
    CorePeak { flop_per_cycle: flop, basis: format!("{what} ({vendor} family {family:#x} model {model:#x})") }
}

/// [`core_peak`] of this machine's first CPU, and its clock in MHz.
fn this_core_peak() -> (CorePeak, f64) {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| {
        text.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
            .and_then(|l| l.split_once(':'))
            .map_or("", |(_, v)| v.trim())
    };
    let num = |key: &str| field(key).parse::<u32>().unwrap_or(0);
    let flags: Vec<&str> = field("flags").split_whitespace().collect();
    let mhz = field("cpu MHz").parse::<f64>().unwrap_or(0.0);
    (core_peak(field("vendor_id"), num("cpu family"), num("model"), &flags), mhz)
}

#[derive(Debug, Serialize)]
struct Timing {
    micro: usize,
    accumulation_steps: usize,
    ms_median: f64,
    ms_min: f64,
    ms_max: f64,
    /// Mean over the measured steps (what the kernel-family profile, a
    /// sum over those steps, is a share of).
    ms_mean: f64,
    tokens_per_s: f64,
    gflops: f64,
    /// Share of the step outside the model's micro-steps, in percent.
    overhead_pct: f64,
    /// Bytes of activations saved for backward.
    saved_activation_bytes: usize,
    /// Bytes of all activation and scratch buffers.
    activation_bytes: usize,
    /// Bytes of the parameter copy the model reads.
    param_copy_bytes: usize,
    /// With `dist.tensor_parallel = T`: rank 0's all-reduces inside the model.
    #[serde(skip_serializing_if = "Option::is_none")]
    tensor_parallel: Option<TensorTraffic>,
    /// Every step's loss, warm-up first: the steps `train` runs from the
    /// same config (and `--init-from`), bit for bit.
    losses: Vec<f64>,
}

/// A step's tensor-parallel all-reduces on rank 0 (the same on every rank
/// of the group, up to waiting).
#[derive(Debug, Clone, Copy, Serialize)]
struct TensorTraffic {
    /// Median milliseconds per step spent in them (waiting included).
    ms_median: f64,
    /// Bytes contributed per step.
    bytes: u64,
    /// All-reduce calls per step.
    calls: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    preset: String,
    n_params: usize,
    threads: usize,
    seq_len: usize,
    global_batch: usize,
    flops_per_step: f64,
    step: Timing,
    peak_nominal_gflops: f64,
    /// The per-core FLOP/cycle behind `peak_nominal_gflops`, and why.
    core_peak: CorePeak,
    mfu_nominal_pct: f64,
    gemm_peak_gflops: f64,
    mfu_gemm_pct: f64,
    k_sweep: Vec<(usize, f64)>,
    /// Where the measured steps' time went, by kernel family (per rank),
    /// largest first; `other` is the rest of the step (the engine's
    /// bookkeeping, the model's copies and glue, the batch's assembly).
    profile: Vec<ProfileRow>,
    /// Per K: the least and greatest of the per-round ratios (each round
    /// times every K back to back, so a round's ratio shares its noise).
    k_sweep_spread: Vec<(usize, f64, f64)>,
    precision: String,
    /// Peak resident set (VmHWM) after the measured steps, before the GEMM
    /// table's and the K sweep's buffers.
    peak_rss_bytes: Option<u64>,
    /// Every pool-wide GEMM shape of the measured step.
    gemm: Vec<GemmRow>,
}

/// One GEMM shape of the step: the backend it ran on and how fast, next to
/// every backend this build and CPU offer on the same shape.
#[derive(Debug, Serialize)]
struct GemmRow {
    /// `m×k×n`, `ᵀ` marking a transposed operand.
    shape: String,
    backend: String,
    calls_per_step: f64,
    /// GFLOP/s of its calls in the measured steps.
    gflops: f64,
    /// Share of the step's time.
    step_pct: f64,
    /// GFLOP/s of each candidate measured on the shape after the run.
    candidates: Vec<(String, f64)>,
    /// The best of `candidates`.
    best_gflops: f64,
    /// How the backend was chosen: `final` (cached, agreed by
    /// `agreed` processes), `kept` / `replaced` (a provisional cache entry
    /// re-checked by this run's probe), `probed` (nothing cached),
    /// `bucket` (another shape of its size bucket was probed for it),
    /// `forced` (`MACROBATCH_GEMM`) or `bf16`.
    choice: String,
    /// Processes that agreed on the backend (0: forced or bf16).
    agreed: u32,
}

/// How a shape's backend was chosen (see [`GemmRow::choice`]).
fn choice(st: &linalg::ShapeStats) -> &'static str {
    match (st.backend, st.rechecked, st.probe.is_empty()) {
        (Some(linalg::Backend::Bf16), _, _) => "bf16",
        (b, Some(r), false) if b == Some(r) => "kept",
        (_, Some(_), false) => "replaced",
        (_, None, false) => "probed",
        _ if st.shared => "bucket",
        _ if st.agreed == 0 => "forced",
        _ => "final",
    }
}

/// One kernel family's share of the measured steps.
#[derive(Debug, Serialize)]
struct ProfileRow {
    kind: &'static str,
    ms_per_step: f64,
    step_pct: f64,
    calls_per_step: f64,
}

/// The profile counters of `steps` measured steps of `step_ms` each (their
/// mean), on
/// `ranks` ranks, as rows (largest first) and the rest as `other`.
fn profile_rows(steps: usize, step_ms: f64, ranks: usize) -> Vec<ProfileRow> {
    let per = (steps * ranks.max(1)) as f64;
    let mut rows: Vec<ProfileRow> = engine::profile::snapshot()
        .into_iter()
        .filter(|(_, _, calls)| *calls > 0)
        .map(|(k, secs, calls)| ProfileRow {
            kind: k.name(),
            ms_per_step: secs * 1e3 / per,
            step_pct: 100.0 * secs * 1e3 / per / step_ms,
            calls_per_step: calls as f64 / per,
        })
        .collect();
    rows.sort_by(|a, b| b.ms_per_step.total_cmp(&a.ms_per_step));
    let counted: f64 = rows.iter().map(|r| r.ms_per_step).sum();
    let rest = (step_ms - counted).max(0.0);
    rows.push(ProfileRow { kind: "other", ms_per_step: rest, step_pct: 100.0 * rest / step_ms, calls_per_step: 0.0 });
    rows
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Times `steps` optimizer steps after `warmup`, with the batch factored
/// as `shape`: on one rank, or with `dist.tensor_parallel = T` on the T
/// thread ranks that split the model (rank 0's timing).
fn time_steps(
    plan: &Arc<Plan>,
    shape: BatchShape,
    (warmup, steps): (usize, usize),
    initial: Option<Arc<Handoff<Vec<f32>>>>,
) -> Result<Timing> {
    match plan.backend {
        Backend::Threads(world) => {
            let timing = Arc::new(Mutex::new(None));
            let (plan, out) = (plan.clone(), timing.clone());
            let timeout = Duration::from_secs_f64(plan.cfg.dist.timeout_s);
            run_thread_ranks(world, timeout, move |c| {
                let t = time_rank(&plan, shape, (warmup, steps), initial.as_deref(), c)?;
                if c.rank() == 0 {
                    *out.lock().map_err(|_| anyhow!("rank 0's timing was lost"))? = Some(t);
                }
                Ok(())
            })?;
            let t = timing.lock().map_err(|_| anyhow!("rank 0's timing was lost"))?.take();
            t.context("rank 0 measured nothing")
        }
        Backend::Single | Backend::Mpi(_) => {
            time_rank(plan, shape, (warmup, steps), initial.as_deref(), &mut comm::SingleProcess::new())
        }
    }
}

/// [`time_steps`] on the rank of `comm`.
fn time_rank(
    plan: &Plan,
    shape: BatchShape,
    (warmup, steps): (usize, usize),
    initial: Option<&Handoff<Vec<f32>>>,
    comm: &mut dyn Communicator,
) -> Result<Timing> {
    let cfg = &plan.cfg;
    let sampler = Sampler::new(plan.train.n_samples(), shape, cfg.data.shuffle, cfg.data.drop_last, cfg.train.seed)?
        .with_mixture(plan.sampler.mixture().cloned());
    let rank = comm.rank();
    let mut model = model_for_rank(plan, plan.grid.tp_rank(rank))?;
    let mut comms = RankComms::new(plan, &mut model, comm)?;
    // Taken once by each rank and released by the last: not held through
    // the measured steps (their peak RSS is train's).
    let initial = initial.and_then(Handoff::take);
    let params = initial.as_deref().map_or(Initial::Fresh, |p| Initial::Params(p));
    let mut trainer = comms.trainer(plan, &model, params, &scratch_offload_root())?;
    drop(initial);
    let (mut ms, mut overhead, mut tp_ms, mut losses) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut tp = None;
    for i in 0..warmup + steps {
        let (epoch, s) = sampler.position(i as u64);
        let order = sampler.epoch_order(epoch);
        if i == warmup && rank == 0 {
            linalg::backend::reset_counts();
            engine::profile::reset();
        }
        let t0 = Instant::now();
        let batches = rank_batches(plan, &sampler, &order, s, comms.data_rank())?;
        let report = comms.step(&mut trainer, &mut model, &batches)?;
        let total = t0.elapsed().as_secs_f64();
        losses.push(report.loss);
        if i >= warmup {
            ms.push(total * 1e3);
            overhead.push(100.0 * (1.0 - report.model_s / total));
            if let Some(t) = report.tensor {
                tp_ms.push(t.seconds * 1e3);
                tp = Some(TensorTraffic { ms_median: 0.0, bytes: t.bytes, calls: t.calls });
            }
        }
    }
    let tokens = (shape.global() * plan.train.seq_len()) as f64;
    let mean = ms.iter().sum::<f64>() / ms.len().max(1) as f64;
    let med = median(&mut ms);
    let mem = trainer.memory();
    drop(trainer);
    crate::setup::remove_scratch_offload_root();
    let flops = plan.family.flops_per_token(plan.train.seq_len()) * tokens;
    Ok(Timing {
        micro: shape.micro,
        accumulation_steps: shape.accumulation_steps,
        ms_median: med,
        ms_mean: mean,
        ms_min: ms[0],
        ms_max: ms[ms.len() - 1],
        tokens_per_s: tokens / (med / 1e3),
        gflops: flops / (med / 1e3) / 1e9,
        overhead_pct: median(&mut overhead),
        losses,
        saved_activation_bytes: model.saved_activation_bytes(),
        activation_bytes: model.activation_bytes(),
        param_copy_bytes: mem.params,
        tensor_parallel: tp.map(|t| TensorTraffic { ms_median: median(&mut tp_ms), ..t }),
    })
}

/// Nominal f32 peak: threads × the core's FLOP/cycle ([`core_peak`]) × the
/// clock /proc/cpuinfo reports.
fn nominal_peak_gflops(threads: usize) -> (f64, CorePeak) {
    let (core, mhz) = this_core_peak();
    (threads as f64 * core.flop_per_cycle * mhz / 1e3, core)
}

/// The best rate of our GEMM on a large square problem (1024³, the best f32
/// backend of this build): the practical roofline.
fn gemm_peak_gflops(bf16: bool) -> f64 {
    let threads = rayon::current_num_threads();
    // A bf16 run's GEMMs run on the bf16 kernel (AMX tiles or vdpbf16ps)
    // where there is one: its rate is the ceiling, not f32's.
    let bf16 = bf16 && linalg::bf16::supported();
    let key = linalg::Key { m: 1024, n: 1024, k: 1024, lhs_t: false, rhs_t: false, threads, bf16 };
    let candidates = if bf16 { vec![linalg::Backend::Bf16] } else { linalg::Backend::f32_candidates() };
    candidates.into_iter().filter_map(|b| linalg::backend::measure(&key, b, 7)).fold(0.0, f64::max)
}

/// The GEMM shapes of the last `steps` measured steps of `step_ms` each:
/// backend, rate, and every candidate's rate on the same shape.
fn gemm_table(steps: usize, step_ms: f64) -> Vec<GemmRow> {
    use linalg::Backend;
    let mut rows = Vec::new();
    for (key, st) in linalg::backend::stats() {
        let Some(backend) = st.backend.filter(|_| st.calls > 0) else { continue };
        let mut cands: Vec<Backend> = Backend::f32_candidates();
        if backend == Backend::Bf16 {
            cands.insert(0, Backend::Bf16);
        }
        let reps = if key.flops() > 5e10 { 1 } else { 3 };
        let candidates: Vec<(String, f64)> = cands
            .into_iter()
            .filter_map(|b| Some((b.name().to_string(), linalg::backend::measure(&key, b, reps)?)))
            .collect();
        let best_gflops = candidates.iter().map(|c| c.1).fold(0.0, f64::max);
        rows.push(GemmRow {
            shape: key.label(),
            backend: backend.name().to_string(),
            calls_per_step: st.calls as f64 / steps as f64,
            gflops: st.gflops(&key),
            step_pct: 100.0 * st.seconds / (steps as f64 * step_ms / 1e3),
            candidates,
            best_gflops,
            choice: choice(&st).to_string(),
            agreed: st.agreed,
        });
    }
    rows.sort_by(|a, b| b.step_pct.total_cmp(&a.step_pct));
    rows
}

/// `macrobatch bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if args.steps == 0 {
        bail!("--steps 0: bench needs at least one measured step (e.g. --steps 10)");
    }
    let mut cfg = load_config(args.config.as_deref(), &args.set, &args.deepspeed)?;
    let (world, t) = (cfg.dist.world_size, cfg.dist.tensor_parallel);
    let (p, c) = (cfg.dist.pipeline_parallel, cfg.dist.context_parallel);
    if p != 1 || c != 1 {
        let (key, what) = if p != 1 { ("pipeline", "run pipelines") } else { ("context", "split sequences") };
        bail!("bench measures one rank, or the ranks splitting the model's tensors; it does not {what}: set dist.{key}_parallel = 1");
    }
    if world != 1 && world != t {
        bail!("bench measures one rank, or the dist.tensor_parallel = {t} ranks splitting the model's tensors; set dist.world_size = {t}");
    }
    let backend = if world > 1 { Backend::Threads(world) } else { Backend::Single };
    // Before anything runs on the pool: packing a frozen base already does.
    if cfg.train.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.train.threads)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let ranks = if let Backend::Threads(w) = backend { w } else { 1 };
    let initial = init_from(args.init_from.as_deref(), &args.set, &mut cfg, false)?.map(|p| Handoff::new(p, ranks));
    let plan = Arc::new(plan(cfg, backend)?);
    crate::planning::check_memory(&plan)?;
    let threads = rayon::current_num_threads();
    let b = plan.batch;
    let shape = BatchShape { micro: b.micro, accumulation_steps: b.accumulation_steps, world_size: 1 };
    engine::profile::set_enabled(true);
    let step = time_steps(&plan, shape, (args.warmup, args.steps), initial)?;
    engine::profile::set_enabled(false);
    let profile = profile_rows(args.steps, step.ms_mean, t);
    // Before the GEMM table and the K sweep allocate their own buffers.
    let peak_rss_bytes = crate::memory::peak_rss_bytes();
    let gemm = gemm_table(args.steps, step.ms_median);
    let (mut k_sweep, mut k_sweep_spread) = (Vec::new(), Vec::new());
    if !args.no_k_sweep {
        // Rounds interleave the factorizations so that each sees the same
        // machine noise; the ratio is of the medians over rounds.
        let ks: Vec<usize> = [1usize, 2, 4, 8].into_iter().filter(|k| b.global % k == 0).collect();
        let mut ms: Vec<Vec<f64>> = vec![Vec::new(); ks.len()];
        for _ in 0..K_SWEEP_ROUNDS {
            for (i, &k) in ks.iter().enumerate() {
                let shape = BatchShape { micro: b.global / k, accumulation_steps: k, world_size: 1 };
                ms[i].push(time_steps(&plan, shape, (args.warmup, args.steps), None)?.ms_median);
            }
        }
        let base = median(&mut ms[0].clone());
        for (i, &k) in ks.iter().enumerate() {
            let per_round: Vec<f64> = ms[i].iter().zip(&ms[0]).map(|(a, b)| a / b).collect();
            let (lo, hi) = per_round.iter().fold((f64::INFINITY, 0.0f64), |(l, h), &r| (l.min(r), h.max(r)));
            k_sweep_spread.push((k, lo, hi));
            k_sweep.push((k, median(&mut ms[i]) / base));
        }
    }
    let (peak, core) = nominal_peak_gflops(threads);
    let gemm_peak = gemm_peak_gflops(plan.cfg.train.precision == engine::Precision::Bf16);
    let report = Report {
        preset: plan.cfg.model.label(),
        n_params: plan.family.n_params() as usize,
        threads,
        seq_len: plan.train.seq_len(),
        global_batch: b.global,
        flops_per_step: plan.family.flops_per_token(plan.train.seq_len()) * (b.global * plan.train.seq_len()) as f64,
        mfu_nominal_pct: 100.0 * step.gflops / peak.max(f64::MIN_POSITIVE),
        mfu_gemm_pct: 100.0 * step.gflops / gemm_peak,
        step,
        peak_nominal_gflops: peak,
        core_peak: core,
        gemm_peak_gflops: gemm_peak,
        k_sweep,
        profile,
        k_sweep_spread,
        precision: plan.cfg.train.precision.to_string(),
        peak_rss_bytes,
        gemm,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let s = &report.step;
    println!(
        "bench: {} {} ({}), seq {}, global batch {} = micro {} × K {}, {} threads ({}), {} measured steps after {} warm-up",
        plan.family.name(),
        report.preset,
        crate::family::params_label(&*plan.family),
        report.seq_len,
        report.global_batch,
        s.micro,
        s.accumulation_steps,
        threads,
        linalg::vector_isa(),
        args.steps,
        args.warmup
    );
    println!("  ms/step       median {:.1}, min {:.1}, max {:.1}", s.ms_median, s.ms_min, s.ms_max);
    println!("  tokens/s      {:.0}", s.tokens_per_s);
    println!(
        "  GFLOP/s       {:.1} ({:.2} GFLOP/step: 6N + 12·L·C·T per token)",
        s.gflops,
        report.flops_per_step / 1e9
    );
    println!(
        "  MFU           {:.1}% of the nominal peak {:.0} GFLOP/s (threads × {} f32 FLOP/cycle — {} — × /proc/cpuinfo clock); {:.1}% of our GEMM's best {:.0} GFLOP/s",
        report.mfu_nominal_pct,
        report.peak_nominal_gflops,
        report.core_peak.flop_per_cycle,
        report.core_peak.basis,
        report.mfu_gemm_pct,
        report.gemm_peak_gflops
    );
    println!("  overhead      {:.2}% of a step outside the model's forward/backward", s.overhead_pct);
    if let Some(tp) = &s.tensor_parallel {
        println!(
            "  tensor ∥      T = {}: all-reduces {:.2} ms/step ({:.1}% of the step), {:.2} MB/step per rank in {} calls",
            plan.grid.tensor,
            tp.ms_median,
            100.0 * tp.ms_median / s.ms_median,
            tp.bytes as f64 / 1e6,
            tp.calls
        );
    }
    println!(
        "  memory        {}: saved activations {:.1} MB, all activation buffers {:.1} MB, parameter copy {:.1} MB, peak RSS {:.0} MB",
        report.precision,
        s.saved_activation_bytes as f64 / 1e6,
        s.activation_bytes as f64 / 1e6,
        s.param_copy_bytes as f64 / 1e6,
        report.peak_rss_bytes.unwrap_or(0) as f64 / 1e6
    );
    if !report.profile.is_empty() {
        println!("  where the step's time goes (by kernel family; per rank; `other`: engine, copies, batch assembly):");
        for p in &report.profile {
            let calls =
                if p.calls_per_step > 0.0 { format!("{:>6.0} calls/step", p.calls_per_step) } else { String::new() };
            println!("    {:<15} {:>8.2} ms/step {:>5.1}%  {calls}", p.kind, p.ms_per_step, p.step_pct);
        }
    }
    if !report.gemm.is_empty() {
        println!("  GEMM shapes (m×k×n, ᵀ = transposed operand), by share of the step; the backend's choice (final: cached and agreed by N runs; kept / replaced: a provisional entry re-checked now; probed: new); candidates measured on the same shape after the run:");
        for g in &report.gemm {
            let cands: Vec<String> = g.candidates.iter().map(|(n, r)| format!("{n} {r:.0}")).collect();
            println!(
                "    {:<20} {:>5.1}/step {:>5.1}% of step  {:<6} {:<8} ({} run{}) {:>6.0} GFLOP/s = {:>3.0}% of best {:.0}  [{}]",
                g.shape,
                g.calls_per_step,
                g.step_pct,
                g.backend,
                g.choice,
                g.agreed,
                if g.agreed == 1 { "" } else { "s" },
                g.gflops,
                100.0 * g.gflops / g.best_gflops.max(f64::MIN_POSITIVE),
                g.best_gflops,
                cands.join(", ")
            );
        }
    }
    if !report.k_sweep.is_empty() {
        println!("  K sweep ({K_SWEEP_ROUNDS} interleaved rounds; the median of the rounds, and the least and greatest round):");
    }
    for ((k, ratio), (_, lo, hi)) in report.k_sweep.iter().zip(&report.k_sweep_spread) {
        let verdict = if *k == 1 {
            ""
        } else if *lo <= 1.0 && 1.0 <= *hi {
            "  (rounds straddle 1: not distinguishable from K = 1 here)"
        } else {
            ""
        };
        println!(
            "  K = {k:<2}        micro {:<4} step time {:.3}× K = 1 (rounds {:.3}–{:.3}×){verdict}",
            report.global_batch / k,
            ratio,
            lo,
            hi
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nominal_peak_follows_the_micro_architecture() {
        let avx512 = ["avx", "avx2", "fma", "avx512f"];
        let avx2 = ["avx", "avx2", "fma"];
        for (vendor, family, model, flags, want) in [
            ("AuthenticAMD", 0x19, 0x11, &avx512[..], 32.0), // Zen 4 (Genoa)
            ("AuthenticAMD", 0x19, 0x61, &avx512[..], 32.0), // Zen 4 (Raphael)
            ("AuthenticAMD", 0x19, 0x01, &avx2[..], 32.0),   // Zen 3 (Milan)
            ("AuthenticAMD", 0x1a, 0x02, &avx512[..], 64.0), // Zen 5 (Turin)
            ("AuthenticAMD", 0x1a, 0x24, &avx512[..], 32.0), // Zen 5 mobile (Strix Point)
            ("AuthenticAMD", 0x17, 0x01, &avx2[..], 16.0),   // Zen 1 (Naples)
            ("GenuineIntel", 6, 0x55, &avx512[..], 64.0),    // Skylake-SP
            ("GenuineIntel", 6, 0x8f, &avx512[..], 64.0),    // Sapphire Rapids
            ("GenuineIntel", 6, 0x8c, &avx512[..], 32.0),    // Tiger Lake (client)
            ("GenuineIntel", 6, 0x7e, &avx512[..], 32.0),    // Ice Lake (client)
            ("GenuineIntel", 6, 0x97, &avx2[..], 32.0),      // Alder Lake
            ("GenuineIntel", 6, 0x2a, &["avx"][..], 16.0),   // Sandy Bridge
        ] {
            let p = core_peak(vendor, family, model, flags);
            assert_eq!(p.flop_per_cycle, want, "{vendor} {family:#x} {model:#x}: {}", p.basis);
            assert!(p.basis.contains(&format!("{model:#x}")), "{}", p.basis);
        }
        let (here, _) = this_core_peak();
        assert!([8.0, 16.0, 32.0, 64.0].contains(&here.flop_per_cycle), "{here:?}");
    }
}
