//! A mixture under 16-bit storage and activation checkpointing: the
//! experts' dispatched tensors are kept (or dropped and recomputed) like
//! the dense MLP's, so every checkpointing mode gives the plain run's loss
//! and gradients bit for bit in every precision, and the planner's figure
//! equals the allocation. (How close 16-bit storage stays to f32 is not
//! asserted here: rounding the router's input to 16 bits moves its logits
//! by ~2^-8, enough to swap two experts whose probabilities are that
//! close, and a swap moves that row's output by the difference of two
//! experts — measured 1.6e-2 and 3.3e-2 of the largest gradient element
//! for bf16, 2.1e-3 and 3.5e-3 for f16, on this CPU's kernels.)

#[path = "../../llama/tests/common/mod.rs"]
mod common;
mod shapes;

use common::suite::UnderTest;
use engine::conformance::{step_stats_alone, ModelUnderTest};
use engine::{Checkpointing, FullStore, Model, Precision};
use llama::{Llama, LlamaConfig, TokenBatch};

fn loss_and_grad(model: &mut Llama, params: &[f32], batch: &TokenBatch) -> (f64, Vec<f32>) {
    step_stats_alone(model, params, &[batch]).unwrap_or_else(|e| panic!("{e}"));
    let mut g = vec![0.0; model.layout().n_trainable()];
    let mut store = FullStore::for_model(model, params, &mut g).unwrap_or_else(|e| panic!("{e}"));
    let s = model.micro_step(&mut store, batch, 1.0).unwrap_or_else(|e| panic!("{e}"));
    (s.loss_sum + s.aux_sum, g)
}

fn cfgs() -> [LlamaConfig; 2] {
    // Mixtral's block and Qwen2-MoE's (shared expert, its gate).
    [shapes::cfg(&mixtral::MIXTRAL), shapes::cfg(&qwen2::QWEN2_MOE)]
}

#[test]
fn recomputed_mixtures_give_bit_identical_gradients_and_exact_plans() {
    for cfg in cfgs() {
        let f = UnderTest::new(cfg.clone(), None);
        let params = f.init();
        let b = f.batch(&[0, 1, 2, 3, 4, 5]);
        for prec in [Precision::F32, Precision::Bf16, Precision::F16] {
            let make =
                |ck| Llama::with_precision(cfg.clone(), prec).unwrap_or_else(|e| panic!("{e}")).with_checkpointing(ck);
            let mut plain = make(Checkpointing::None);
            let (l0, g0) = loss_and_grad(&mut plain, &params, &b);
            assert_eq!(plain.planned_activation_bytes(b.n_seqs, b.seq_len), plain.activation_bytes() as u128);
            for ck in
                [Checkpointing::Blocks, Checkpointing::EveryK(2), Checkpointing::Attention, Checkpointing::Selective]
            {
                let mut m = make(ck);
                let (l, g) = loss_and_grad(&mut m, &params, &b);
                assert_eq!(l.to_bits(), l0.to_bits(), "{prec:?} {ck}: loss");
                let differ = g.iter().zip(&g0).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                assert_eq!(differ, 0, "{prec:?} {ck}: {differ} gradient elements differ");
                assert_eq!(
                    m.planned_activation_bytes(b.n_seqs, b.seq_len),
                    m.activation_bytes() as u128,
                    "{prec:?} {ck}"
                );
            }
        }
    }
}
