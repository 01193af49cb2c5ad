//! Activation checkpointing: recomputing blocks in backward — or, in the
//! selective modes, the tensors a block dropped — gives gradients
//! bit-identical to keeping every activation (the same kernels run on the
//! same inputs, in the same order), in every storage precision, and the
//! saved activations shrink as predicted.

use engine::rng::SplitMix64;
use engine::{Checkpointing, FullStore, Model, Precision};
use gpt::{init_params, Batch, Gpt, GptConfig};

fn cfg() -> GptConfig {
    GptConfig { n_layer: 4, n_head: 4, n_embd: 32, block_size: 16, vocab_size: 64 }
}

fn batch(seed: u64, b: usize) -> Batch {
    let t = cfg().block_size;
    let mut rng = SplitMix64::new(seed);
    let inputs: Vec<u32> = (0..b * t).map(|_| rng.below(64) as u32).collect();
    let targets = (0..b * t).map(|i| if i % 7 == 3 { -100 } else { rng.below(64) as i32 }).collect();
    Batch { n_seqs: b, seq_len: t, inputs, targets, positions: Vec::new() }
}

/// Gradient of two micro-batches (the second adding into the first), the
/// reported loss sums, and the model's saved-activation bytes.
fn grads(precision: Precision, ck: Checkpointing) -> (Vec<f32>, Vec<f64>, usize) {
    let mut model = Gpt::with_precision(cfg(), precision).unwrap().with_checkpointing(ck);
    let params = init_params(&cfg(), 7);
    let mut g = vec![0.0f32; params.len()];
    let mut losses = Vec::new();
    let mut store = FullStore::for_model(&model, &params, &mut g).unwrap();
    for seed in [1, 2] {
        losses.push(model.micro_step(&mut store, &batch(seed, 3), 0.25).unwrap().loss_sum);
    }
    drop(store);
    (g, losses, model.saved_activation_bytes())
}

#[test]
fn recomputed_blocks_give_bit_identical_gradients_in_every_precision() {
    for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
        let (g0, l0, saved0) = grads(precision, Checkpointing::None);
        let modes = [
            Checkpointing::Blocks,
            Checkpointing::EveryK(2),
            Checkpointing::EveryK(3),
            Checkpointing::Attention,
            Checkpointing::Selective,
        ];
        for ck in modes {
            let (g, l, saved) = grads(precision, ck);
            assert_eq!(l, l0, "{precision} {ck}: losses");
            let differ = g.iter().zip(&g0).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "{precision} {ck}: {differ} gradient elements differ");
            assert!(saved < saved0, "{precision} {ck}: saved {saved} >= {saved0}");
        }
    }
}

/// Per block without checkpointing: 16·C per row of saved tensors (ln1,
/// qkv 3C, atty, res2, ln2, fch 4C, gelu 4C, res3 = 16C — no T × T
/// probabilities) and 4 f32 statistics plus one attention log-sum-exp per
/// head. A recomputed block keeps its output (C per row); one full block
/// lives in the recompute slot. "attention" drops the heads' output (C
/// per row) of every block; "selective" also both LayerNorms' outputs and
/// GELU's (7C in all), keeping 9C.
#[test]
fn saved_activations_drop_as_predicted() {
    let c = cfg();
    let (n, e) = (3 * c.block_size, 4); // rows of one micro-batch; f32 bytes
    let full_block = e * n * (16 * c.n_embd + 4 + c.n_head);
    let embeddings = e * n * c.n_embd;
    let (_, _, none) = grads(Precision::F32, Checkpointing::None);
    assert_eq!(none, c.n_layer * full_block + embeddings);
    let (_, _, blocks) = grads(Precision::F32, Checkpointing::Blocks);
    assert_eq!(blocks, c.n_layer * e * n * c.n_embd + full_block + embeddings);
    let (_, _, every2) = grads(Precision::F32, Checkpointing::EveryK(2));
    assert_eq!(every2, 2 * e * n * c.n_embd + 2 * full_block + full_block + embeddings);
}

#[test]
fn selective_modes_drop_what_they_name() {
    let c = cfg();
    let (n, e) = (3 * c.block_size, 4);
    let full_block = e * n * (16 * c.n_embd + 4 + c.n_head);
    let embeddings = e * n * c.n_embd;
    let (_, _, attention) = grads(Precision::F32, Checkpointing::Attention);
    assert_eq!(attention, c.n_layer * (full_block - e * n * c.n_embd) + embeddings);
    let (_, _, selective) = grads(Precision::F32, Checkpointing::Selective);
    assert_eq!(selective, c.n_layer * (full_block - 7 * e * n * c.n_embd) + embeddings);
    // In 16 bits the dropped tensors cost 2 bytes each per block.
    let (_, _, none16) = grads(Precision::Bf16, Checkpointing::None);
    let (_, _, selective16) = grads(Precision::Bf16, Checkpointing::Selective);
    assert_eq!(none16 - selective16, c.n_layer * 2 * n * 7 * c.n_embd);
}
