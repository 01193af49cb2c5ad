//! Optimizer state offloaded to disk: N steps give bit-identical losses and
//! parameters to the in-memory optimizer (AdamW and SGD with momentum, every
//! ZeRO stage, f32 and bf16), checkpoint state round-trips through the files,
//! the files go away with the trainer, and I/O failures name the file.

use comm::threads::group;
use comm::Communicator;
use engine::{AdamW, EngineError, LrSchedule, Optimizer, Precision, Sgd, Trainer, TrainerOptions, ZeroConfig};
use gpt::{init_params, Batch, Gpt};
use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;

use common::{sharding_batch as batch, sharding_cfg as cfg};

#[derive(Clone, Copy, Debug)]
enum Opt {
    AdamW,
    Sgd { nesterov: bool },
}

fn trainer(opt: Opt, zero: ZeroConfig, precision: Precision, comm: &mut dyn Communicator) -> (Gpt, Trainer) {
    let model = Gpt::with_precision(cfg(), precision).unwrap();
    let params = init_params(&cfg(), 3);
    let n = params.len();
    let (o, lr) = match opt {
        Opt::AdamW => (Optimizer::AdamW(AdamW::new(n, 0.9, 0.95, 1e-8, 0.1).unwrap()), 1e-3),
        Opt::Sgd { nesterov } => (Optimizer::Sgd(Sgd::new(n, 0.9, nesterov, 0.01).unwrap()), 0.05),
    };
    let options = TrainerOptions { grad_clip: Some(1.0), precision, ..Default::default() };
    let tr = Trainer::distributed(&model, params, o, LrSchedule::constant(lr), options, zero, comm).unwrap();
    (model, tr)
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("macrobatch-offload-test-{}-{name}", std::process::id()))
}

/// Per rank: the losses of `steps` steps and the final full parameters
/// and optimizer state.
type RankResult = (Vec<f64>, Vec<f32>, Vec<(String, Vec<f32>)>);

fn run(opt: Opt, zero: ZeroConfig, precision: Precision, world: usize, offload: Option<&Path>) -> Vec<RankResult> {
    std::thread::scope(|s| {
        let handles: Vec<_> = group(world, Duration::from_secs(60))
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let (mut model, mut tr) = trainer(opt, zero, precision, &mut c);
                    let dir = offload.map(|d| d.join(format!("rank-{}", c.rank())));
                    if let Some(d) = &dir {
                        // Small windows: every update crosses many window boundaries.
                        tr.offload_optimizer_windowed(d, engine::optim::CHUNK).unwrap();
                        assert!(d
                            .join(if matches!(opt, Opt::AdamW) { "exp_avg_sq.f32" } else { "momentum_buffer.f32" })
                            .exists());
                    }
                    let mut losses = Vec::new();
                    for step in 0..4 {
                        let micro: Vec<Batch> = (0..2).map(|k| batch(c.rank(), step, k)).collect();
                        losses.push(tr.step(&mut model, &mut c, &micro).unwrap().loss);
                    }
                    let params = tr.full_params(&mut c).unwrap();
                    let state = tr.full_optimizer_state(&mut c, true).unwrap();
                    let mem = tr.memory();
                    if dir.is_some() {
                        assert!(mem.offloaded > 0 && mem.optimizer <= 4 * 2 * engine::optim::CHUNK, "{mem:?}");
                    }
                    drop(tr);
                    if let Some(d) = &dir {
                        assert!(!d.exists(), "{} left behind", d.display());
                    }
                    (losses, params, state)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn offloaded_updates_are_bit_identical_for_every_stage_and_optimizer() {
    let zeros = [(0, false, 1), (0, false, 2), (1, false, 2), (2, false, 2), (2, true, 2), (3, false, 2)];
    let mut n = 0;
    for opt in [Opt::AdamW, Opt::Sgd { nesterov: false }, Opt::Sgd { nesterov: true }] {
        for (stage, per_micro, world) in zeros {
            for precision in [Precision::F32, Precision::Bf16] {
                let zero = ZeroConfig { stage, reduce_every_micro_step: per_micro };
                let dir = scratch(&format!("bits-{n}"));
                let plain = run(opt, zero, precision, world, None);
                let disk = run(opt, zero, precision, world, Some(&dir));
                let what = format!("{opt:?} {zero:?} W={world} {precision}");
                for (a, b) in plain.iter().zip(&disk) {
                    assert_eq!(
                        a.0.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
                        b.0.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
                        "losses {what}"
                    );
                    assert_eq!(bits(&a.1), bits(&b.1), "parameters {what}");
                    assert_eq!(a.2.len(), b.2.len(), "{what}");
                    for ((na, va), (nb, vb)) in a.2.iter().zip(&b.2) {
                        assert_eq!(na, nb);
                        assert_eq!(bits(va), bits(vb), "state {na} {what}");
                    }
                }
                let _ = std::fs::remove_dir_all(&dir);
                n += 1;
            }
        }
    }
    assert_eq!(n, 3 * 6 * 2);
}

#[test]
fn restore_writes_the_files_and_resume_is_bit_exact() {
    let zero = ZeroConfig { stage: 1, reduce_every_micro_step: false };
    let dir = scratch("resume");
    let out: Vec<(Vec<u32>, Vec<u32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = group(2, Duration::from_secs(60))
            .into_iter()
            .map(|mut c| {
                let dir = &dir;
                s.spawn(move || {
                    let r = c.rank();
                    let steps =
                        |tr: &mut Trainer, m: &mut Gpt, c: &mut dyn Communicator, range: std::ops::Range<usize>| {
                            for step in range {
                                let micro: Vec<Batch> = (0..2).map(|k| batch(r, step, k)).collect();
                                tr.step(m, c, &micro).unwrap();
                            }
                        };
                    // Straight: 4 steps in memory.
                    let (mut m, mut straight) = trainer(Opt::AdamW, zero, Precision::F32, &mut c);
                    steps(&mut straight, &mut m, &mut c, 0..4);
                    // Offloaded: 2 steps, state out, a fresh offloaded trainer restored, 2 more.
                    let (mut m, mut first) = trainer(Opt::AdamW, zero, Precision::F32, &mut c);
                    first.offload_optimizer_windowed(&dir.join(format!("a-{r}")), 20_000).unwrap();
                    steps(&mut first, &mut m, &mut c, 0..2);
                    let params = first.full_params(&mut c).unwrap();
                    let state = first.full_optimizer_state(&mut c, true).unwrap();
                    let n_updates = first.optimizer().n_updates();
                    drop(first);
                    let (mut m, mut resumed) = trainer(Opt::AdamW, zero, Precision::F32, &mut c);
                    resumed.offload_optimizer_windowed(&dir.join(format!("b-{r}")), 20_000).unwrap();
                    let get = |name: &str| state.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
                    resumed.restore(params, 2, n_updates, get).unwrap();
                    steps(&mut resumed, &mut m, &mut c, 2..4);
                    let a = straight.full_params(&mut c).unwrap();
                    let b = resumed.full_params(&mut c).unwrap();
                    (bits(&a), bits(&b))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, b) in out {
        assert_eq!(a, b);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn single() -> (Gpt, Trainer) {
    trainer(Opt::AdamW, ZeroConfig::default(), Precision::F32, &mut comm::SingleProcess::new())
}

#[test]
fn io_failures_are_errors_naming_the_file() {
    let base = scratch("errors");
    std::fs::create_dir_all(&base).unwrap();
    // Unwritable folder: its parent is a regular file.
    let file = base.join("not-a-folder");
    std::fs::write(&file, b"x").unwrap();
    let (_, mut tr) = single();
    let err = tr.offload_optimizer(&file.join("rank-0")).unwrap_err();
    assert!(matches!(err, EngineError::Offload { .. }), "{err}");
    assert!(err.to_string().contains("not-a-folder"), "{err}");

    // Short read: a state file cut short under a running trainer.
    let (mut m, mut tr) = single();
    let dir = base.join("short");
    tr.offload_optimizer(&dir).unwrap();
    std::fs::OpenOptions::new().write(true).open(dir.join("exp_avg.f32")).unwrap().set_len(100).unwrap();
    let err = tr.step(&mut m, &mut comm::SingleProcess::new(), &[batch(0, 0, 0)]).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("exp_avg.f32") && msg.contains("too short"), "{msg}");

    // Full disk: the state file is /dev/full, so every write fails with ENOSPC.
    if Path::new("/dev/full").exists() {
        let dir = base.join("full");
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink("/dev/full", dir.join("exp_avg.f32")).unwrap();
        let (_, mut tr) = single();
        let err = tr.offload_optimizer(&dir).unwrap_err();
        let EngineError::Offload { source, .. } = &err else { panic!("{err}") };
        assert_eq!(source.raw_os_error(), Some(28), "ENOSPC expected: {err}");
        assert!(err.to_string().contains("exp_avg.f32"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&base);
}
