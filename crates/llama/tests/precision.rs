//! Mixed precision: bf16 / f16 storage of saved activations (and, under
//! f16, of activation gradients between layers) stays close to f32, halves
//! the saved activations, and trains under the engine's 16-bit parameter
//! copy and loss scaler.

mod common;
use common::{batch, fixture, loss_and_grad, rel_err};
use engine::{AdamW, LrSchedule, Model, Optimizer, Precision, Trainer, TrainerOptions};
use llama::lora::{self, LoraConfig};
use llama::{hf, Llama, LlamaConfig, TokenBatch};

#[test]
fn sixteen_bit_storage_stays_close_to_f32_and_halves_saved_activations() {
    let (cfg, params) = hf::load(&fixture("untied")).unwrap();
    let b = batch("untied");
    let mut f32_model = Llama::new(cfg.clone()).unwrap();
    let (loss32, g32) = loss_and_grad(&mut f32_model, &params, &b);
    let saved32 = f32_model.saved_activation_bytes();
    for (prec, tol) in [(Precision::Bf16, 3e-2), (Precision::F16, 4e-3)] {
        let mut model = Llama::with_precision(cfg.clone(), prec).unwrap();
        let (loss, g) = loss_and_grad(&mut model, &params, &b);
        // Each stored value is rounded to 8 (bf16) or 11 (f16) significant
        // bits: relative 2⁻⁹ ≈ 2e-3 or 2⁻¹² ≈ 2.4e-4, compounded through two
        // layers' forward and backward: measured 1.1e-2 (bf16) and 1.1e-3
        // (f16) of the gradient's scale; the tolerances leave ~3×.
        let (e_loss, e_grad) = (((loss - loss32) / loss32).abs() as f32, rel_err(&g, &g32));
        println!("{prec:?}: loss relative error {e_loss:.1e}, gradient error {e_grad:.1e} of scale");
        assert!(e_loss <= tol && e_grad <= tol, "{prec:?}: loss {e_loss:e}, gradient {e_grad:e}");
        // Large tensors in 16 bits; only the RMSNorm statistics and the
        // attention log-sum-exps (one per head and row) stay f32.
        let ratio = model.saved_activation_bytes() as f64 / saved32 as f64;
        assert!(ratio > 0.5 && ratio < 0.52, "{prec:?}: saved activations {ratio:.3} of f32's");
    }
}

#[test]
fn lora_trains_under_bf16_and_f16_with_the_engine() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let b = batch("untied");
    for prec in [Precision::F32, Precision::Bf16, Precision::F16] {
        let mut model = Llama::with_lora(cfg.clone(), LoraConfig::new(4, 8.0, &["all-linear"]), prec).unwrap();
        model.set_trainable(&|t| lora::is_adapter(&t.name));
        let params = lora::attach(&model, &base, 1).unwrap();
        let opt = Optimizer::AdamW(AdamW::new(params.len(), 0.9, 0.95, 1e-8, 0.0).unwrap());
        let options = TrainerOptions { precision: prec, grad_clip: Some(1.0), ..TrainerOptions::default() };
        let mut tr = Trainer::new(&model, params, opt, LrSchedule::constant(1e-2), options).unwrap();
        let mut losses = Vec::new();
        for _ in 0..6 {
            let r = tr.step(&mut model, &mut comm::SingleProcess::new(), std::slice::from_ref(&b)).unwrap();
            losses.push(r.loss);
        }
        // Fitting one batch: the adapters alone bring the loss down.
        println!("{prec:?}: losses {losses:?}");
        assert!(losses.iter().all(|l| l.is_finite()) && losses[5] < losses[0] - 0.1, "{prec:?}: {losses:?}");
        // The 16-bit copy the model read is current: a trainer built on the
        // trained parameters (its copy encoded whole) gives the same loss
        // bits as this one, whose updates re-encoded only the adapters.
        let fresh_opt = Optimizer::AdamW(AdamW::new(tr.params().len(), 0.9, 0.95, 1e-8, 0.0).unwrap());
        let mut fresh =
            Trainer::new(&model, tr.params().to_vec(), fresh_opt, LrSchedule::constant(1e-2), options).unwrap();
        let mut single = comm::SingleProcess::new();
        let (after, again) =
            (tr.loss(&mut model, &mut single, &b).unwrap(), fresh.loss(&mut model, &mut single, &b).unwrap());
        assert_eq!(after.loss_sum.to_bits(), again.loss_sum.to_bits(), "{prec:?}: stale 16-bit copy");
        // The frozen base did not move.
        for t in model.layout().tensors().iter().filter(|t| !t.trainable).take(3) {
            let b0 = Llama::new(cfg.clone()).unwrap();
            assert_eq!(&tr.params()[t.range()], &base[b0.layout().get(&t.name).unwrap().range()], "{}", t.name);
        }
    }
}

#[test]
fn gradients_are_bit_identical_for_any_thread_count() {
    // Every reduction has a fixed order (docs/contract.md: same seed ⇒ same
    // bits). Shapes large enough that gemm splits its work across threads.
    let cfg = LlamaConfig {
        vocab_size: 512,
        hidden_size: 256,
        intermediate_size: 688,
        n_head: 8,
        n_kv_head: 4,
        head_dim: 32,
        max_position_embeddings: 64,
        ..LlamaConfig::preset("tiny").unwrap()
    };
    let b = TokenBatch {
        n_seqs: 2,
        seq_len: 64,
        inputs: (0..128).map(|i| (i * 37 % 512) as u32).collect(),
        targets: (0..128).map(|i| if i % 9 == 0 { -100 } else { i * 41 % 512 }).collect(),
        positions: Vec::new(),
    };
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let lora = LoraConfig::new(4, 8.0, &["all-linear"]);
            let mut model = Llama::with_lora(cfg.clone(), lora, Precision::F32).unwrap();
            let mut params = model.init_params(1);
            params.iter_mut().for_each(|x| *x += 0.01); // non-zero B: every path carries gradient
            loss_and_grad(&mut model, &params, &b)
        })
    };
    let (loss1, g1) = run(1);
    for threads in [2, 3, 8] {
        let (loss, g) = run(threads);
        assert_eq!(loss.to_bits(), loss1.to_bits(), "{threads} threads: loss");
        assert!(g.iter().zip(&g1).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads: gradient");
    }
}

/// The memory planner's figure is exact: for every precision, with and
/// without adapters, it equals what a training micro-step allocates.
#[test]
fn planned_activation_bytes_equal_the_allocation() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let b = batch("untied");
    for prec in [Precision::F32, Precision::Bf16, Precision::F16] {
        for lora in [None, Some(LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "down_proj"]))] {
            let mut model = match &lora {
                None => Llama::with_precision(cfg.clone(), prec).unwrap(),
                Some(l) => Llama::with_lora(cfg.clone(), l.clone(), prec).unwrap(),
            };
            let params = if lora.is_some() { lora::attach(&model, &base, 1).unwrap() } else { base.clone() };
            loss_and_grad(&mut model, &params, &b);
            let want = model.activation_bytes() as u128;
            assert_eq!(model.planned_activation_bytes(b.n_seqs, b.seq_len), want, "{prec:?} lora {}", lora.is_some());
        }
    }
}

/// Activation checkpointing: recomputed layers (or, selectively, the
/// tensors a layer dropped) give bit-identical losses and gradients in
/// every precision, with and without adapters, and the saved activations
/// shrink; the planner's figure stays exact.
#[test]
fn recomputed_layers_give_bit_identical_gradients_and_exact_plans() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let b = batch("untied");
    for prec in [Precision::F32, Precision::Bf16, Precision::F16] {
        for lora in [None, Some(LoraConfig::new(4, 8.0, &["all-linear"]))] {
            let make = |ck| {
                let m = match &lora {
                    None => Llama::with_precision(cfg.clone(), prec).unwrap(),
                    Some(l) => Llama::with_lora(cfg.clone(), l.clone(), prec).unwrap(),
                };
                m.with_checkpointing(ck)
            };
            let mut plain = make(engine::Checkpointing::None);
            let params = if lora.is_some() { lora::attach(&plain, &base, 1).unwrap() } else { base.clone() };
            let (l0, g0) = loss_and_grad(&mut plain, &params, &b);
            let modes = [
                engine::Checkpointing::Blocks,
                engine::Checkpointing::EveryK(2),
                engine::Checkpointing::Attention,
                engine::Checkpointing::Selective,
            ];
            for ck in modes {
                let mut m = make(ck);
                let (l, g) = loss_and_grad(&mut m, &params, &b);
                assert_eq!(l.to_bits(), l0.to_bits(), "{prec:?} {ck}: loss");
                let differ = g.iter().zip(&g0).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                assert_eq!(differ, 0, "{prec:?} {ck} lora {}: {differ} gradient elements differ", lora.is_some());
                assert_eq!(m.planned_activation_bytes(b.n_seqs, b.seq_len), m.activation_bytes() as u128);
                // Logits of a forward-only pass (one shared slot) are unchanged too.
                assert_eq!(m.logits(&params, &b).unwrap(), plain.logits(&params, &b).unwrap());
            }
        }
    }
}
