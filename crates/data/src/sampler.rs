//! The batch contract (docs/contract.md): which samples each rank's micro-step takes.
//!
//! Optimizer step `s` of an epoch takes window `[s·G, (s+1)·G)` of the epoch's
//! order; rank `r`'s micro-step `k` takes the `micro` samples starting at
//! `(k·W + r)·micro` inside it. Micro-batches are consecutive and disjoint, so
//! the set of samples of a step does not depend on how G = micro·K·W is
//! factored. Everything is a pure function of (seed, epoch, step), so a resumed
//! run needs only the global step index.

use crate::error::DataError;
use crate::mixture::Mixture;
use crate::order::{order_of, EpochOrder, LAZY_ORDER_FROM};
use std::sync::Arc;

/// How a global batch is factored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchShape {
    /// Samples per micro-batch per rank.
    pub micro: usize,
    /// Micro-steps per optimizer step (K).
    pub accumulation_steps: usize,
    /// Ranks (W).
    pub world_size: usize,
}

impl BatchShape {
    /// G = micro · K · W.
    pub fn global(&self) -> usize {
        self.micro * self.accumulation_steps * self.world_size
    }
}

/// Deterministic epoch orders and micro-batch windows.
#[derive(Debug, Clone)]
pub struct Sampler {
    n_samples: usize,
    shape: BatchShape,
    shuffle: bool,
    drop_last: bool,
    seed: u64,
    lazy_from: usize,
    /// Several sources drawn by weight (`data.sources`): the epoch order is
    /// the mixture's.
    mixture: Option<Arc<Mixture>>,
}

impl Sampler {
    /// A sampler over `n_samples` samples.
    pub fn new(
        n_samples: usize,
        shape: BatchShape,
        shuffle: bool,
        drop_last: bool,
        seed: u64,
    ) -> Result<Self, DataError> {
        for (field, v) in [
            ("batch.micro", shape.micro),
            ("batch.accumulation_steps", shape.accumulation_steps),
            ("world_size", shape.world_size),
        ] {
            if v == 0 {
                return Err(DataError::ZeroSize { field });
            }
        }
        if drop_last && n_samples < shape.global() {
            return Err(DataError::NoFullBatch { n_samples, global: shape.global() });
        }
        if n_samples == 0 {
            return Err(DataError::NoFullBatch { n_samples, global: shape.global() });
        }
        Ok(Self { n_samples, shape, shuffle, drop_last, seed, lazy_from: LAZY_ORDER_FROM, mixture: None })
    }

    /// The same sampler with epoch orders drawn from `mixture`'s sources
    /// (which must hold this sampler's `n_samples`; `None`: unchanged).
    pub fn with_mixture(mut self, mixture: Option<Mixture>) -> Self {
        debug_assert!(mixture.as_ref().is_none_or(|m| m.n_samples() == self.n_samples));
        self.mixture = mixture.map(Arc::new);
        self
    }

    /// The mixture it draws from, if any.
    pub fn mixture(&self) -> Option<&Mixture> {
        self.mixture.as_deref()
    }

    /// Samples each source of the mixture has given before global step
    /// `step_idx` (`None` without a mixture): what a checkpoint records.
    pub fn mixture_drawn(&self, step_idx: u64) -> Option<Vec<u64>> {
        let (epoch, step) = self.position(step_idx);
        let at = (step * self.shape.global()).min(self.n_samples);
        self.mixture.as_ref().map(|m| m.drawn(self.seed, epoch, at, self.shuffle))
    }

    /// The same sampler computing orders index by index from `n` samples on
    /// (tests use a small `n`; the default is [`LAZY_ORDER_FROM`]).
    pub fn with_lazy_order_from(mut self, n: usize) -> Self {
        self.lazy_from = n;
        self
    }

    /// The batch factorization.
    pub fn shape(&self) -> BatchShape {
        self.shape
    }

    /// Optimizer steps per epoch (the partial tail counts when `drop_last` is off).
    pub fn steps_per_epoch(&self) -> usize {
        let g = self.shape.global();
        if self.drop_last {
            self.n_samples / g
        } else {
            self.n_samples.div_ceil(g)
        }
    }

    /// (epoch, step within the epoch) of a global step index.
    pub fn position(&self, step_idx: u64) -> (u64, usize) {
        let spe = self.steps_per_epoch() as u64;
        (step_idx / spe, (step_idx % spe) as usize)
    }

    /// The sample order of an epoch: a permutation from (seed, epoch), or the
    /// identity without shuffling.
    pub fn epoch_order(&self, epoch: u64) -> EpochOrder {
        match &self.mixture {
            Some(m) => m.epoch_order(self.seed, epoch, self.shuffle, self.lazy_from),
            None => order_of(self.n_samples, self.shuffle, self.seed, epoch, self.lazy_from),
        }
    }

    /// Samples of rank `rank`'s micro-step `micro_step_idx` in step
    /// `step_in_epoch` (empty or short only in the tail with `drop_last` off).
    pub fn micro_batch(
        &self,
        order: &EpochOrder,
        step_in_epoch: usize,
        micro_step_idx: usize,
        rank: usize,
    ) -> Vec<usize> {
        let g = self.shape.global();
        let window_end = ((step_in_epoch + 1) * g).min(order.len());
        let start = step_in_epoch * g + (micro_step_idx * self.shape.world_size + rank) * self.shape.micro;
        let (lo, hi) = (start.min(window_end), (start + self.shape.micro).min(window_end));
        (lo..hi).map(|i| order.get(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::rng::SplitMix64;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn step_samples(s: &Sampler, order: &EpochOrder, step: usize) -> Vec<usize> {
        let sh = s.shape();
        let mut all = Vec::new();
        for k in 0..sh.accumulation_steps {
            for r in 0..sh.world_size {
                all.extend(s.micro_batch(order, step, k, r));
            }
        }
        all
    }

    fn listed(o: &EpochOrder) -> Vec<usize> {
        (0..o.len()).map(|i| o.get(i)).collect()
    }

    proptest! {
        /// Every sample is used exactly once per epoch without drop_last, and
        /// no micro-batches overlap.
        #[test]
        fn covers_every_sample_once(n in 1usize..300, micro in 1usize..5, k in 1usize..5, w in 1usize..4, seed: u64, lazy: bool) {
            let s = Sampler::new(n, BatchShape { micro, accumulation_steps: k, world_size: w }, true, false, seed).unwrap();
            // The per-index permutation (large data sets) keeps the contract too.
            let s = if lazy { s.with_lazy_order_from(1) } else { s };
            let order = s.epoch_order(3);
            let mut seen = Vec::new();
            for step in 0..s.steps_per_epoch() {
                seen.extend(step_samples(&s, &order, step));
            }
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }

        /// The keyed permutation is a bijection of 0..n for any n and key,
        /// and different epochs give different orders.
        #[test]
        fn permutation_is_a_bijection(n in 1usize..5000, seed: u64) {
            let s = Sampler::new(n, BatchShape { micro: 1, accumulation_steps: 1, world_size: 1 }, true, false, seed)
                .unwrap()
                .with_lazy_order_from(1);
            let o = s.epoch_order(0);
            prop_assert!(matches!(o, EpochOrder::Permuted(_)));
            let mut v = listed(&o);
            if n > 8 {
                prop_assert_ne!(&v, &listed(&s.epoch_order(1)));
            }
            v.sort_unstable();
            prop_assert_eq!(v, (0..n).collect::<Vec<_>>());
        }

        /// The set of samples of a step does not depend on how G is factored.
        #[test]
        fn step_set_independent_of_factorization(seed: u64, step in 0usize..4, drop_last: bool) {
            let n = 200;
            let shapes = [(24, 1, 1), (12, 2, 1), (6, 2, 2), (1, 6, 4), (3, 8, 1), (2, 3, 4)];
            let mut sets = Vec::new();
            for (micro, k, w) in shapes {
                let s = Sampler::new(n, BatchShape { micro, accumulation_steps: k, world_size: w }, true, drop_last, seed).unwrap();
                let order = s.epoch_order(0);
                let v = step_samples(&s, &order, step);
                let set: BTreeSet<usize> = v.iter().copied().collect();
                prop_assert_eq!(set.len(), v.len());
                sets.push(set);
            }
            for s in &sets[1..] {
                prop_assert_eq!(s, &sets[0]);
            }
        }
    }

    #[test]
    fn drop_last_drops_the_tail_and_epochs_reshuffle() {
        let shape = BatchShape { micro: 2, accumulation_steps: 2, world_size: 1 };
        let s = Sampler::new(10, shape, true, true, 1).unwrap();
        assert_eq!(s.steps_per_epoch(), 2);
        assert_eq!(s.position(5), (2, 1));
        assert_ne!(listed(&s.epoch_order(0)), listed(&s.epoch_order(1)));
        assert_eq!(listed(&s.epoch_order(1)), listed(&s.epoch_order(1)));
        let keep = Sampler::new(10, shape, false, false, 1).unwrap();
        assert_eq!(keep.steps_per_epoch(), 3);
        let order = keep.epoch_order(0);
        assert_eq!(keep.micro_batch(&order, 2, 0, 0), [8, 9]);
        assert!(keep.micro_batch(&order, 2, 1, 0).is_empty(), "tail micro-step has no data");
        assert!(matches!(Sampler::new(3, shape, true, true, 1), Err(DataError::NoFullBatch { .. })));
    }

    /// Small data sets keep the order they always had (a Fisher–Yates
    /// shuffle from (seed, epoch)): runs on them are unchanged.
    #[test]
    fn small_data_sets_keep_their_shuffle() {
        let s =
            Sampler::new(100, BatchShape { micro: 2, accumulation_steps: 1, world_size: 1 }, true, true, 7).unwrap();
        let mut want: Vec<usize> = (0..100).collect();
        SplitMix64::derive(7, &[0x5a3d, 2]).shuffle(&mut want);
        assert_eq!(listed(&s.epoch_order(2)), want);
    }
}
