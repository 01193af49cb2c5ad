//! GPT-2 split over T tensor-parallel ranks (Megatron-LM: each rank holds
//! n_head / T heads of every block and 4C / T MLP columns) trains the same
//! steps as uncut (engine's `conformance::pipeline::check_tensor_layouts`):
//! T ∈ {2, 4} × f32/bf16 × checkpointing off/on, 3D (P 2 × T 2 × D 2)
//! and T 2 × D 2 at ZeRO-1; with LoRA and DoRA adapters too.
//!
//! Tolerance: as Llama's (`crates/llama/tests/tensor.rs`) — a row-parallel
//! product is T partial products summed by the all-reduce, so sums are
//! reordered: losses within 1e-6 relative, parameters within 1e-5 of the
//! largest after 3 AdamW steps; 16-bit runs (bf16 operands, f16 storage
//! with its dynamic loss scale) compare the first step's loss and each
//! tensor's gradient (`FIRST_STEP_16BIT`, derived in the engine), as
//! Llama's. (The 3D layout also cuts the tied embedding across stages: the
//! pipeline suite's own reordering.)

use engine::conformance::pipeline::{check_tensor_layouts, PipelineCase};
use engine::conformance::TokenSamples;
use engine::rng::SplitMix64;
use engine::Model;
use engine::{Checkpointing, Precision, TpRank};
use family::Family;
use gpt::{init_params, Gpt, Gpt2, GptConfig};
use nn::lora::LoraConfig;

const T: usize = 8;

fn cfg() -> GptConfig {
    GptConfig { n_layer: 4, n_head: 4, n_embd: 16, block_size: T, vocab_size: 32 }
}

fn model(p: Precision, ck: Checkpointing, tp: TpRank) -> Gpt {
    Gpt::tensor_parallel(cfg(), p, tp).expect("valid split").with_checkpointing(ck)
}

/// Every tensor layout of the suite with the model `build` makes against
/// uncut (tolerances: the module's).
fn split_matches_uncut(build: &(dyn Fn(Precision, Checkpointing, TpRank) -> Gpt + Sync)) {
    split_matches_uncut_at(build, T);
}

/// [`split_matches_uncut`] on sequences of `t` tokens.
fn split_matches_uncut_at(build: &(dyn Fn(Precision, Checkpointing, TpRank) -> Gpt + Sync), t: usize) {
    let mut init = init_params(&cfg(), 3);
    let mut rng = SplitMix64::new(15);
    init.iter_mut().for_each(|x| *x += (rng.normal() * 0.3) as f32);
    let seqs = TokenSamples::new(48, t, 32, 9);
    let case = PipelineCase { model: build, init, seqs: &seqs };
    let worst = check_tensor_layouts(&case, (1e-6, 1e-5), engine::conformance::pipeline::FIRST_STEP_16BIT, &[2, 4])
        .unwrap_or_else(|e| panic!("{e}"));
    println!("largest relative loss difference vs uncut: {worst:e}");
}

#[test]
fn gpt2_split_over_tensor_ranks_matches_uncut() {
    split_matches_uncut(&model);
}

/// The vocabulary split over the ranks too (`dist.vocab_parallel`): the
/// tied embedding and head cut by rows, each token's embedding from the
/// rank holding it, the softmax's statistics summed over the group — the
/// same steps as uncut (tolerances as above: see Llama's test of the same).
#[test]
fn gpt2_with_the_vocabulary_split_matches_uncut() {
    split_matches_uncut(&|p, ck, tp: TpRank| model(p, ck, tp.with_vocab(true)));
    let rank = model(Precision::F32, Checkpointing::None, TpRank::new(1, 4).with_vocab(true));
    let wte = rank.layout().tensors().iter().find(|t| t.name == "transformer.wte.weight").map(|t| t.shape.clone());
    assert_eq!(wte, Some(vec![8, 16]), "rank 1 of 4 holds 8 of the 32 rows");
    let odd = GptConfig { vocab_size: 33, ..cfg() };
    let e = Gpt::tensor_parallel(odd, Precision::F32, TpRank::new(0, 2).with_vocab(true)).unwrap_err().to_string();
    assert!(e.contains("model.vocab_size") && e.contains("(33)") && e.contains("34"), "{e}");
}

/// Sequence parallelism (`dist.sequence_parallel`): each rank holds its
/// rows of the residual stream (the embedding's output, the LayerNorms,
/// the residual additions, the final norm), gathered before each
/// column-parallel projection and reduce-scattered after each row-parallel
/// one — with the vocabulary whole (the head's input gathered, its input
/// gradient the rank's rows of the same whole one) and split, on
/// sequences of 8 tokens and of 7 (micro-batches of 7·B rows: blocks of
/// ⌈7B / T⌉, the last rank's shorter, the collectives padded). The same
/// steps as uncut within the module's tolerances: the reduce-scatter's
/// sums are the all-reduce's, and the one new reordering is each
/// LayerNorm's gradient, summed per rank and then over the group
/// ([`engine::Shard::Partial`]) instead of over all rows at once.
#[test]
fn gpt2_with_sequence_parallelism_matches_uncut() {
    for t in [T, T - 1] {
        split_matches_uncut_at(&|p, ck, tp: TpRank| model(p, ck, tp.with_seq(true)), t);
        split_matches_uncut_at(&|p, ck, tp: TpRank| model(p, ck, tp.with_seq(true).with_vocab(true)), t);
    }
    // Rank 1 of 4 keeps a quarter of the residual stream's rows.
    let sizes = |tp: TpRank| {
        gpt::block::ActSizes::for_rank(
            &cfg(),
            tp,
            (2, T),
            (Precision::F32, Checkpointing::None),
            nn::stack::Part::whole(4),
        )
    };
    let (plain, seq) = (sizes(TpRank::new(1, 4)), sizes(TpRank::new(1, 4).with_seq(true)));
    assert_eq!((plain.stack.x, seq.stack.x), (2 * 8 * 16, 2 * 2 * 16));
    assert!(seq.bytes() < plain.bytes(), "{} vs {}", seq.bytes(), plain.bytes());
}

/// LoRA on every layer (A and B random: every adapter acts; the base
/// frozen, as LoRA trains), LoRA with dropout on every layer (each rank
/// draws the whole layer's masks: a c_proj rank its slice's columns) and
/// DoRA on the column-parallel layers, split with their layers — `lora_B` and the
/// magnitudes with c_attn's heads and c_fc's columns, `lora_A` with the
/// c_projs' inputs (their `x·Aᵀ` summed over the group), the other factor
/// whole — train the same steps as uncut, at every layout and precision
/// of the suite (tolerances as above: the same reordered sums).
#[test]
fn gpt2_with_lora_and_dora_split_over_tensor_ranks_matches_uncut() {
    let dora = LoraConfig { use_dora: true, ..LoraConfig::new(2, 4.0, &["c_attn", "c_fc"]) };
    let dropout = LoraConfig { dropout: 0.25, ..LoraConfig::new(2, 4.0, &["all-linear"]) };
    for lora in [LoraConfig::new(2, 4.0, &["all-linear"]), dora, dropout] {
        let what = match (lora.use_dora, lora.dropout > 0.0) {
            (true, _) => "DoRA",
            (_, true) => "LoRA with dropout",
            _ => "LoRA",
        };
        let build = |p: Precision, ck: Checkpointing, tp: TpRank| {
            let mut m = Gpt::tensor_parallel_with_lora(cfg(), lora.clone(), p, tp).expect("valid split");
            m.set_trainable(&|t| nn::lora::is_adapter(&t.name));
            m.with_checkpointing(ck)
        };
        // The base as the plain test's; B and the magnitudes moved as a few
        // steps of training would (B at 0.3 like the base doubles each
        // block's dynamic range, and the f32 reordering noise with it).
        let whole = build(Precision::F32, Checkpointing::None, TpRank::WHOLE);
        let mut init = whole.init_params(3);
        let mut rng = SplitMix64::new(15);
        for t in whole.layout().tensors() {
            let sd = if !nn::lora::is_adapter(&t.name) {
                0.3
            } else if t.name.contains("lora_B") {
                0.05
            } else {
                0.0
            };
            init[t.range()].iter_mut().for_each(|x| *x += (rng.normal() * sd) as f32);
        }
        let seqs = TokenSamples::new(48, T, 32, 9);
        let case = PipelineCase { model: &build, init, seqs: &seqs };
        let first = engine::conformance::pipeline::FIRST_STEP_16BIT;
        let worst = check_tensor_layouts(&case, (1e-6, 1e-5), first, &[2, 4]).unwrap_or_else(|e| panic!("{what}: {e}"));
        println!("{what}: largest relative loss difference vs uncut: {worst:e}");
    }
    // What a split cannot compute as uncut is refused, named.
    let tp = TpRank::new(0, 2);
    let err = |l: LoraConfig| Gpt::tensor_parallel_with_lora(cfg(), l, Precision::F32, tp).unwrap_err().to_string();
    let e = err(LoraConfig { use_dora: true, ..LoraConfig::new(2, 4.0, &["c_proj"]) });
    assert!(e.contains("use_dora") && e.contains("c_proj"), "{e}");
}

#[test]
fn gpt2_refuses_a_split_that_does_not_divide_its_heads_and_sizes_a_rank() {
    let e = Gpt::tensor_parallel(cfg(), Precision::F32, TpRank::new(0, 3)).unwrap_err().to_string();
    assert!(e.contains("n_head (4)") && e.contains("dist.tensor_parallel (3)"), "{e}");
    // A rank's shape: per block 12C² + 13C parameters whole; split, the
    // matrices (12C²) and the c_attn and c_fc biases (3C + 4C) are /T, the
    // rest (LayerNorms 4C, c_proj biases 2C) whole.
    let (whole, c) = (Gpt2(cfg()), 16u128);
    let rank = whole.tensor_parallel(TpRank::new(1, 2)).unwrap_or_else(|e| panic!("{e}"));
    let per_block_saved = (12 * c * c + 7 * c) / 2;
    assert_eq!(whole.n_params() - rank.n_params(), 4 * per_block_saved);
    // Its initial values are its slices of the whole model's.
    let seg1 = rank.init_segment(7, 1);
    let local = model(Precision::F32, Checkpointing::None, TpRank::new(1, 2));
    assert_eq!(seg1.len(), engine::Model::segments(&local)[1].len());
}
