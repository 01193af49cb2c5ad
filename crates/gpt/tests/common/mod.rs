//! Shared by the model's integration tests.
#![allow(dead_code)]

use engine::{MicroStepStats, Model, ParamLayout, ParamStore};
use gpt::{Batch, Gpt, GptError};
use std::ops::Range;

/// A GPT whose micro-step calls `tap(store)` after the real one: to count,
/// to watch the communicator, or to inject a fault into the gradient.
pub struct Tapped<F> {
    pub inner: Gpt,
    pub tap: F,
}

impl<F: FnMut(&mut dyn ParamStore) -> Result<(), GptError>> Model for Tapped<F> {
    type Batch = Batch;
    type Error = GptError;
    fn layout(&self) -> &ParamLayout {
        self.inner.layout()
    }
    fn set_trainable(&mut self, trainable: &dyn Fn(&engine::TensorSpec) -> bool) -> usize {
        self.inner.set_trainable(trainable)
    }
    fn segments(&self) -> Vec<Range<usize>> {
        self.inner.segments()
    }
    fn n_targets(&self, b: &Batch) -> u64 {
        b.n_targets()
    }
    fn micro_step(&mut self, store: &mut dyn ParamStore, b: &Batch, s: f32) -> Result<MicroStepStats, GptError> {
        let out = self.inner.micro_step(store, b, s)?;
        (self.tap)(store)?;
        Ok(out)
    }
    fn loss(&mut self, store: &mut dyn ParamStore, b: &Batch) -> Result<MicroStepStats, GptError> {
        self.inner.loss(store, b)
    }
}

/// Two sequences of `t` + 1 random tokens below `vocab` from `seed`, as
/// one micro-batch of two rows.
pub fn two_random_sequences(seed: u64, t: usize, vocab: u64) -> Batch {
    let mut rng = engine::rng::SplitMix64::new(seed);
    let toks: Vec<u32> = (0..2 * (t + 1)).map(|_| rng.below(vocab) as u32).collect();
    let (a, b) = toks.split_at(t + 1);
    Batch {
        n_seqs: 2,
        seq_len: t,
        inputs: a[..t].iter().chain(&b[..t]).copied().collect(),
        targets: a[1..].iter().chain(&b[1..]).map(|&x| x as i32).collect(),
        positions: Vec::new(),
    }
}

/// Sequence length of [`sharding_cfg`].
pub const SHARD_T: usize = 8;

/// ~110 K parameters: tensors of several 8-bit blocks and many 16 K-element
/// offload windows, segments that divide by neither 2 nor 3, so ZeRO cuts
/// and offload windows fall inside tensors.
pub fn sharding_cfg() -> gpt::GptConfig {
    gpt::GptConfig { n_layer: 2, n_head: 2, n_embd: 62, block_size: SHARD_T, vocab_size: 257 }
}

/// Micro-batch `k` of optimizer step `step` on `rank` for [`sharding_cfg`].
pub fn sharding_batch(rank: usize, step: usize, k: usize) -> Batch {
    two_random_sequences((rank * 1000 + step * 10 + k) as u64 + 1, SHARD_T, 257)
}

/// The loss sum and gradient of one micro-step of `model` at `params` on `b`.
pub fn step(model: &mut Gpt, params: &[f32], b: &Batch) -> (f64, Vec<f32>) {
    let mut grads = vec![0.0; params.len()];
    let mut store = engine::FullStore::for_model(&*model, params, &mut grads).unwrap();
    let stats = model.micro_step(&mut store, b, 1.0).unwrap();
    drop(store);
    (stats.loss_sum, grads)
}

/// PEFT loads the base and adapters written into `dir`'s `base` and
/// `adapter` folders (transformers' `GPT2LMHeadModel`,
/// `PeftModel.from_pretrained`) and computes `model`'s logits and loss at
/// `params` on `b`, and `base_logits` without the adapters
/// (scripts/peft_check.py; its docstring explains the tolerance). Skipped,
/// with a note, where python3 with torch, transformers and peft is not
/// installed (not under `MACROBATCH_REQUIRE_PYTHON=1`, as in CI).
pub fn peft_computes(dir: &std::path::Path, (model, params): (&mut Gpt, &[f32]), base_logits: Vec<f32>, b: &Batch) {
    let mut grads = vec![0.0; params.len()];
    let stats = {
        let mut store = engine::FullStore::for_model(&*model, params, &mut grads).unwrap();
        model.loss(&mut store, b).unwrap()
    };
    let rows = |v: &[u32]| v.chunks(b.seq_len).map(<[u32]>::to_vec).collect::<Vec<_>>();
    let expected = serde_json::json!({
        "input_ids": rows(&b.inputs),
        "logits": model.logits(params, b).unwrap(),
        "base_logits": base_logits,
        "labels": b.targets.chunks(b.seq_len).collect::<Vec<_>>(),
        "loss": stats.loss_sum / stats.n_targets as f64,
    });
    let check = family::reference::peft_check(&dir.join("base"), &dir.join("adapter"), &expected);
    let Some(stdout) = check.unwrap_or_else(|e| panic!("{e}")) else { return };
    println!("{stdout}");
    assert!(stdout.contains("loss: ours"), "the loss was compared:\n{stdout}");
    std::fs::remove_dir_all(dir).unwrap();
}
