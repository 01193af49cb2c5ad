//! Lion, 8-bit AdamW and Adafactor inside the trainer: ZeRO sharding of
//! their state gives the bits of the unsharded state (8-bit blocks never
//! span two ranks), the state offloaded to disk gives the in-memory bits,
//! a checkpoint's state resumes bit for bit (also across ZeRO stages), 8-bit
//! AdamW holds about 2 bytes per parameter, and Adafactor's statistics are
//! kept whole on every rank, as the plan counts them.

use comm::threads::group;
use comm::Communicator;
use engine::{
    Adafactor, AdafactorConfig, AdamW, AdamW8bit, Lion, LrSchedule, Optimizer, Trainer, TrainerOptions, ZeroConfig,
};
use gpt::{init_params, Batch, Gpt};
use std::time::Duration;

mod common;

use common::{sharding_batch as batch, sharding_cfg as cfg};

#[derive(Clone, Copy, Debug)]
enum Opt {
    AdamW,
    Lion,
    AdamW8bit,
    Adafactor { beta1: bool },
}

fn optimizer(opt: Opt) -> (Optimizer, f32) {
    match opt {
        Opt::AdamW => (Optimizer::AdamW(AdamW::new(0, 0.9, 0.95, 1e-8, 0.1).unwrap()), 1e-3),
        Opt::Lion => (Optimizer::Lion(Lion::new(0, 0.9, 0.99, 0.3).unwrap()), 3e-4),
        Opt::AdamW8bit => (Optimizer::AdamW8bit(AdamW8bit::new(0.9, 0.95, 1e-8, 0.1).unwrap()), 1e-3),
        Opt::Adafactor { beta1 } => {
            let c = AdafactorConfig { beta1: beta1.then_some(0.9), ..Default::default() };
            (Optimizer::Adafactor(Adafactor::new(c, 0.1).unwrap()), 1e-3)
        }
    }
}

fn trainer(opt: Opt, zero: ZeroConfig, comm: &mut dyn Communicator) -> Result<(Gpt, Trainer), engine::EngineError> {
    let model = Gpt::new(cfg()).unwrap();
    let (o, lr) = optimizer(opt);
    // No clipping: the update then does not read the global norm, whose
    // grouping depends on the stage; everything else is stage-independent.
    let options = TrainerOptions { grad_clip: None, ..Default::default() };
    let tr = Trainer::distributed(&model, init_params(&cfg(), 3), o, LrSchedule::constant(lr), options, zero, comm)?;
    Ok((model, tr))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `range`'s steps of `k` micro-batches per rank; the losses' bits.
fn steps(tr: &mut Trainer, m: &mut Gpt, c: &mut dyn Communicator, range: std::ops::Range<usize>, k: usize) -> Vec<u64> {
    range
        .map(|step| {
            let micro: Vec<Batch> = (0..k).map(|k| batch(c.rank(), step, k)).collect();
            tr.step(m, c, &micro).unwrap().loss.to_bits()
        })
        .collect()
}

/// Per rank: the losses' bits, the full parameters and the full state after `n` steps.
type Outcome = (Vec<u64>, Vec<u32>, Vec<(String, Vec<u32>)>);

fn run(opt: Opt, zero: ZeroConfig, world: usize, offload: Option<&str>) -> Vec<Outcome> {
    std::thread::scope(|s| {
        let handles: Vec<_> = group(world, Duration::from_secs(120))
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let (mut m, mut tr) = trainer(opt, zero, &mut c).unwrap();
                    let dir = offload.map(|name| {
                        std::env::temp_dir().join(format!(
                            "macrobatch-optim-{}-{name}-{}",
                            std::process::id(),
                            c.rank()
                        ))
                    });
                    if let Some(d) = &dir {
                        // Small windows: every update crosses window boundaries.
                        tr.offload_optimizer_windowed(d, engine::optim::CHUNK).unwrap();
                    }
                    // One micro-batch per step: ZeRO-3 reduces each
                    // micro-batch, which with several would sum in another
                    // order than the other stages.
                    let losses = steps(&mut tr, &mut m, &mut c, 0..4, 1);
                    let params = bits(&tr.full_params(&mut c).unwrap());
                    let state = tr.full_optimizer_state(&mut c, true).unwrap();
                    (losses, params, state.into_iter().map(|(n, v)| (n, bits(&v))).collect())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The bits of `runs` equal `reference`'s: losses, parameters and state.
fn assert_same(opt: Opt, reference: &[Outcome], runs: &[(String, Vec<Outcome>)]) {
    for (what, ranks) in runs {
        for (rank, got) in ranks.iter().enumerate() {
            assert_eq!(got.0, reference[rank].0, "{opt:?} {what} rank {rank}: losses");
            assert_eq!(got.1, reference[rank].1, "{opt:?} {what} rank {rank}: parameters");
            assert_eq!(got.2, reference[rank].2, "{opt:?} {what} rank {rank}: optimizer state");
        }
    }
}

/// ZeRO-1 and ZeRO-2 (local accumulation) reduce as ZeRO-0 does, so their
/// sharded state must give ZeRO-0's bits (Adafactor's row, column and RMS
/// sums are added over the ranks exactly, so cuts inside its tensors do not
/// change them); ZeRO-3 and per-micro-step ZeRO-2
/// reduce per segment and normalise per micro-batch, which rounds
/// differently even for AdamW (data_parallel.rs holds them to 1e-6), so
/// they are compared with each other (both shard the state). Offloaded
/// state (ZeRO-0 and ZeRO-1) gives the in-memory bits. W = 3: ZeRO cuts
/// fall inside tensors.
#[test]
fn sharded_and_offloaded_state_give_the_unsharded_bits() {
    let zero = |stage, reduce_every_micro_step| ZeroConfig { stage, reduce_every_micro_step };
    let opts = [Opt::AdamW, Opt::Lion, Opt::AdamW8bit, Opt::Adafactor { beta1: false }, Opt::Adafactor { beta1: true }];
    for opt in opts {
        let reference = run(opt, ZeroConfig::default(), 3, None);
        let local = [
            ("ZeRO-1".to_string(), run(opt, zero(1, false), 3, None)),
            ("ZeRO-2".to_string(), run(opt, zero(2, false), 3, None)),
            ("offloaded, ZeRO-1".into(), run(opt, zero(1, false), 3, Some(&format!("{opt:?}")))),
            ("offloaded, ZeRO-0".into(), run(opt, ZeroConfig::default(), 3, Some(&format!("{opt:?}-0")))),
        ];
        assert_same(opt, &reference, &local);
        let per_segment = run(opt, zero(2, true), 3, None);
        assert_same(opt, &per_segment, &[("ZeRO-3".into(), run(opt, zero(3, false), 3, None))]);
    }
}

#[test]
fn resume_from_the_state_is_bit_exact() {
    let opts = [Opt::Lion, Opt::AdamW8bit, Opt::Adafactor { beta1: false }, Opt::Adafactor { beta1: true }];
    for opt in opts {
        for (zero, world) in [(0, 1), (1, 2)] {
            let zero = ZeroConfig { stage: zero, reduce_every_micro_step: false };
            let out: Vec<(Vec<u32>, Vec<u32>)> = std::thread::scope(|s| {
                let handles: Vec<_> = group(world, Duration::from_secs(120))
                    .into_iter()
                    .map(|mut c| {
                        s.spawn(move || {
                            let (mut m, mut straight) = trainer(opt, zero, &mut c).unwrap();
                            steps(&mut straight, &mut m, &mut c, 0..6, 2);
                            let (mut m, mut first) = trainer(opt, zero, &mut c).unwrap();
                            steps(&mut first, &mut m, &mut c, 0..3, 2);
                            let params = first.full_params(&mut c).unwrap();
                            let state = first.full_optimizer_state(&mut c, true).unwrap();
                            let n_updates = first.optimizer().n_updates();
                            drop(first);
                            let (mut m, mut resumed) = trainer(opt, zero, &mut c).unwrap();
                            let get = |name: &str| state.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
                            resumed.restore(params, 3, n_updates, get).unwrap();
                            steps(&mut resumed, &mut m, &mut c, 3..6, 2);
                            (bits(&straight.full_params(&mut c).unwrap()), bits(&resumed.full_params(&mut c).unwrap()))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (a, b) in out {
                assert!(a == b, "{opt:?} {zero:?}: the resumed run differs");
            }
        }
    }
}

#[test]
fn eight_bit_state_is_about_two_bytes_per_parameter() {
    let (_, tr) = trainer(Opt::AdamW8bit, ZeroConfig::default(), &mut comm::SingleProcess::new()).unwrap();
    let n = tr.grad_space().n_grads;
    let bytes = tr.memory().optimizer;
    // Two codes per element plus two f32 scales per block of at most 2048
    // (more blocks where tensors end inside a window: still < 2.02 here).
    assert!(bytes >= 2 * n && (bytes as f64) < 2.02 * n as f64, "{bytes} bytes for {n} parameters");
    let (_, adamw) = trainer(Opt::AdamW, ZeroConfig::default(), &mut comm::SingleProcess::new()).unwrap();
    assert_eq!(adamw.memory().optimizer, 8 * n);
    // The plan counts the same bytes.
    let planned = Trainer::planned_memory(
        &Gpt::new(cfg()).unwrap(),
        ZeroConfig::default(),
        1,
        engine::Precision::F32,
        engine::StateSize::Blockwise8bit,
        engine::DEFAULT_BUCKET_ELEMS,
        false,
    )
    .unwrap();
    assert_eq!(planned.optimizer, bytes);
}

/// Adafactor's checkpointed state is the same buffer at ZeRO-0 and
/// ZeRO-3 (its statistics whole, its first moment per element), so a
/// ZeRO-3 run resumed at ZeRO-1 over another number of ranks continues
/// exactly as a ZeRO-1 run restored from ZeRO-1's own state.
#[test]
fn adafactor_state_moves_between_zero_stages_and_world_sizes() {
    let opt = Opt::Adafactor { beta1: true };
    let zero = |stage| ZeroConfig { stage, reduce_every_micro_step: false };
    // Three steps at ZeRO-3 over 3 ranks, and at ZeRO-0 over 3 ranks.
    type Saved = (Vec<f32>, Vec<(String, Vec<f32>)>, u64);
    let saved = |z: ZeroConfig| -> Saved {
        let outs: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = group(3, Duration::from_secs(120))
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let (mut m, mut tr) = trainer(opt, z, &mut c).unwrap();
                        steps(&mut tr, &mut m, &mut c, 0..3, 1);
                        let p = tr.full_params(&mut c).unwrap();
                        (p, tr.full_optimizer_state(&mut c, true).unwrap(), tr.optimizer().n_updates())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        outs.into_iter().next().unwrap()
    };
    let (p3, s3, n3) = saved(zero(3));
    let (p0, s0, _) = saved(zero(0));
    // ZeRO-3 rounds its per-segment reduction differently (see above), so
    // the states are compared in structure: the same slots and lengths.
    let shape = |s: &[(String, Vec<f32>)]| s.iter().map(|(n, v)| (n.clone(), v.len())).collect::<Vec<_>>();
    assert_eq!(shape(&s3), shape(&s0));
    // Resume ZeRO-3's state at ZeRO-1 over 2 ranks, and at ZeRO-0 over 2:
    // both continue from the same state, so they must agree bit for bit.
    let resume = |z: ZeroConfig| -> Vec<Vec<u32>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = group(2, Duration::from_secs(120))
                .into_iter()
                .map(|mut c| {
                    let (p, st) = (p3.clone(), s3.clone());
                    s.spawn(move || {
                        let (mut m, mut tr) = trainer(opt, z, &mut c).unwrap();
                        let get = |name: &str| st.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
                        tr.restore(p, 3, n3, get).unwrap();
                        steps(&mut tr, &mut m, &mut c, 3..5, 1);
                        bits(&tr.full_params(&mut c).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let (one, zero0) = (resume(zero(1)), resume(zero(0)));
    assert_eq!(one, zero0, "ZeRO-3's Adafactor state resumed at ZeRO-1 and at ZeRO-0 differ");
    assert_ne!(bits(&p0), one[0], "the resumed runs moved the parameters");
}

/// Every rank keeps all of Adafactor's statistics and its shard of the
/// first moment; the plan counts the same bytes, in memory and offloaded.
#[test]
fn adafactor_state_bytes_equal_the_plan() {
    let zero1 = ZeroConfig { stage: 1, reduce_every_micro_step: false };
    let size = engine::StateSize::Factored { first_moment: true };
    let plan = |offload| {
        let model = Gpt::new(cfg()).unwrap();
        Trainer::planned_memory(&model, zero1, 3, engine::Precision::F32, size, engine::DEFAULT_BUCKET_ELEMS, offload)
            .unwrap()
    };
    let got: Vec<(usize, usize, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = group(3, Duration::from_secs(60))
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let (_, mut tr) = trainer(Opt::Adafactor { beta1: true }, zero1, &mut c).unwrap();
                    let in_memory = tr.memory().optimizer;
                    let dir = std::env::temp_dir().join(format!(
                        "macrobatch-optim-{}-adafactor-{}",
                        std::process::id(),
                        c.rank()
                    ));
                    tr.offload_optimizer(&dir).unwrap();
                    let m = tr.memory();
                    (in_memory, m.optimizer, m.offloaded)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (mem, off) = (plan(false), plan(true));
    assert_eq!((got[0].0, got[0].1, got[0].2), (mem.optimizer, off.optimizer, off.offloaded));
    // The statistics are the same size on every rank; the first moment is a
    // third of the gradient space (padded shards of equal length).
    assert!(got.iter().all(|g| g.0 == got[0].0));
    let (_, whole) =
        trainer(Opt::Adafactor { beta1: true }, ZeroConfig::default(), &mut comm::SingleProcess::new()).unwrap();
    let n = whole.grad_space().n_grads;
    let stats = whole.memory().optimizer - 4 * n;
    // Rows and columns: a few per cent of AdamW's 8 bytes per parameter.
    assert!(stats > 0 && stats < 4 * n / 10, "{stats} bytes of statistics for {n} parameters");
    assert!(got[0].0 - stats >= 4 * n / 3 && got[0].0 - stats <= 4 * n / 3 + 4 * 64 * 3, "{got:?}");
    assert_eq!(got[0].2, got[0].0 - stats, "the first moment goes to disk, the statistics stay");
}
