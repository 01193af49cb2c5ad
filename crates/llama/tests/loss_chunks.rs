//! The fused head + loss over chunks of rows (`nn::shell`'s `head_loss`):
//! the logits of the whole micro-batch are never held, and what a
//! micro-step computes is that of one pass over every row.
//!
//! At a shape where every chunk's GEMMs take the `gemm` crate's blocked
//! path (more than 64 rows a chunk, width 96: no small-matrix or vector
//! path, whose summation order differs), each row's logits are the same
//! dot products in the same order whatever the chunk: the losses, the
//! terms' sums and every gradient but the head's are bit-identical in f32.
//! The head's gradient sums its rows chunk by chunk (three partial
//! products added) instead of in one GEMM: a reordering of the same 300
//! products per element, compared as the conformance suite compares
//! micro-batch splits (1e-5 of the largest value; measured ~1e-7).

mod common;

use common::suite;
use engine::conformance::TokenSamples;
use engine::{FullStore, LossTerms, MicroStepStats, Model, Precision};
use llama::{Llama, LlamaConfig};

const T: usize = 100;
const V: usize = 160;

/// One layer of width 96 (4 query heads sharing 2 key/value heads of
/// width 24) over a vocabulary of 160, head tied or not.
fn cfg(tied: bool) -> LlamaConfig {
    let (vocab_size, hidden_size, head_dim) = (V, 96, 24);
    LlamaConfig {
        vocab_size,
        hidden_size,
        head_dim,
        n_layer: 1,
        intermediate_size: 64,
        max_position_embeddings: T,
        tie_word_embeddings: tied,
        ..suite::tiny_gqa()
    }
}

/// One micro-step on three sequences of `T` (300 rows; sequence i ignores
/// its first i targets) with the loss over chunks of at most `chunk`
/// rows: its statistics, gradient and the activation bytes it held.
fn step(
    cfg: &LlamaConfig,
    precision: Precision,
    terms: LossTerms,
    chunk: Option<usize>,
) -> (MicroStepStats, Vec<f32>, usize) {
    let mut m = Llama::with_precision(cfg.clone(), precision).unwrap_or_else(|e| panic!("{e}")).with_loss_chunk(chunk);
    m.set_loss_terms(terms);
    let params: Vec<f32> = m.init_params(5).into_iter().map(|x| x * 3.0).collect();
    let batch = TokenSamples::new(3, T, V as u64, 11).batch(&[0, 1, 2]);
    let mut g = vec![0.0; m.layout().n_trainable()];
    let mut store = FullStore::for_model(&m, &params, &mut g).unwrap_or_else(|e| panic!("{e}"));
    let s = m.micro_step(&mut store, &batch, 0.5).unwrap_or_else(|e| panic!("{e}"));
    (s, g, m.activation_bytes())
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// [`cfg`] tied, with Gemma 2's pieces and its logits soft-capped at 2
/// (logits of order 1 here: the cap's factor 1 − (x/cap)² differs from 1
/// by percents): each chunk capped, and its gradient taken through the
/// cap with the terms.
fn capped() -> LlamaConfig {
    let gemma = llama::GemmaBlock { query_pre_attn_scalar: 24.0, attn_softcap: None, final_softcap: Some(2.0) };
    LlamaConfig { gemma: Some(gemma), ..cfg(true) }
}

#[test]
fn chunked_loss_is_the_whole_loss_in_f32() {
    let terms = LossTerms { label_smoothing: 0.1, z_loss: 1e-3 };
    for (name, cfg) in [("untied", cfg(false)), ("tied", cfg(true)), ("soft-capped", capped())] {
        let tied = cfg.tie_word_embeddings;
        let head = if tied { "model.embed_tokens.weight" } else { "lm_head.weight" };
        let (whole, gw, bytes_whole) = step(&cfg, Precision::F32, terms, None);
        // 300 rows: chunks of 100 (at most 110), of 75 (at most 75).
        for most in [110, 75] {
            let (chunked, gc, bytes) = step(&cfg, Precision::F32, terms, Some(most));
            let what = format!("{name}, chunks of at most {most}");
            assert_eq!(chunked.loss_sum.to_bits(), whole.loss_sum.to_bits(), "{what}: loss");
            assert_eq!(chunked.aux_sum.to_bits(), whole.aux_sum.to_bits(), "{what}: label smoothing and z-loss");
            assert_eq!(chunked.n_targets, whole.n_targets);
            let layout = Llama::new(cfg.clone()).unwrap_or_else(|e| panic!("{e}")).layout().clone();
            let mut off = 0;
            for t in layout.tensors().iter().filter(|t| t.trainable) {
                let (a, b) = (&gc[off..off + t.numel()], &gw[off..off + t.numel()]);
                off += t.numel();
                if t.name == head {
                    let tol = 1e-5 * max_abs(b);
                    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
                    assert!(worst <= tol, "{what}: {} differs by {worst:e} (tolerance {tol:e})", t.name);
                    assert!(max_abs(b) > 1e-3, "the head's gradient is not trivially small");
                } else {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{what}: {} not bit-identical", t.name);
                }
            }
            // The logits held shrink from 300 rows to one chunk's.
            let held = (300 - 300usize.div_ceil(300usize.div_ceil(most))) * V * 4;
            assert_eq!(bytes_whole - bytes, held, "{what}: logits held");
        }
    }
}

/// bf16 operands: each logit sums C = 96 products of bf16 values, exact in
/// f32, with f32 accumulation; a kernel that blocked rows differently
/// could only reorder those sums (at most 2·96·2⁻²⁴ ≈ 1.1e-5 of Σ|x·w|
/// per logit), so the loss is compared within 1e-5 relative, and the
/// whole gradient within 1e-5 of its largest value.
#[test]
fn chunked_loss_is_the_whole_loss_in_bf16() {
    // The portable kernel (bf16 rounding, f32 FMAs) where the CPU has no bf16 instructions.
    if linalg::bf16::skip_without_bf16("chunked_loss_is_the_whole_loss_in_bf16") {
        return;
    }
    let terms = LossTerms { label_smoothing: 0.1, z_loss: 1e-3 };
    let cfg = cfg(false);
    let (whole, gw, _) = step(&cfg, Precision::Bf16, terms, None);
    let (chunked, gc, _) = step(&cfg, Precision::Bf16, terms, Some(110));
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    assert!(rel(chunked.loss_sum, whole.loss_sum) <= 1e-5, "loss {} vs {}", chunked.loss_sum, whole.loss_sum);
    assert!(rel(chunked.aux_sum, whole.aux_sum) <= 1e-5, "terms {} vs {}", chunked.aux_sum, whole.aux_sum);
    let tol = 1e-5 * max_abs(&gw);
    let worst = gc.iter().zip(&gw).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(worst <= tol, "gradient differs by {worst:e} (tolerance {tol:e})");
}

/// An evaluation pass (no gradient) chunks the same way and gives the
/// training pass's loss to the bit.
#[test]
fn chunked_evaluation_is_the_training_loss() {
    let cfg = cfg(true);
    let (train, _, _) = step(&cfg, Precision::F32, LossTerms::default(), Some(110));
    let mut m = Llama::new(cfg).unwrap_or_else(|e| panic!("{e}")).with_loss_chunk(Some(75));
    let params: Vec<f32> = m.init_params(5).into_iter().map(|x| x * 3.0).collect();
    let batch = TokenSamples::new(3, T, V as u64, 11).batch(&[0, 1, 2]);
    let mut store = FullStore::read_only_for(&m, &params).unwrap_or_else(|e| panic!("{e}"));
    let eval = m.loss(&mut store, &batch).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(eval.loss_sum.to_bits(), train.loss_sum.to_bits());
}
