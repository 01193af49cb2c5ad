//! Several data sources as one (`data.sources`): the epoch order that
//! draws from them by weight ([`Mixture`]; their samples laid end to end
//! are [`crate::Mixed`]).
//!
//! **An epoch of a mixture** is N = Σ nᵢ draws (nᵢ: source i's samples).
//! Source i gets a quota qᵢ of them: N·wᵢ/Σw rounded by largest remainder
//! (ties to the lower index), so the quotas sum to N and every epoch's
//! proportions are the weights' to within one sample per source. Which
//! draw goes to which source is a Fisher–Yates shuffle of the quota
//! multiset keyed by (seed, epoch) — realised proportions over part of an
//! epoch are hypergeometric, whose variance is below the binomial's of
//! independent draws — or, without `data.shuffle`, a smooth weighted
//! round-robin (each draw to the source furthest behind its quota).
//!
//! **Within a source** draws continue across epochs: the c-th draw of
//! source i overall (c = epoch·qᵢ + draws so far this epoch) takes element
//! c mod nᵢ of the source's pass ⌊c / nᵢ⌋, a shuffled order of its samples
//! keyed by (seed, i, pass) as a single data set's epochs are. A source
//! with qᵢ > nᵢ is repeated within an epoch; one with qᵢ < nᵢ is walked
//! through over several, never restarting from its beginning.
//!
//! Everything is a pure function of (seed, epoch), as the sampler is
//! (docs/contract.md): a run resumed at step s draws what an uninterrupted
//! one draws. [`Mixture::drawn`] says how many samples each source has
//! given before a step, which checkpoints record.

use crate::error::DataError;
use crate::order::{order_of, round_robin, EpochOrder};
use engine::rng::SplitMix64;

/// Stream tag of the per-epoch source shuffle.
const MIX_STREAM: u64 = 0x6d69_7865;
/// Stream tag of the per-source seeds.
const SOURCE_STREAM: u64 = 0x736f_7572;

/// How a mixture draws from its sources (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Mixture {
    sizes: Vec<usize>,
    starts: Vec<usize>,
    quotas: Vec<usize>,
}

impl Mixture {
    /// Sources of `sizes` samples drawn by `weights` (finite, > 0). Errors
    /// when a source's quota rounds to no draw per epoch (naming it by
    /// `names[i]`) or a source is empty.
    pub fn new(sizes: &[usize], weights: &[f64], names: &[String]) -> Result<Self, DataError> {
        let total: usize = sizes.iter().sum();
        let sum_w: f64 = weights.iter().sum();
        let exact: Vec<f64> = weights.iter().map(|w| total as f64 * w / sum_w).collect();
        let mut quotas: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
        let mut by_remainder: Vec<usize> = (0..sizes.len()).collect();
        // Largest remainder first; `sort_by` is stable, so ties keep the lower index first.
        by_remainder.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
        let short = total.saturating_sub(quotas.iter().sum());
        for &i in by_remainder.iter().take(short) {
            quotas[i] += 1;
        }
        for (i, (&n, &q)) in sizes.iter().zip(&quotas).enumerate() {
            let name = names.get(i).map_or("?", String::as_str);
            if n == 0 {
                return Err(DataError::Mixture { problem: format!("data.sources[{i}] ({name}) holds no sample") });
            }
            if q == 0 {
                return Err(DataError::Mixture {
                    problem: format!(
                        "data.sources[{i}] ({name}) at weight {} of {sum_w} would be drawn 0 times in an epoch of {total} samples; raise its weight",
                        weights[i]
                    ),
                });
            }
        }
        let mut starts = vec![0];
        for &n in sizes {
            starts.push(starts[starts.len() - 1] + n);
        }
        Ok(Self { sizes: sizes.to_vec(), starts, quotas })
    }

    /// Samples in an epoch (N = Σ nᵢ).
    pub fn n_samples(&self) -> usize {
        self.starts[self.sizes.len()]
    }

    /// Draws of each source per epoch.
    pub fn quotas(&self) -> &[usize] {
        &self.quotas
    }

    /// The source of each of the epoch's N draws.
    fn slots(&self, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
        if !shuffle {
            return round_robin(&self.quotas);
        }
        let mut slots: Vec<usize> =
            self.quotas.iter().enumerate().flat_map(|(i, &q)| std::iter::repeat_n(i, q)).collect();
        SplitMix64::derive(seed, &[MIX_STREAM, epoch]).shuffle(&mut slots);
        slots
    }

    /// The order of `epoch`: N global indices (source i's sample j is
    /// `starts[i] + j`), each source drawn as the module docs say; orders of
    /// a source's passes are computed per index from `lazy_from` samples on.
    pub fn epoch_order(&self, seed: u64, epoch: u64, shuffle: bool, lazy_from: usize) -> EpochOrder {
        let mut drawn: Vec<u64> = self.quotas.iter().map(|&q| epoch * q as u64).collect();
        let mut passes: Vec<Option<(u64, EpochOrder)>> = vec![None; self.sizes.len()];
        let mut out = Vec::with_capacity(self.n_samples());
        for i in self.slots(seed, epoch, shuffle) {
            let n = self.sizes[i] as u64;
            let (pass, k) = (drawn[i] / n, (drawn[i] % n) as usize);
            drawn[i] += 1;
            if passes[i].as_ref().is_none_or(|(p, _)| *p != pass) {
                let source_seed = SplitMix64::derive(seed, &[SOURCE_STREAM, i as u64]).next_u64();
                passes[i] = Some((pass, order_of(self.sizes[i], shuffle, source_seed, pass, lazy_from)));
            }
            if let Some((_, order)) = &passes[i] {
                out.push(self.starts[i] + order.get(k));
            }
        }
        EpochOrder::List(out)
    }

    /// Samples each source has given before draw `at` of `epoch`: the
    /// mixture's position, which a checkpoint records.
    pub fn drawn(&self, seed: u64, epoch: u64, at: usize, shuffle: bool) -> Vec<u64> {
        let mut drawn: Vec<u64> = self.quotas.iter().map(|&q| epoch * q as u64).collect();
        for i in self.slots(seed, epoch, shuffle).into_iter().take(at) {
            drawn[i] += 1;
        }
        drawn
    }

    /// The source of global index `g`.
    pub fn source_of(&self, g: usize) -> usize {
        self.starts.partition_point(|&s| s <= g) - 1
    }
}

#[cfg(test)]
mod tests;
