//! Data parallelism on the thread backend: W ranks × K micro-steps equal one
//! rank × one big batch; communication only at the boundary; uneven tails
//! never hang; `overlap_comm` starts the same collectives under the backward.

use comm::threads::{group, ThreadComm};
use comm::{CommCounters, CommError, Communicator};
use data::{BatchShape, Sampler};
use engine::rng::SplitMix64;
use engine::{
    AdamW, LrSchedule, Model, Optimizer, ParamStore, Precision, Sgd, StepReport, Trainer, TrainerOptions, ZeroConfig,
};
use gpt::{init_params, Batch, Gpt, GptConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::Tapped;

const T: usize = 8;

fn cfg() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: T, vocab_size: 32 }
}

/// `n` random sequences (inputs, targets).
fn corpus(n: usize) -> Vec<(Vec<u32>, Vec<i32>)> {
    let mut rng = SplitMix64::new(9);
    (0..n)
        .map(|_| {
            let toks: Vec<u32> = (0..=T).map(|_| rng.below(32) as u32).collect();
            (toks[..T].to_vec(), toks[1..].iter().map(|&t| t as i32).collect())
        })
        .collect()
}

fn batch(seqs: &[(Vec<u32>, Vec<i32>)], idx: &[usize]) -> Batch {
    Batch {
        n_seqs: idx.len(),
        seq_len: T,
        inputs: idx.iter().flat_map(|&i| seqs[i].0.clone()).collect(),
        targets: idx.iter().flat_map(|&i| seqs[i].1.clone()).collect(),
        positions: Vec::new(),
    }
}

#[derive(Clone, Copy)]
enum Opt {
    AdamW,
    Sgd,
}

fn new_trainer(model: &impl Model, opt: Opt, zero: ZeroConfig, comm: &mut dyn Communicator) -> Trainer {
    new_trainer_in(model, opt, zero, Precision::F32, comm)
}

fn new_trainer_in(
    model: &impl Model,
    opt: Opt,
    zero: ZeroConfig,
    precision: Precision,
    comm: &mut dyn Communicator,
) -> Trainer {
    let params = init_params(&cfg(), 5);
    let n = params.len();
    let o = match opt {
        Opt::AdamW => Optimizer::AdamW(AdamW::new(n, 0.9, 0.95, 1e-8, 0.1).unwrap()),
        Opt::Sgd => Optimizer::Sgd(Sgd::new(n, 0.9, false, 0.0).unwrap()),
    };
    let lr = match opt {
        Opt::AdamW => 1e-3,
        Opt::Sgd => 0.1,
    };
    let options = TrainerOptions { grad_clip: Some(1.0), precision, ..Default::default() };
    Trainer::distributed(model, params, o, LrSchedule::constant(lr), options, zero, comm).unwrap()
}

/// Trains `n_steps` on W thread ranks; returns every rank's parameters and
/// last-step reports.
fn train(
    n_samples: usize,
    shape: BatchShape,
    drop_last: bool,
    n_steps: u64,
    opt: Opt,
) -> Vec<(Vec<f32>, Vec<engine::StepReport>)> {
    train_zero(n_samples, shape, drop_last, n_steps, opt, ZeroConfig::default(), Precision::F32)
}

/// [`train`] with a ZeRO configuration; returns every rank's full parameters.
fn train_zero(
    n_samples: usize,
    shape: BatchShape,
    drop_last: bool,
    n_steps: u64,
    opt: Opt,
    zero: ZeroConfig,
    precision: Precision,
) -> Vec<(Vec<f32>, Vec<engine::StepReport>)> {
    let trainer = |model: &Gpt, c: &mut ThreadComm| new_trainer_in(model, opt, zero, precision, c);
    train_with(n_samples, shape, (drop_last, n_steps), precision, trainer)
}

/// `n_steps` steps on W thread ranks, each with the trainer `trainer`
/// builds; every rank's full parameters and reports.
fn train_with(
    n_samples: usize,
    shape: BatchShape,
    (drop_last, n_steps): (bool, u64),
    precision: Precision,
    trainer: impl Fn(&Gpt, &mut ThreadComm) -> Trainer + Sync,
) -> Vec<(Vec<f32>, Vec<engine::StepReport>)> {
    let seqs = Arc::new(corpus(n_samples));
    let sampler = Sampler::new(n_samples, shape, false, drop_last, 0).unwrap();
    let comms = group(shape.world_size, Duration::from_secs(30));
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c: ThreadComm| {
                let (seqs, sampler, trainer) = (seqs.clone(), sampler.clone(), &trainer);
                s.spawn(move || {
                    let mut model = Gpt::with_precision(cfg(), precision).unwrap();
                    let mut tr = trainer(&model, &mut c);
                    let mut reports = Vec::new();
                    for step_idx in 0..n_steps {
                        let (epoch, s) = sampler.position(step_idx);
                        let order = sampler.epoch_order(epoch);
                        let micro: Vec<Batch> = (0..shape.accumulation_steps)
                            .map(|k| batch(&seqs, &sampler.micro_batch(&order, s, k, c.rank())))
                            .collect();
                        reports.push(tr.step(&mut model, &mut c, &micro).unwrap());
                    }
                    tr.check_params_agree(&mut c).unwrap();
                    (tr.full_params(&mut c).unwrap(), reports)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// W ∈ {1, 2, 4} × K ∈ {1, 2, 4} at G = 16 give the same parameters after 3
/// steps. Tolerance: with SGD (lr 0.1, momentum 0.9) a parameter moves by
/// lr·Σ(momentum-weighted gradients), so gradient rounding differences of
/// ~1e-7 relative (summation order) give |Δp| ≲ 1e-7 · 0.1 · 3 · 2 ≈ 1e-7;
/// we allow 1e-6 · max|p|. AdamW normalises each gradient element by its own
/// magnitude, which amplifies rounding where a gradient cancels to ≈ ε
/// (see accumulation.rs), so for AdamW we compare the losses of every step,
/// which must agree to 1e-6 relative, and the parameters to 1e-5 · max|p|.
#[test]
fn w_ranks_times_k_micro_steps_equal_one_rank() {
    for opt in [Opt::Sgd, Opt::AdamW] {
        let reference = train(64, BatchShape { micro: 16, accumulation_steps: 1, world_size: 1 }, true, 3, opt);
        let (p_ref, r_ref) = &reference[0];
        let scale = max_abs(p_ref);
        for w in [1usize, 2, 4] {
            for k in [1usize, 2, 4] {
                let shape = BatchShape { micro: 16 / (w * k), accumulation_steps: k, world_size: w };
                let ranks = train(64, shape, true, 3, opt);
                for (rank, (p, reports)) in ranks.iter().enumerate() {
                    assert_eq!(p, &ranks[0].0, "W={w} K={k}: rank {rank} differs from rank 0 (must be bit-identical)");
                    for (a, b) in reports.iter().zip(r_ref) {
                        assert!((a.loss - b.loss).abs() <= 1e-6 * b.loss, "W={w} K={k}: loss {} vs {}", a.loss, b.loss);
                    }
                }
                let d = max_diff(&ranks[0].0, p_ref);
                let tol = match opt {
                    Opt::Sgd => 1e-6 * scale,
                    Opt::AdamW => 1e-5 * scale,
                };
                eprintln!(
                    "{} W={w} K={k}: max |Δparam| {d:.2e} (tolerance {tol:.2e})",
                    if matches!(opt, Opt::Sgd) { "sgd" } else { "adamw" }
                );
                assert!(d <= tol, "W={w} K={k}: parameters differ by {d}");
            }
        }
    }
}

#[test]
fn uneven_tail_without_drop_last_completes_and_matches_one_rank() {
    // 10 samples, G = 8: step 2 holds samples 8 and 9 only, so with W = 4,
    // micro = 1, K = 2 ranks 2 and 3 have no data at all in that step.
    let shape = BatchShape { micro: 1, accumulation_steps: 2, world_size: 4 };
    let ranks = train(10, shape, false, 2, Opt::Sgd);
    let single = train(10, BatchShape { micro: 8, accumulation_steps: 1, world_size: 1 }, false, 2, Opt::Sgd);
    let (p1, r1) = &single[0];
    for (p, reports) in &ranks {
        assert_eq!(reports[1].n_targets, 2 * T as u64, "the tail step holds 2 sequences");
        assert!((reports[1].loss - r1[1].loss).abs() <= 1e-6 * r1[1].loss);
        assert!(max_diff(p, p1) <= 1e-6 * max_abs(p1), "diff {}", max_diff(p, p1));
    }
    assert_eq!(ranks[2].1[1].micro_losses.iter().filter(|l| l.is_nan()).count(), 2, "rank 2 had no data in the tail");
}

/// A communicator that counts every collective into a shared counter.
struct Counting<C> {
    inner: C,
    calls: Arc<AtomicU64>,
}

impl<C: Communicator> Communicator for Counting<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&mut self, b: &mut [f32]) -> Result<(), CommError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_reduce_sum(b)
    }
    fn all_reduce_sum_f64(&mut self, b: &mut [f64]) -> Result<(), CommError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_reduce_sum_f64(b)
    }
    fn reduce_scatter_sum(&mut self, i: &[f32], o: &mut [f32]) -> Result<(), CommError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.reduce_scatter_sum(i, o)
    }
    fn all_gather(&mut self, i: &[f32], o: &mut [f32]) -> Result<(), CommError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_gather(i, o)
    }
    fn broadcast(&mut self, b: &mut [f32], root: usize) -> Result<(), CommError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.broadcast(b, root)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.barrier()
    }
    fn counters(&self) -> CommCounters {
        self.inner.counters()
    }
    fn abort(&mut self, reason: &str) {
        self.inner.abort(reason)
    }
    fn send(&mut self, b: &[f32], dest: usize, tag: u32) -> Result<(), CommError> {
        self.inner.send(b, dest, tag)
    }
    fn recv(&mut self, b: &mut [f32], src: usize, tag: u32) -> Result<(), CommError> {
        self.inner.recv(b, src, tag)
    }
    fn flush_sends(&mut self) -> Result<(), CommError> {
        self.inner.flush_sends()
    }
    fn split(&mut self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.split(color, key)
    }
    fn duplicate(&mut self) -> Result<Box<dyn Communicator + Send>, CommError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.duplicate()
    }
}

#[test]
fn no_communication_before_the_boundary_and_bytes_independent_of_k() {
    let seqs = corpus(16);
    let mut bytes_per_k = Vec::new();
    for k in [1usize, 8] {
        let comms = group(2, Duration::from_secs(30));
        let results: Vec<(u64, u64, Vec<u64>, u64)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let seqs = &seqs;
                    s.spawn(move || {
                        let calls = Arc::new(AtomicU64::new(0));
                        let mut c = Counting { inner: c, calls: calls.clone() };
                        // Record the collective count after every micro-step: it must not move.
                        let mut seen = Vec::new();
                        let watch = calls.clone();
                        let mut model = Tapped {
                            inner: Gpt::new(cfg()).unwrap(),
                            tap: |_: &mut dyn ParamStore| {
                                seen.push(watch.load(Ordering::SeqCst));
                                Ok(())
                            },
                        };
                        let mut tr = new_trainer(&model, Opt::AdamW, ZeroConfig::default(), &mut c);
                        let m = 8 / k;
                        let micro: Vec<Batch> = (0..k)
                            .map(|i| {
                                batch(seqs, &((i * 2 + c.rank()) * m..(i * 2 + c.rank() + 1) * m).collect::<Vec<_>>())
                            })
                            .collect();
                        let before = calls.load(Ordering::SeqCst);
                        let report = tr.step(&mut model, &mut c, &micro).unwrap();
                        drop(model);
                        (report.comm_bytes, report.comm_calls, seen, before)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (bytes, calls, seen, before) in results {
            assert_eq!(seen.len(), k);
            assert!(seen.iter().all(|&n| n == before), "K={k}: a collective ran during micro-steps: {seen:?}");
            assert_eq!(calls, 2, "one statistics all-reduce and one gradient bucket");
            bytes_per_k.push(bytes);
        }
    }
    let n_params = init_params(&cfg(), 5).len() as u64;
    let n_stats = 5 + engine::AUX_STATS as u64;
    assert_eq!(
        bytes_per_k[0],
        4 * n_params + 8 * n_stats,
        "gradient + the f64 statistics (loss, counts, loss terms, model sums)"
    );
    assert!(bytes_per_k.iter().all(|&b| b == bytes_per_k[0]), "comm bytes must not depend on K: {bytes_per_k:?}");
}

/// ZeRO stages 0, 1, 2 (both reduction modes) and 3 give the same parameters
/// after 5 AdamW steps, W ∈ {2, 4}, K ∈ {1, 4}, to 1e-6 relative to max|p|.
/// The thread backend sums every collective in rank order in f64, so stages
/// differ only in how the global norm is summed (full buffer vs shards).
#[test]
fn zero_stages_give_the_same_parameters() {
    let stages = [
        ZeroConfig { stage: 0, reduce_every_micro_step: false },
        ZeroConfig { stage: 1, reduce_every_micro_step: false },
        ZeroConfig { stage: 2, reduce_every_micro_step: false },
        ZeroConfig { stage: 2, reduce_every_micro_step: true },
        ZeroConfig { stage: 3, reduce_every_micro_step: false },
    ];
    for w in [2usize, 4] {
        for k in [1usize, 4] {
            let shape = BatchShape { micro: 16 / (w * k), accumulation_steps: k, world_size: w };
            let runs: Vec<_> =
                stages.iter().map(|&z| train_zero(64, shape, true, 5, Opt::AdamW, z, Precision::F32)).collect();
            let reference = &runs[0][0].0;
            // The stages really differ: stage 3 gathers and reduce-scatters per segment.
            assert!(runs[4][0].1[0].comm_calls > 4 * runs[0][0].1[0].comm_calls);
            let scale = max_abs(reference);
            for (z, ranks) in stages.iter().zip(&runs) {
                for (rank, (p, reports)) in ranks.iter().enumerate() {
                    let d = max_diff(p, reference);
                    assert!(d <= 1e-6 * scale, "W={w} K={k} {z:?} rank {rank}: parameters differ by {d}");
                    for (a, b) in reports.iter().zip(&runs[0][0].1) {
                        assert!((a.loss - b.loss).abs() <= 1e-6 * b.loss);
                    }
                }
            }
        }
    }
}

#[test]
fn zero_memory_follows_the_partition() {
    let comms = group(4, Duration::from_secs(30));
    let reports: Vec<Vec<engine::MemoryReport>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let model = Gpt::new(cfg()).unwrap();
                    let mut out: Vec<engine::MemoryReport> = (0..4u8)
                        .map(|stage| {
                            new_trainer(
                                &model,
                                Opt::AdamW,
                                ZeroConfig { stage, reduce_every_micro_step: false },
                                &mut c,
                            )
                            .memory()
                        })
                        .collect();
                    let z = ZeroConfig { stage: 2, reduce_every_micro_step: true };
                    out.push(new_trainer(&model, Opt::AdamW, z, &mut c).memory());
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // the contract's (docs/contract.md, Memory) per-rank model states, in f32 (no separate master weights):
    // params 4Ψ, grads 4Ψ, AdamW 8Ψ bytes, Ψ = parameters, W = 4 ranks.
    let psi = init_params(&cfg(), 5).len() as f64;
    let w = 4.0;
    let within = |got: usize, want: f64| (got as f64 - want).abs() <= 0.10 * want;
    let m = &reports[0];
    assert_eq!(m[0].model_states() as f64, 16.0 * psi, "stage 0");
    assert!(within(m[1].model_states(), 8.0 * psi + 8.0 * psi / w), "stage 1: {:?}", m[1]);
    // Stage 2 accumulating locally keeps the full gradient buffer during the step.
    assert!(within(m[2].model_states(), 8.0 * psi + 8.0 * psi / w), "stage 2 (local accumulation): {:?}", m[2]);
    assert!(within(m[3].model_states(), 16.0 * psi / w), "stage 3: {:?}", m[3]);
    let n = psi as usize;
    // Stage 3: the resident parameters are 1/W of them, and the peak adds one gathered segment.
    // Stage 2 reducing every micro-step: gradients sharded too (DeepSpeed's stage 2).
    assert!(within(m[4].model_states(), 4.0 * psi + 12.0 * psi / w), "stage 2 (per micro-step): {:?}", m[4]);
    let largest_seg = Gpt::new(cfg()).unwrap().segments().iter().map(|r| r.len()).max().unwrap();
    assert!(m[3].params <= 4 * (n / 4 + 16));
    assert!(m[3].peak_param_residency <= 4 * (largest_seg + 4) + m[3].params);
}

/// Mixed precision composes with ZeRO: with bf16, stages 1–3 shard the f32
/// master weights (stages 1–2 keep a full 16-bit copy for the model, stage 3
/// rounds gathered segments), read the same rounded parameters as stage 0,
/// and so agree like the f32 runs (1e-6 · max|p|).
///
/// Reducing every micro-step (stage 3, and stage 2 in that mode) sums K ≥ 2
/// micro-steps' gradients in another order than local accumulation (the f32
/// test above covers it at K = 4); in bf16 that ulp difference is not bounded: a master weight
/// within it of a bf16 rounding boundary gives the other 16-bit copy (odds
/// ~2⁻²⁴/2⁻⁹ per parameter and step: ~0.4 of this model's 7,232 in 4 steps),
/// which moves the forward pass by 2⁻⁸ of that weight (seen with AMX's
/// sums here). So those are compared at K = 1, where their sums are stage 0's.
#[test]
fn zero_stages_with_bf16_match_stage_0_and_shard_the_master_weights() {
    let z = |stage, reduce_every_micro_step| ZeroConfig { stage, reduce_every_micro_step };
    let k2 = BatchShape { micro: 2, accumulation_steps: 2, world_size: 4 };
    let k1 = BatchShape { micro: 4, accumulation_steps: 1, world_size: 4 };
    let z0 = train_zero(64, k2, true, 4, Opt::AdamW, z(0, false), Precision::Bf16);
    let f32_run = train_zero(64, k2, true, 4, Opt::AdamW, z(0, false), Precision::F32);
    assert!(max_diff(&z0[0].0, &f32_run[0].0) > 1e-6, "bf16 really rounds");
    let z0_k1 = train_zero(64, k1, true, 4, Opt::AdamW, z(0, false), Precision::Bf16);
    for (zc, shape, reference) in
        [(z(1, false), k2, &z0), (z(2, false), k2, &z0), (z(2, true), k1, &z0_k1), (z(3, false), k1, &z0_k1)]
    {
        let run = train_zero(64, shape, true, 4, Opt::AdamW, zc, Precision::Bf16);
        for (rank, (p, _)) in run.iter().enumerate() {
            let d = max_diff(&reference[0].0, p);
            let k = shape.accumulation_steps;
            assert!(d <= 1e-6 * max_abs(&reference[0].0), "bf16 {zc:?} K={k} rank {rank} vs stage 0: {d}");
        }
    }
    // Memory: the master weights (f32) are a 1/W shard from stage 1 on.
    let comms = group(4, Duration::from_secs(30));
    let mems: Vec<engine::MemoryReport> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let model = Gpt::with_precision(cfg(), Precision::Bf16).unwrap();
                    new_trainer_in(&model, Opt::AdamW, z(1, false), Precision::Bf16, &mut c).memory()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let n = init_params(&cfg(), 5).len();
    assert_eq!(mems[0].params, 2 * n, "a full 16-bit copy for the model");
    assert!(mems[0].master <= 4 * (n / 4 + 64), "a 1/W shard of f32 master weights: {:?}", mems[0]);
}

#[test]
fn uneven_tail_under_sharding_matches_one_rank() {
    let shape = BatchShape { micro: 1, accumulation_steps: 2, world_size: 4 };
    let single = train(10, BatchShape { micro: 8, accumulation_steps: 1, world_size: 1 }, false, 2, Opt::Sgd);
    let p1 = &single[0].0;
    for z in [
        ZeroConfig { stage: 3, reduce_every_micro_step: false },
        ZeroConfig { stage: 2, reduce_every_micro_step: true },
    ] {
        let ranks = train_zero(10, shape, false, 2, Opt::Sgd, z, Precision::F32);
        for (p, reports) in &ranks {
            assert_eq!(reports[1].n_targets, 2 * T as u64);
            assert!(max_diff(p, p1) <= 1e-6 * max_abs(p1), "{z:?}: diff {}", max_diff(p, p1));
        }
    }
}

// `overlap_comm` (`TrainerOptions::overlap_comm`): the gradient collectives
// start under the last micro-step's backward, on a thread of their own, and
// the run is bit for bit the run without it. GPT-2 ties its head to the
// embedding, so its backward writes the embedding's segment first (the
// head) and last (the embedding): a segment whose first `done` is not its
// last.

/// One run's outcome on every rank: its parameters' bits and its reports.
type Ranks = Vec<(Vec<u32>, Vec<StepReport>)>;

/// `n_steps` steps of W thread ranks; `n_samples` not a multiple of the
/// global batch leaves the last step's tail ranks without data.
fn run_overlap(
    shape: BatchShape,
    n_samples: usize,
    zero: ZeroConfig,
    precision: Precision,
    bucket: usize,
    overlap: bool,
) -> Ranks {
    let trainer = |model: &Gpt, c: &mut ThreadComm| {
        let params = init_params(&cfg(), 5);
        let opt = Optimizer::AdamW(AdamW::new(params.len(), 0.9, 0.95, 1e-8, 0.1).unwrap());
        let options = TrainerOptions {
            grad_clip: Some(0.5),
            precision,
            bucket_elems: bucket,
            overlap_comm: overlap,
            ..Default::default()
        };
        Trainer::distributed(model, params, opt, LrSchedule::constant(3e-3), options, zero, c).unwrap()
    };
    let ranks = train_with(n_samples, shape, (false, 3), precision, trainer);
    ranks.into_iter().map(|(p, reports)| (p.iter().map(|x| x.to_bits()).collect(), reports)).collect()
}

/// Stages 0–3 (and 2 reducing per micro-step), W ∈ {2, 3}, K ∈ {1, 3},
/// f32 and bf16 (sharded master weights at stages 1–3), buckets of 700
/// elements (they cross segment boundaries; the embedding's segment spans
/// several) and one bucket larger than the gradient: parameters and every
/// loss and norm are the same bits with and without overlap. Nothing is
/// amplified or tolerated: the collectives are the same calls on the same
/// buffers. At ZeRO-3 the segments are gathered ahead from the second
/// micro-step on (a gather is a copy).
#[test]
fn overlap_gives_the_bits_of_the_boundary_reduction() {
    let n_params = init_params(&cfg(), 5).len();
    let cases = [
        (0, false, Precision::F32),
        (1, false, Precision::Bf16),
        (2, false, Precision::F32),
        (2, false, Precision::Bf16),
        (2, true, Precision::F32),
        (3, false, Precision::F32),
        (3, false, Precision::Bf16),
    ];
    for (stage, per_micro, precision) in cases {
        let zero = ZeroConfig { stage, reduce_every_micro_step: per_micro };
        for w in [2usize, 3] {
            for k in [1usize, 3] {
                for bucket in [700, n_params + 1] {
                    let shape = BatchShape { micro: 2, accumulation_steps: k, world_size: w };
                    // Two full steps and a tail: the last step leaves ranks without data.
                    let n_samples = 2 * 2 * k * w + 3;
                    let plain = run_overlap(shape, n_samples, zero, precision, bucket, false);
                    let over = run_overlap(shape, n_samples, zero, precision, bucket, true);
                    let what = format!(
                        "stage {stage}{} {precision:?} W {w} K {k} bucket {bucket}",
                        ["", "'"][per_micro as usize]
                    );
                    for (r, ((p0, r0), (p1, r1))) in plain.iter().zip(&over).enumerate() {
                        assert!(p0 == p1, "{what}: rank {r}'s parameters differ with overlap");
                        for (a, b) in r0.iter().zip(r1) {
                            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what}: loss of step {}", a.step_idx);
                            assert_eq!(
                                a.grad_norm.to_bits(),
                                b.grad_norm.to_bits(),
                                "{what}: norm of step {}",
                                a.step_idx
                            );
                            assert!(a.overlap.is_none(), "{what}: no overlap asked, none reported");
                            let o = b.overlap.as_ref().expect("an overlapped step reports its collectives");
                            let segments = 2 + cfg().n_layer;
                            match (stage, per_micro) {
                                (0 | 1, _) => assert_eq!(o.collectives.len(), n_params.div_ceil(bucket), "{what}"),
                                (2, false) => assert_eq!(o.collectives.len(), segments, "{what}: one per segment"),
                                _ => {
                                    // One reduce-scatter per segment and micro-step, and the gathers ahead.
                                    let ahead = o.gathered_ahead as usize;
                                    let n = o.collectives.len();
                                    assert!(n >= k * segments + ahead, "{what}: {n} collectives, {ahead} ahead");
                                    let later = b.step_idx > 0 || k > 1;
                                    assert_eq!(stage == 3 && later, ahead > 0, "{what}: gathered ahead {ahead}");
                                }
                            }
                            if stage < 3 {
                                // The same bytes, and the check of the order of collectives (two f64).
                                assert_eq!(a.comm_bytes + 16, b.comm_bytes, "{what}: the same bytes go over the wire");
                            }
                        }
                    }
                    if bucket == 700 {
                        // The feature itself: buckets of the last layers went out
                        // before the backward ended, on every rank.
                        for (r, (_, reports)) in over.iter().enumerate() {
                            let o = reports[0].overlap.as_ref().unwrap();
                            let early = o.collectives.iter().filter(|c| c[0] < o.backward_end_s).count();
                            assert!(early > 0, "{what}: rank {r} handed nothing over under the backward: {o:?}");
                            if stage < 3 && !per_micro {
                                let last = early < o.collectives.len();
                                assert!(last, "{what}: the embedding's bucket waits for its last write");
                            }
                        }
                    }
                }
            }
        }
    }
}
