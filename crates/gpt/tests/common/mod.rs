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
