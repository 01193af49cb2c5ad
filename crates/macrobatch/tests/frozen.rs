//! `train.trainable`: a run that trains only the last block holds gradient
//! and optimizer memory for that block alone, leaves the rest bit-identical,
//! and rejects a pattern that names nothing before creating its folder.

mod common;

use common::*;

/// Parameters of one block of the `SMALL` shape (d = 64): 2 LayerNorms
/// (4·64), c_attn (64·192 + 192), attn c_proj (64·64 + 64), c_fc
/// (64·256 + 256), mlp c_proj (256·64 + 64).
const BLOCK: usize = 4 * 64 + 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64;

#[test]
fn freezing_all_but_the_last_block_allocates_state_for_that_block_only() {
    let (full_dir, frozen_dir) = (tmp("frozen-full"), tmp("frozen-last"));
    let mut sets = SMALL.to_vec();
    sets.extend(["train.steps=3", "train.eval_every=0", "optim.weight_decay=0", "train.grad_clip=0"]);
    let o = train(&full_dir, &sets);
    assert!(o.status.success(), "{}", stderr(&o));
    sets.push("train.trainable=[\"transformer.h.1.*\"]");
    let o = train(&frozen_dir, &sets);
    assert!(o.status.success(), "{}", stderr(&o));
    let (full, frozen) = (metrics(&full_dir), metrics(&frozen_dir));
    let mem = |m: &serde_json::Value, k: &str| m[k].as_u64().unwrap() as usize;
    // Gradients: 4 B per trainable parameter; AdamW: 8 B (m and v).
    assert_eq!(mem(&frozen[0], "mem_grads"), 4 * BLOCK);
    assert_eq!(mem(&frozen[0], "mem_optimizer"), 8 * BLOCK);
    assert!(mem(&full[0], "mem_grads") > 2 * mem(&frozen[0], "mem_grads"));
    // The frozen tensors are the initial ones, bit for bit; the last block
    // moved. (Equality of the trainable part with a full run whose frozen
    // updates are discarded is engine::conformance::check_frozen, which GPT-2
    // passes in crates/gpt/tests/conformance.rs.)
    let (wf, wz) = (weights(&full_dir), weights(&frozen_dir));
    // The initial parameters: the saved shape, the default seed.
    let (shape, _) = gpt::hf::load(&frozen_dir).unwrap();
    let w0 = gpt::init_params(&shape, 1337);
    let n = w0.len();
    let last_block = n - 2 * 64 - BLOCK..n - 2 * 64;
    assert_eq!(&wz[..last_block.start], &w0[..last_block.start], "frozen embeddings and block 0 unchanged");
    assert_eq!(&wz[last_block.end..], &w0[last_block.end..], "frozen ln_f unchanged");
    assert_ne!(&wz[last_block.clone()], &w0[last_block.clone()], "the trainable block moved");
    assert_ne!(&wf[..last_block.start], &w0[..last_block.start], "the full run moves everything");
    for d in [full_dir, frozen_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn a_trainable_pattern_that_names_nothing_is_an_error_before_any_output() {
    let out = tmp("frozen-typo");
    let o = train(&out, &["train.trainable=[\"transformer.h.9.*\"]", "train.steps=1"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("transformer.h.9.*"), "{}", stderr(&o));
    assert!(!out.exists(), "nothing created");
}
