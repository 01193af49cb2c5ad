//! The pipeline checks of a model on the Llama block (engine's
//! `conformance::pipeline`), shared by Llama's and Qwen2's tests: the
//! layouts P ∈ {2, 4} × {1F1B, GPipe} × data-parallel {1, 2} × f32/bf16 ×
//! checkpointing off/on, and ZeRO-1, each against the model uncut.

use super::suite;
use engine::conformance::pipeline::{check_all_layouts, check_context_layouts, check_tensor_layouts, PipelineCase};
use engine::conformance::TokenSamples;
use engine::rng::SplitMix64;
use engine::{Checkpointing, Model, Precision, TpRank};
use llama::{Llama, LlamaConfig, LoraConfig};

fn init(cfg: &LlamaConfig, lora: Option<&LoraConfig>) -> Vec<f32> {
    let model = Llama::tensor_parallel(cfg.clone(), lora.cloned(), Precision::F32, TpRank::WHOLE);
    let mut p = model.expect("valid config").init_params(3);
    let mut rng = SplitMix64::new(15);
    p.iter_mut().for_each(|x| *x += (rng.normal() * 0.3) as f32);
    p
}

/// Every layout of `cfg` (at least 4 layers) against uncut; with an
/// untied head each must be bit-identical.
pub fn matrix(cfg: LlamaConfig) {
    matrix_with_loss_chunk(cfg, None)
}

/// [`matrix`] with the loss over chunks of at most `loss_chunk` rows
/// (`None`: the default), uncut and on the last stage alike.
pub fn matrix_with_loss_chunk(cfg: LlamaConfig, loss_chunk: Option<usize>) {
    let tied = cfg.tie_word_embeddings;
    let c = cfg.clone();
    let build = move |p: Precision, ck: Checkpointing, _: TpRank| {
        Llama::with_precision(c.clone(), p).expect("valid config").with_checkpointing(ck).with_loss_chunk(loss_chunk)
    };
    let seqs = TokenSamples::new(48, suite::T, suite::V as u64, 9);
    let case = PipelineCase { model: &build, init: init(&cfg, None), seqs: &seqs };
    check_all_layouts(&case, 1e-6, 1e-5, !tied).unwrap_or_else(|e| panic!("{e}"));
}

/// Tensor-parallel rank `tp`'s model of `cfg`, with `lora` adapters on a
/// frozen base if given.
fn rank_model(cfg: &LlamaConfig, lora: Option<&LoraConfig>, (p, ck): (Precision, Checkpointing), tp: TpRank) -> Llama {
    let mut m = Llama::tensor_parallel(cfg.clone(), lora.cloned(), p, tp).expect("valid split").with_checkpointing(ck);
    if lora.is_some() {
        m.set_trainable(&|t| t.name.contains(".lora_"));
    }
    m
}

/// `cfg` split over T ∈ `ts` tensor-parallel ranks (and in 3D, and at
/// ZeRO-1) against uncut, with `lora` adapters on a frozen base if given
/// (see `check_tensor_layouts`); returns the largest relative loss
/// difference. Tolerances: see the callers.
pub fn tensor_matrix(
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    ts: &[usize],
    f32_tol: (f64, f32),
    bf16_tol: (f64, f64),
) -> f64 {
    seq_matrix(cfg, lora, (None, suite::T), ts, f32_tol, bf16_tol)
}

/// [`tensor_matrix`] with sequence parallelism (`seq`: `Some(vocab)`,
/// the vocabulary split too or whole; `None`: off) on sequences of
/// `t` tokens.
pub fn seq_matrix(
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    (seq, t): (Option<bool>, usize),
    ts: &[usize],
    f32_tol: (f64, f32),
    bf16_tol: (f64, f64),
) -> f64 {
    let build = |p: Precision, ck: Checkpointing, tp: TpRank| {
        let tp = match seq {
            Some(vocab) => tp.with_seq(true).with_vocab(vocab),
            None => tp,
        };
        rank_model(&cfg, lora.as_ref(), (p, ck), tp)
    };
    let seqs = TokenSamples::new(48, t, suite::V as u64, 9);
    let case = PipelineCase { model: &build, init: init(&cfg, lora.as_ref()), seqs: &seqs };
    check_tensor_layouts(&case, f32_tol, bf16_tol, ts).unwrap_or_else(|e| panic!("{e}"))
}

/// `cfg` with the vocabulary split too (`dist.vocab_parallel`: the
/// embedding and head cut by rows) over T ∈ `ts` ranks against uncut,
/// training with `terms` and the loss over chunks of at most `chunk` rows
/// (uncut and split alike); returns the largest relative loss difference.
pub fn vocab_matrix(
    cfg: LlamaConfig,
    (terms, chunk): (engine::LossTerms, Option<usize>),
    ts: &[usize],
    f32_tol: (f64, f32),
    bf16_tol: (f64, f64),
) -> f64 {
    let c = cfg.clone();
    let build = move |p: Precision, ck: Checkpointing, tp: TpRank| {
        let m = Llama::tensor_parallel(c.clone(), None, p, tp.with_vocab(true)).expect("valid split");
        let mut m = m.with_checkpointing(ck).with_loss_chunk(chunk);
        m.set_loss_terms(terms);
        m
    };
    let seqs = TokenSamples::new(48, suite::T, suite::V as u64, 9);
    let case = PipelineCase { model: &build, init: init(&cfg, None), seqs: &seqs };
    check_tensor_layouts(&case, f32_tol, bf16_tol, ts).unwrap_or_else(|e| panic!("{e}"))
}

/// `cfg` with each sequence of `t` tokens split over C ∈ `cs`
/// context-parallel ranks (and with data, tensor and pipeline parallelism:
/// see `check_context_layouts`) against uncut, with `lora` adapters on a
/// frozen base if given; returns the largest relative loss difference and
/// the largest normwise first-gradient difference.
pub fn context_matrix(
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    (t, cs): (usize, &[usize]),
    f32_tol: (f64, f32),
    bf16_tol: (f64, f64),
) -> (f64, f64) {
    let cfg = LlamaConfig { max_position_embeddings: t, ..cfg };
    let build = |p: Precision, ck: Checkpointing, tp: TpRank| rank_model(&cfg, lora.as_ref(), (p, ck), tp);
    let seqs = TokenSamples::new(48, t, suite::V as u64, 9);
    let case = PipelineCase { model: &build, init: init(&cfg, lora.as_ref()), seqs: &seqs };
    check_context_layouts(&case, f32_tol, bf16_tol, cs).unwrap_or_else(|e| panic!("{e}"))
}
