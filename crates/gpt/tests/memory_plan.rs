//! The memory plan equals the engine's accounting: for every ZeRO stage,
//! precision, world size and frozen set, `Trainer::planned_memory` (computed
//! from the layout alone) reports exactly what a real trainer on rank 0
//! allocated, with the optimizer state in memory or offloaded to disk.

use comm::threads::group;
use comm::Communicator;
use engine::{AdamW, LrSchedule, Model, Optimizer, Precision, Sgd, Trainer, TrainerOptions, ZeroConfig};
use gpt::{init_params, Gpt, GptConfig};
use std::time::Duration;

fn cfg() -> GptConfig {
    // 3 blocks of 16-wide: segment lengths that do not divide by 2 or 3.
    GptConfig { n_layer: 3, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 37 }
}

#[test]
fn planned_memory_equals_what_the_trainer_allocates() {
    let zeros = [
        ZeroConfig { stage: 0, reduce_every_micro_step: false },
        ZeroConfig { stage: 1, reduce_every_micro_step: false },
        ZeroConfig { stage: 2, reduce_every_micro_step: false },
        ZeroConfig { stage: 2, reduce_every_micro_step: true },
        ZeroConfig { stage: 3, reduce_every_micro_step: false },
    ];
    let mut n_checked = 0;
    for world in [1, 2, 3] {
        for zero in zeros {
            for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
                for (frozen, sgd_slots, offload) in [
                    (false, None, false),
                    (true, None, false),
                    (false, Some(0.0f32), false),
                    (false, Some(0.9), false),
                    (false, None, true),
                    (true, None, true),
                    (false, Some(0.0f32), true),
                    (false, Some(0.9), true),
                ] {
                    let mut model = Gpt::with_precision(cfg(), precision).unwrap();
                    if frozen {
                        model.set_trainable(&|t| t.name.starts_with("transformer.h.2."));
                    }
                    let slots = match sgd_slots {
                        None => 2,
                        Some(m) if m > 0.0 => 1,
                        Some(_) => 0,
                    };
                    let bucket = engine::DEFAULT_BUCKET_ELEMS;
                    let plan = Trainer::planned_memory(&model, zero, world, precision, slots, bucket, offload).unwrap();
                    let reports: Vec<_> = std::thread::scope(|s| {
                        let handles: Vec<_> = group(world, Duration::from_secs(30))
                            .into_iter()
                            .map(|mut c| {
                                let model = &model;
                                s.spawn(move || {
                                    let params = init_params(&cfg(), 1);
                                    let n = params.len();
                                    let opt = match sgd_slots {
                                        None => Optimizer::AdamW(AdamW::new(n, 0.9, 0.95, 1e-8, 0.0).unwrap()),
                                        Some(m) => Optimizer::Sgd(Sgd::new(n, m, false, 0.0).unwrap()),
                                    };
                                    let options = TrainerOptions { precision, ..Default::default() };
                                    let sched = LrSchedule::constant(1e-3);
                                    let mut tr =
                                        Trainer::distributed(model, params, opt, sched, options, zero, &mut c).unwrap();
                                    let dir = std::env::temp_dir().join(format!(
                                        "macrobatch-memory-plan-{}-{:?}-rank-{}",
                                        std::process::id(),
                                        std::thread::current().id(),
                                        c.rank()
                                    ));
                                    if offload {
                                        tr.offload_optimizer(&dir).unwrap();
                                    }
                                    (c.rank(), tr.memory())
                                })
                            })
                            .collect();
                        handles.into_iter().map(|h| h.join().unwrap()).collect()
                    });
                    let rank0 = reports.iter().find(|(r, _)| *r == 0).unwrap().1;
                    assert_eq!(
                        plan, rank0,
                        "world {world}, {zero:?}, {precision}, frozen {frozen}, sgd {sgd_slots:?}, offload {offload}"
                    );
                    n_checked += 1;
                }
            }
        }
    }
    assert_eq!(n_checked, 3 * 5 * 3 * 8);
}
