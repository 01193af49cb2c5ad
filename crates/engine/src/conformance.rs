//! The `Model` conformance suite: what every model family must pass to be
//! trained by the engine (docs/contract.md). A family supplies a tiny model,
//! its initial parameters and micro-batches built from sample indices of a
//! fixed synthetic data set whose samples hold *different* numbers of
//! targets; [`run_all`] then checks
//!
//! - the gradient against central finite differences of the loss,
//! - K-invariance (uneven micro-batches = one big batch),
//! - W-invariance (thread ranks = one rank) with an empty micro-batch on one
//!   rank, and ZeRO stages 0–3 against stage 0,
//! - several steps in a row against a fresh reference gradient each step
//!   (a model that leaves stale gradient behind fails here),
//! - frozen tensors: untouched, no gradient or optimizer memory, and the
//!   trainable part equal to a full run whose frozen updates are discarded,
//! - bit-identical resume from the full state after some steps,
//! - gradient collectives under the backward (`overlap_comm`) give the
//!   boundary's bits: the model's backward finishes each segment before a
//!   lower one (or the engine refuses, never loses a write).
//!
//! Each check returns `Err` with what differed instead of panicking, so a
//! test can also show that a broken model fails.

mod packed;
pub mod pipeline;

pub use packed::check_packed_documents;

use crate::layout::TensorSpec;
use crate::model::Model;
use crate::optim::{AdamW, Optimizer, Sgd};
use crate::schedule::LrSchedule;
use crate::store::FullStore;
use crate::trainer::{Trainer, TrainerOptions};
use crate::zero::ZeroConfig;
use comm::Communicator;
use std::time::Duration;

/// A model family under test.
pub trait ModelUnderTest: Sync {
    /// The model.
    type M: Model;
    /// A fresh model of the family's tiny configuration.
    fn model(&self) -> Self::M;
    /// Initial parameters (with enough spread that every path carries gradient).
    fn init(&self) -> Vec<f32>;
    /// A micro-batch of the given samples of the family's data set (empty:
    /// a batch of zero rows). Samples must hold different numbers of targets.
    fn batch(&self, samples: &[usize]) -> <Self::M as Model>::Batch;
    /// Number of samples in the data set (at least 8).
    fn n_samples(&self) -> usize;
    /// Which tensors the frozen-tensor check freezes.
    fn frozen(&self, t: &TensorSpec) -> bool;
    /// Central-difference step and tolerances for [`check_gradient`]:
    /// `(h, rtol, atol)`; an element passes when `|g − fd| ≤ rtol·|fd| + atol`.
    fn fd_tolerance(&self) -> (f64, f64, f64);
    /// Whether the loss is only piecewise smooth in the parameters (a
    /// mixture of experts' top-k routing jumps where two experts'
    /// probabilities cross): a central difference whose interval crosses
    /// such a boundary measures the jump, not the slope. Then an element
    /// that fails at `h` is measured again at `h/4` and `h/16` (the
    /// rounding term `atol` scaled by the same factor); it passes if any
    /// of them agrees. Default: smooth.
    fn fd_piecewise(&self) -> bool {
        false
    }
    /// Relative tolerance (to the largest magnitude) for comparing
    /// gradients and parameters computed in different orders of summation.
    fn rtol(&self) -> f32;
}

/// The suite's data set for a language model: `n` random sequences of `t`
/// tokens below `vocab` from `rng_seed`, where sequence `i` ignores its first
/// `i mod 5` targets, so samples hold different numbers of targets.
pub struct TokenSamples(Vec<(Vec<u32>, Vec<i32>)>);

impl TokenSamples {
    /// The data set.
    pub fn new(n: usize, t: usize, vocab: u64, rng_seed: u64) -> Self {
        let mut rng = crate::rng::SplitMix64::new(rng_seed);
        let seqs = (0..n)
            .map(|i| {
                let toks: Vec<u32> = (0..=t).map(|_| rng.below(vocab) as u32).collect();
                let targets = toks[1..]
                    .iter()
                    .enumerate()
                    .map(|(k, &x)| if k < i % 5 { crate::IGNORE_INDEX } else { x as i32 })
                    .collect();
                (toks[..t].to_vec(), targets)
            })
            .collect();
        Self(seqs)
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The micro-batch of `samples` (no rows when empty).
    pub fn batch(&self, samples: &[usize]) -> crate::TokenBatch {
        crate::TokenBatch {
            n_seqs: samples.len(),
            seq_len: self.0.first().map_or(0, |s| s.0.len()),
            inputs: samples.iter().flat_map(|&i| self.0[i].0.clone()).collect(),
            targets: samples.iter().flat_map(|&i| self.0[i].1.clone()).collect(),
            positions: Vec::new(),
        }
    }
}

/// What a check found.
pub type Check = Result<(), String>;

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

fn close(what: &str, got: &[f32], want: &[f32], rtol: f32) -> Check {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, expected {}", got.len(), want.len()));
    }
    let tol = rtol * max_abs(want).max(1e-30);
    match got.iter().zip(want).enumerate().find(|(_, (g, w))| (*g - *w).abs() > tol || !g.is_finite()) {
        Some((i, (g, w))) => Err(format!("{what}: element {i} is {g}, expected {w} (tolerance {tol:e})")),
        None => Ok(()),
    }
}

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// ∂(Σ loss)/∂θ of `samples` in one pass from a zeroed buffer (the
/// reference), and the number of targets.
fn reference_gradient<F: ModelUnderTest>(f: &F, params: &[f32], samples: &[usize]) -> Result<(Vec<f32>, u64), String> {
    let mut model = f.model();
    let mut g = vec![0.0; model.layout().n_trainable()];
    let batch = f.batch(samples);
    step_stats_alone(&mut model, params, &[&batch])?;
    let mut store = FullStore::for_model(&model, params, &mut g).map_err(err("store"))?;
    let s = model.micro_step(&mut store, &batch, 1.0).map_err(err("micro-step"))?;
    Ok((g, s.n_targets))
}

/// What the trainer does before a step's first micro-step for a model that
/// needs sums over the step's batch ([`Model::step_stats_len`]), on one
/// process: a forward-only pass over `batches` with `params`, its sums
/// handed to the model. Nothing for a model that needs none.
pub fn step_stats_alone<M: Model>(model: &mut M, params: &[f32], batches: &[&M::Batch]) -> Check {
    let len = model.step_stats_len();
    if len == 0 {
        return Ok(());
    }
    let mut sums = vec![0.0; len];
    for b in batches {
        let mut store = FullStore::read_only_for(model, params).map_err(err("store"))?;
        model.collect_step_stats(&mut store, b, &mut sums).map_err(err("step statistics"))?;
    }
    model.set_step_stats(&sums);
    Ok(())
}

fn sgd_trainer<M: Model>(model: &M, params: Vec<f32>, comm: &mut dyn Communicator, zero: ZeroConfig) -> Trainer {
    let opt = Optimizer::Sgd(Sgd::new(params.len(), 0.0, false, 0.0).expect("valid SGD"));
    Trainer::distributed(model, params, opt, LrSchedule::constant(0.1), TrainerOptions::default(), zero, comm)
        .expect("trainer")
}

/// AdamW with ε = 1e-4: with the usual 1e-8, a parameter whose true
/// gradient is zero (GPT-2's key bias: softmax ignores a constant shift)
/// moves by ±lr on rounding noise of ~1e-9, so two summation orders differ
/// by lr per step — a property of AdamW, not of the engine. A larger ε
/// keeps that amplification below the comparison's tolerance while every
/// other parameter still takes Adam's normalised step.
fn adamw_trainer<M: Model>(model: &M, params: Vec<f32>, comm: &mut dyn Communicator, zero: ZeroConfig) -> Trainer {
    let opt = Optimizer::AdamW(AdamW::new(params.len(), 0.9, 0.95, 1e-4, 0.1).expect("valid AdamW"));
    let options = TrainerOptions { grad_clip: Some(1.0), ..TrainerOptions::default() };
    let sched = LrSchedule { warmup_steps: 2, total_steps: 10, ..LrSchedule::constant(1e-2) };
    Trainer::distributed(model, params, opt, sched, options, zero, comm).expect("trainer")
}

/// Central finite differences of the summed loss against the model's
/// gradient, for up to 16 elements of every trainable tensor.
pub fn check_gradient<F: ModelUnderTest>(f: &F) -> Check {
    let params = f.init();
    let all: Vec<usize> = (0..4.min(f.n_samples())).collect();
    let (g, _) = reference_gradient(f, &params, &all)?;
    let mut model = f.model();
    let batch = f.batch(&all);
    let layout = model.layout().clone();
    let mut loss = |p: &[f32]| -> Result<f64, String> {
        let mut store = FullStore::read_only_for(&model, p).map_err(err("store"))?;
        // The training loss: cross-entropy and the model's own terms.
        let s = model.loss(&mut store, &batch).map_err(err("loss"))?;
        Ok(s.loss_sum + s.aux_sum)
    };
    let (h, rtol, atol) = f.fd_tolerance();
    let mut gi = 0;
    for t in layout.tensors() {
        let n = t.numel();
        let stride = n.div_ceil(16).max(1);
        for k in (0..n).step_by(stride) {
            let i = t.offset + k;
            // The steps actually taken: x ± h rounded to f32.
            let got = g[gi + k] as f64;
            let mut central = |h: f64| -> Result<f64, String> {
                let (hi, lo) = ((params[i] as f64 + h) as f32, (params[i] as f64 - h) as f32);
                let mut p = params.clone();
                p[i] = hi;
                let up = loss(&p)?;
                p[i] = lo;
                let down = loss(&p)?;
                Ok((up - down) / (hi as f64 - lo as f64))
            };
            let fd = central(h)?;
            let mut agrees = (got - fd).abs() <= rtol * fd.abs() + atol;
            if f.fd_piecewise() {
                for shrink in [4.0, 16.0] {
                    if agrees {
                        break;
                    }
                    let fd = central(h / shrink)?;
                    agrees = (got - fd).abs() <= rtol * fd.abs() + atol * shrink;
                }
            }
            if !agrees {
                return Err(format!(
                    "gradient of {}[{k}]: model {got:e}, central difference {fd:e} (rtol {rtol:e}, atol {atol:e})",
                    t.name
                ));
            }
        }
        gi += n;
    }
    Ok(())
}

/// K uneven micro-batches equal one big batch (gradient of one step).
pub fn check_k_invariance<F: ModelUnderTest>(f: &F) -> Check {
    let model = f.model();
    let params = f.init();
    let all: Vec<usize> = (0..8).collect();
    let mut one = sgd_trainer(&model, params.clone(), &mut comm::SingleProcess::new(), ZeroConfig::default());
    let mut m1 = f.model();
    one.step(&mut m1, &mut comm::SingleProcess::new(), &[f.batch(&all)]).map_err(err("K=1 step"))?;
    for split in [&[3usize, 5][..], &[1, 0, 4, 3], &[2, 2, 2, 2]] {
        let mut at = 0;
        let batches: Vec<_> = split
            .iter()
            .map(|&n| {
                at += n;
                f.batch(&all[at - n..at])
            })
            .collect();
        let mut k = sgd_trainer(&model, params.clone(), &mut comm::SingleProcess::new(), ZeroConfig::default());
        let mut mk = f.model();
        k.step(&mut mk, &mut comm::SingleProcess::new(), &batches).map_err(err("K step"))?;
        close(&format!("gradient with micro-batches {split:?}"), &k.gradient(), &one.gradient(), f.rtol())?;
        close(&format!("parameters with micro-batches {split:?}"), k.params(), one.params(), f.rtol())?;
    }
    Ok(())
}

/// Several steps in a row (K = 3, one micro-batch empty): each step's
/// gradient equals a reference computed from a zeroed buffer at the same
/// parameters, divided by the step's targets. Stale gradient left in the
/// engine's buffers by a model shows here from step 2 on.
pub fn check_several_steps<F: ModelUnderTest>(f: &F) -> Check {
    let model = f.model();
    let mut tr = sgd_trainer(&model, f.init(), &mut comm::SingleProcess::new(), ZeroConfig::default());
    let mut m = f.model();
    for step in 0..4 {
        let rows: Vec<usize> = (0..6).map(|i| (step * 3 + i) % f.n_samples()).collect();
        let (mut want, n) = reference_gradient(f, tr.params(), &rows)?;
        want.iter_mut().for_each(|g| *g /= n as f32);
        let batches = [f.batch(&rows[..2]), f.batch(&[]), f.batch(&rows[2..])];
        tr.step(&mut m, &mut comm::SingleProcess::new(), &batches).map_err(err("step"))?;
        close(&format!("gradient of step {}", step + 1), &tr.gradient(), &want, f.rtol())?;
    }
    Ok(())
}

/// Runs `body(rank, comm)` on `world` thread ranks and collects the results.
fn on_ranks<T: Send>(
    world: usize,
    body: impl Fn(usize, &mut dyn Communicator) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    let comms = comm::threads::group(world, Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                let body = &body;
                s.spawn(move || body(c.rank(), &mut c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| "a rank panicked".to_string())?).collect()
    })
}

/// W = 2 thread ranks (rank 1 with an empty micro-batch) at every ZeRO
/// stage equal one rank over the same samples: 3 AdamW steps with clipping.
pub fn check_ranks_and_zero<F: ModelUnderTest>(f: &F) -> Check {
    let model = f.model();
    // Step s, one rank: samples of both ranks' micro-batches.
    let rank_rows = |s: usize, rank: usize| -> [Vec<usize>; 2] {
        let b = (s * 4) % f.n_samples();
        let r = |i: usize| (b + i) % f.n_samples();
        if rank == 0 {
            [vec![r(0), r(1)], vec![r(2)]]
        } else {
            [vec![r(3)], vec![]]
        }
    };
    let mut single = adamw_trainer(&model, f.init(), &mut comm::SingleProcess::new(), ZeroConfig::default());
    let mut m = f.model();
    for s in 0..3 {
        let rows: Vec<usize> = (0..2).flat_map(|r| rank_rows(s, r).concat()).collect();
        single.step(&mut m, &mut comm::SingleProcess::new(), &[f.batch(&rows)]).map_err(err("one-rank step"))?;
    }
    let want = single.params().to_vec();
    for (stage, per_micro) in [(0, false), (1, false), (2, false), (2, true), (3, false)] {
        let zero = ZeroConfig { stage, reduce_every_micro_step: per_micro };
        let got = on_ranks(2, |rank, c| {
            let mut m = f.model();
            let mut tr = adamw_trainer(&m, f.init(), c, zero);
            for s in 0..3 {
                let batches: Vec<_> = rank_rows(s, rank).iter().map(|r| f.batch(r)).collect();
                tr.step(&mut m, c, &batches).map_err(err("step"))?;
            }
            tr.full_params(c).map_err(err("gather"))
        })?;
        for (rank, p) in got.iter().enumerate() {
            close(
                &format!("ZeRO {stage}{} rank {rank} vs one rank", if per_micro { "'" } else { "" }),
                p,
                &want,
                f.rtol(),
            )?;
        }
    }
    Ok(())
}

/// Frozen tensors: no gradient or optimizer memory, parameters untouched,
/// and the trainable part equal to a full run whose frozen updates are
/// discarded (no clipping, which would couple them through the norm).
pub fn check_frozen<F: ModelUnderTest>(f: &F) -> Check {
    let init = f.init();
    let mut frozen_model = f.model();
    let n_trainable = frozen_model.set_trainable(&|t| !f.frozen(t));
    if n_trainable == 0 || n_trainable == init.len() {
        return Err("the family's frozen() must freeze some but not all tensors".into());
    }
    let layout = frozen_model.layout().clone();
    let opt = |n| Optimizer::AdamW(AdamW::new(n, 0.9, 0.95, 1e-4, 0.1).expect("valid AdamW"));
    let sched = LrSchedule::constant(1e-2);
    let mut one = comm::SingleProcess::new();
    let mut frozen = Trainer::new(&frozen_model, init.clone(), opt(init.len()), sched, TrainerOptions::default())
        .map_err(err("trainer"))?;
    let mem = frozen.memory();
    if mem.grads != 4 * n_trainable || mem.optimizer != 8 * n_trainable {
        return Err(format!(
            "frozen run holds {} B of gradients and {} B of optimizer state; expected {} and {} ({} trainable)",
            mem.grads,
            mem.optimizer,
            4 * n_trainable,
            8 * n_trainable,
            n_trainable
        ));
    }
    let full_model = f.model();
    let mut full = Trainer::new(&full_model, init.clone(), opt(init.len()), sched, TrainerOptions::default())
        .map_err(err("trainer"))?;
    let (mut mf, mut mm) = (f.model(), frozen_model);
    for s in 0..3 {
        let rows: Vec<usize> = (0..4).map(|i| (s * 4 + i) % f.n_samples()).collect();
        let batches = [f.batch(&rows[..3]), f.batch(&rows[3..])];
        frozen.step(&mut mm, &mut one, &batches).map_err(err("frozen step"))?;
        full.step(&mut mf, &mut one, &batches).map_err(err("full step"))?;
        // Discard the full run's updates of the frozen tensors.
        let mut p = full.params().to_vec();
        for t in layout.tensors().iter().filter(|t| !t.trainable) {
            p[t.range()].copy_from_slice(&init[t.range()]);
        }
        full.set_params(p).map_err(err("set_params"))?;
    }
    for t in layout.tensors() {
        let (got, want) = (&frozen.params()[t.range()], &full.params()[t.range()]);
        if !t.trainable && got != &init[t.range()] {
            return Err(format!("frozen tensor {} changed", t.name));
        }
        close(&format!("tensor {} (frozen: {})", t.name, !t.trainable), got, want, f.rtol())?;
    }
    let state = frozen.full_optimizer_state(&mut one, true).map_err(err("state"))?;
    if state.iter().any(|(_, v)| v.len() != n_trainable) {
        return Err("checkpointed optimizer state covers frozen tensors".into());
    }
    Ok(())
}

/// Stopping after 2 steps and resuming from the full state (parameters,
/// optimizer state, step count) continues bit for bit, at ZeRO 0 and 3.
pub fn check_resume<F: ModelUnderTest>(f: &F) -> Check {
    let batches = |s: usize| -> Vec<_> {
        let b = s * 3;
        vec![f.batch(&[b % f.n_samples(), (b + 1) % f.n_samples()]), f.batch(&[(b + 2) % f.n_samples()])]
    };
    for stage in [0u8, 3] {
        let zero = ZeroConfig { stage, reduce_every_micro_step: false };
        let out = on_ranks(2, |_, c| {
            let (model, mut m) = (f.model(), f.model());
            let mut straight = adamw_trainer(&model, f.init(), c, zero);
            for s in 0..4 {
                straight.step(&mut m, c, &batches(s)).map_err(err("step"))?;
            }
            let mut first = adamw_trainer(&model, f.init(), c, zero);
            for s in 0..2 {
                first.step(&mut m, c, &batches(s)).map_err(err("step"))?;
            }
            let params = first.full_params(c).map_err(err("params"))?;
            let state = first.full_optimizer_state(c, true).map_err(err("state"))?;
            let (n_steps, n_updates) = (first.n_steps(), first.optimizer().n_updates());
            drop(first);
            let mut m2 = f.model();
            let mut resumed = adamw_trainer(&model, f.init(), c, zero);
            resumed
                .restore(params, n_steps, n_updates, |name| {
                    state.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
                })
                .map_err(err("restore"))?;
            for s in 2..4 {
                resumed.step(&mut m2, c, &batches(s)).map_err(err("step"))?;
            }
            Ok((straight.full_params(c).map_err(err("params"))?, resumed.full_params(c).map_err(err("params"))?))
        })?;
        for (a, b) in out {
            if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
                return Err(format!("ZeRO {stage}: resumed parameters differ from the straight run's"));
            }
        }
    }
    Ok(())
}

/// `overlap_comm` at ZeRO 0–3 (and 2 reducing per micro-step) on W = 3
/// thread ranks (K = 2, one rank's micro-batches empty), with buckets of a
/// seventh of the model (they cross segments): the parameters after 3 AdamW
/// steps are the bits of the same run without it, and some collective
/// started under the backward.
pub fn check_overlap<F: ModelUnderTest>(f: &F) -> Check {
    let n = f.init().len();
    let rows = |s: usize, rank: usize| -> [Vec<usize>; 2] {
        let r = |i: usize| (s * 4 + i) % f.n_samples();
        match rank {
            0 => [vec![r(0), r(1)], vec![r(2)]],
            1 => [vec![r(3)], vec![]],
            _ => [vec![], vec![]],
        }
    };
    for (stage, per_micro) in [(0, false), (1, false), (2, false), (2, true), (3, false)] {
        let zero = ZeroConfig { stage, reduce_every_micro_step: per_micro };
        let run = |overlap: bool| {
            on_ranks(3, |rank, c| {
                let mut m = f.model();
                let params = f.init();
                let opt = Optimizer::AdamW(AdamW::new(params.len(), 0.9, 0.95, 1e-4, 0.1).expect("valid AdamW"));
                let options = TrainerOptions {
                    grad_clip: Some(1.0),
                    bucket_elems: n.div_ceil(7),
                    overlap_comm: overlap,
                    ..TrainerOptions::default()
                };
                let mut tr = Trainer::distributed(&m, params, opt, LrSchedule::constant(1e-2), options, zero, c)
                    .map_err(err("trainer"))?;
                let mut early = 0;
                for s in 0..3 {
                    let batches: Vec<_> = rows(s, rank).iter().map(|r| f.batch(r)).collect();
                    let report = tr.step(&mut m, c, &batches).map_err(|e| {
                        // The model's error names the micro-step; its source, why.
                        let mut why = format!("step: {e}");
                        let mut source = std::error::Error::source(&e);
                        while let Some(s) = source {
                            why += &format!(": {s}");
                            source = s.source();
                        }
                        why
                    })?;
                    if let Some(o) = report.overlap {
                        early += o.collectives.iter().filter(|t| t[0] < o.backward_end_s).count();
                    }
                }
                Ok((tr.full_params(c).map_err(err("gather"))?, early))
            })
        };
        let name = format!("ZeRO {stage}{}", if per_micro { "'" } else { "" });
        let (plain, over) = (run(false)?, run(true).map_err(|e| format!("{name}: {e}"))?);
        for (rank, ((a, _), (b, early))) in plain.iter().zip(&over).enumerate() {
            if a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits()) {
                return Err(format!("{name} rank {rank}: parameters with overlap_comm differ from the boundary's"));
            }
            if *early == 0 {
                return Err(format!("{name} rank {rank}: no gradient collective started under the backward"));
            }
        }
    }
    Ok(())
}

/// Every check, in order; the first failure names the check.
pub fn run_all<F: ModelUnderTest>(f: &F) -> Check {
    type Named<F> = (&'static str, fn(&F) -> Check);
    let checks: [Named<F>; 7] = [
        ("finite differences", check_gradient),
        ("K-invariance", check_k_invariance),
        ("several steps", check_several_steps),
        ("W-invariance and ZeRO 0–3", check_ranks_and_zero),
        ("frozen tensors", check_frozen),
        ("resume", check_resume),
        ("overlap_comm", check_overlap),
    ];
    for (name, check) in checks {
        check(f).map_err(|e| format!("{name}: {e}"))?;
    }
    Ok(())
}
