//! Mixed precision: 16-bit parameter copy and saved activations, f32 master
//! weights, and f16's dynamic loss scaler with overflow skipping.

use comm::threads::group;
use comm::Communicator;
use engine::rng::SplitMix64;
use engine::{
    AdamW, FullStore, LossScalerConfig, LrSchedule, Model, Optimizer, ParamStore, Precision, Trainer, TrainerOptions,
    ZeroConfig,
};
use gpt::{init_params, Batch, Gpt, GptConfig};
use std::time::Duration;

mod common;
use common::Tapped;

const T: usize = 8;

fn cfg() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: T, vocab_size: 32 }
}

fn batch(seed: u64, n: usize) -> Batch {
    let mut rng = SplitMix64::new(seed);
    let toks: Vec<u32> = (0..n * (T + 1)).map(|_| rng.below(32) as u32).collect();
    let mut b = Batch { n_seqs: n, seq_len: T, ..Batch::default() };
    for s in toks.chunks(T + 1) {
        b.inputs.extend_from_slice(&s[..T]);
        b.targets.extend(s[1..].iter().map(|&t| t as i32));
    }
    b
}

fn options(precision: Precision, scaler: LossScalerConfig) -> TrainerOptions {
    TrainerOptions { grad_clip: Some(1.0), precision, loss_scaler: scaler, ..Default::default() }
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_everywhere_and_changes_nothing() {
    let scaler = LossScalerConfig { initial_scale: 8.0, window: 1000, hysteresis: 1, min_scale: 1.0 };
    let comms = group(2, Duration::from_secs(30));
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let rank = c.rank();
                    let inner = Gpt::with_precision(cfg(), Precision::F16).unwrap();
                    // Rank 1 writes +inf into its gradient in micro-step 1 of step 1.
                    let at = std::cell::Cell::new((0usize, 0usize));
                    let mut model = Tapped {
                        inner,
                        tap: |st: &mut dyn ParamStore| {
                            let (step, micro) = at.get();
                            if rank == 1 && (step, micro) == (1, 1) {
                                if let Some(g) = st.segment(1)?.grads.add(0..cfg().n_embd) {
                                    g[3] = f32::INFINITY; // ln_1.weight[3] of block 0
                                }
                                st.done(1, true)?;
                            }
                            at.set((step, micro + 1));
                            Ok(())
                        },
                    };
                    let params = init_params(&cfg(), 3);
                    let opt = Optimizer::AdamW(AdamW::new(params.len(), 0.9, 0.95, 1e-8, 0.1).unwrap());
                    let sched = LrSchedule { warmup_steps: 10, total_steps: 20, ..LrSchedule::constant(1e-3) };
                    let mut tr = Trainer::distributed(
                        &model,
                        params,
                        opt,
                        sched,
                        options(Precision::F16, scaler),
                        ZeroConfig::default(),
                        &mut c,
                    )
                    .unwrap();
                    let micro =
                        |step: usize| vec![batch(10 * step as u64 + rank as u64, 2), batch(99 + step as u64, 2)];
                    let mut out = Vec::new();
                    for step in 0..3 {
                        at.set((step, 0));
                        let before = (tr.params().to_vec(), tr.optimizer().clone(), tr.n_steps(), tr.next_lr());
                        let r = tr.step(&mut model, &mut c, &micro(step)).unwrap();
                        let after = (tr.params().to_vec(), tr.optimizer().clone(), tr.n_steps(), tr.next_lr());
                        out.push((before, after, r.skipped, r.loss_scale, tr.loss_scaler().unwrap().scale));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, steps) in results.iter().enumerate() {
        let (before, after, skipped, used, now) = &steps[1];
        assert!(*skipped, "rank {rank}: the injected overflow (rank 1) skips the step on every rank");
        assert_eq!(before.0, after.0, "rank {rank}: parameters bit-identical");
        assert_eq!(before.1, after.1, "rank {rank}: optimizer moments and update count bit-identical");
        assert_eq!(before.2, after.2, "rank {rank}: the LR schedule does not advance");
        assert_eq!(before.3, after.3);
        assert_eq!((*used, *now), (8.0, 4.0), "rank {rank}: the scale halves");
        // Steps 0 and 2 are normal.
        for i in [0, 2] {
            let (b, a, skipped, _, _) = &steps[i];
            assert!(!skipped && a.2 == b.2 + 1 && a.0 != b.0, "rank {rank}: step {i} proceeds");
        }
        assert_eq!(steps[2].3, 4.0, "the next step runs at the halved scale");
    }
    assert_eq!(results[0][2].1 .0, results[1][2].1 .0, "ranks stay identical");
}

#[test]
fn the_scale_grows_after_a_window_of_good_steps() {
    let scaler = LossScalerConfig { initial_scale: 2.0, window: 3, hysteresis: 1, min_scale: 1.0 };
    let mut model = Gpt::with_precision(cfg(), Precision::F16).unwrap();
    let params = init_params(&cfg(), 3);
    let opt = Optimizer::AdamW(AdamW::new(params.len(), 0.9, 0.95, 1e-8, 0.1).unwrap());
    let mut tr =
        Trainer::new(&model, params, opt, LrSchedule::constant(1e-3), options(Precision::F16, scaler)).unwrap();
    let mut scales = Vec::new();
    for step in 0..7 {
        let r = tr.step(&mut model, &mut comm::SingleProcess::new(), &[batch(step, 2)]).unwrap();
        assert!(!r.skipped);
        scales.push(r.loss_scale);
    }
    assert_eq!(scales, vec![2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 8.0]);
}

#[test]
fn saved_activations_and_the_parameter_copy_halve() {
    let b = batch(1, 4);
    let params = init_params(&cfg(), 3);
    let mut saved = Vec::new();
    let mut losses = Vec::new();
    for p in [Precision::F32, Precision::Bf16, Precision::F16] {
        let mut m = Gpt::with_precision(cfg(), p).unwrap();
        let mut g = vec![0.0; params.len()];
        let s = m.micro_step(&mut FullStore::for_model(&m, &params, &mut g).unwrap(), &b, 1.0).unwrap();
        saved.push(m.saved_activation_bytes());
        losses.push(s.loss_sum / s.n_targets as f64);
        let opt = Optimizer::AdamW(AdamW::new(params.len(), 0.9, 0.95, 1e-8, 0.1).unwrap());
        let tr =
            Trainer::new(&m, params.clone(), opt, LrSchedule::constant(1e-3), options(p, Default::default())).unwrap();
        let mem = tr.memory();
        match p {
            Precision::F32 => assert_eq!((mem.params, mem.master), (4 * params.len(), 0)),
            _ => assert_eq!((mem.params, mem.master), (2 * params.len(), 4 * params.len()), "16-bit copy + f32 master"),
        }
    }
    // The saved tensors are 16-bit; only the per-row LayerNorm statistics
    // and the attention's log-sum-exp per head and row stay f32.
    let stats = 4 * (4 + cfg().n_head) * b.n_seqs * T * cfg().n_layer;
    assert_eq!(saved[1], (saved[0] - stats) / 2 + stats, "bf16 halves the saved activations");
    assert_eq!(saved[2], saved[1]);
    // Rounding to 16 bits changes the loss only in its 3rd–4th digit (bf16 keeps 8 bits).
    assert!((losses[1] - losses[0]).abs() < 1e-2 * losses[0], "{losses:?}");
    assert!((losses[2] - losses[0]).abs() < 2e-3 * losses[0], "{losses:?}");
}
