//! Several data sources as one (`data.sources`): their samples laid end to
//! end ([`Mixed`]), and the epoch order that draws from them by weight
//! ([`Mixture`]).
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
use crate::sampler::{order_of, EpochOrder};
use crate::samples::Samples;
use engine::batch::IGNORE_INDEX;
use engine::rng::SplitMix64;
use engine::TokenBatch;

/// Stream tag of the per-epoch source shuffle.
const MIX_STREAM: u64 = 0x6d69_7865;
/// Stream tag of the per-source seeds.
const SOURCE_STREAM: u64 = 0x736f_7572;

/// Samples of several sources laid end to end: index `starts[i] + j` is
/// source i's sample j.
#[derive(Debug, Clone)]
pub struct Mixed {
    parts: Vec<Samples>,
    /// Where each part starts, and the total at the end.
    starts: Vec<usize>,
    /// A view's order of the global indices (validation interleaves its
    /// sources so that any prefix holds each in proportion).
    view: Option<Vec<usize>>,
    pad_id: u32,
}

impl Mixed {
    /// The parts end to end; `pad_id` fills rows shorter than the longest
    /// of a micro-batch.
    pub fn new(parts: Vec<Samples>, pad_id: u32) -> Self {
        let mut starts = vec![0];
        for p in &parts {
            starts.push(starts[starts.len() - 1] + p.n_samples());
        }
        Self { parts, starts, view: None, pad_id }
    }

    /// The parts interleaved in proportion to their sizes (a smooth
    /// round-robin), so that a prefix — what evaluation reads first — holds
    /// every part in proportion.
    pub fn interleaved(parts: Vec<Samples>, pad_id: u32) -> Self {
        let mut m = Self::new(parts, pad_id);
        let sizes: Vec<usize> = m.parts.iter().map(Samples::n_samples).collect();
        let mut next = vec![0usize; sizes.len()];
        let view = round_robin(&sizes)
            .into_iter()
            .map(|i| {
                next[i] += 1;
                m.starts[i] + next[i] - 1
            })
            .collect();
        m.view = Some(view);
        m
    }

    /// The parts.
    pub fn parts(&self) -> &[Samples] {
        &self.parts
    }

    /// Number of samples (all parts).
    pub fn n_samples(&self) -> usize {
        self.starts[self.parts.len()]
    }

    /// (part, sample within it) of index `i`.
    pub fn locate(&self, i: usize) -> (usize, usize) {
        let g = self.view.as_ref().map_or(i, |v| v[i]);
        let part = self.starts.partition_point(|&s| s <= g) - 1;
        (part, g - self.starts[part])
    }

    /// The source of every index in `indices`.
    pub fn sources_of(&self, indices: &[usize]) -> Vec<usize> {
        indices.iter().map(|&i| self.locate(i).0).collect()
    }

    /// The longest row any part gives.
    pub fn seq_len(&self) -> usize {
        self.parts.iter().map(Samples::seq_len).max().unwrap_or(1)
    }

    /// The micro-batch of `indices`: each row as its source makes it,
    /// padded to the longest (pad id, targets ignored; where a row carries
    /// positions, every row does, padding a document of its own).
    pub fn batch(&self, indices: &[usize]) -> Result<TokenBatch, DataError> {
        if indices.is_empty() {
            return self.parts[0].batch(&[]);
        }
        let rows = indices
            .iter()
            .map(|&i| {
                let (p, j) = self.locate(i);
                self.parts[p].batch(&[j])
            })
            .collect::<Result<Vec<_>, _>>()?;
        let seq_len = rows.iter().map(|r| r.seq_len).max().unwrap_or(1);
        let with_positions = rows.iter().any(|r| !r.positions.is_empty());
        let n = rows.len() * seq_len;
        let mut b = TokenBatch {
            n_seqs: rows.len(),
            seq_len,
            inputs: Vec::with_capacity(n),
            targets: Vec::with_capacity(n),
            positions: Vec::with_capacity(if with_positions { n } else { 0 }),
        };
        for r in rows {
            let pad = seq_len - r.seq_len;
            b.inputs.extend(r.inputs.iter().copied().chain(std::iter::repeat_n(self.pad_id, pad)));
            b.targets.extend(r.targets.iter().copied().chain(std::iter::repeat_n(IGNORE_INDEX, pad)));
            if with_positions {
                if r.positions.is_empty() {
                    b.positions.extend(0..r.seq_len as u32);
                } else {
                    b.positions.extend_from_slice(&r.positions);
                }
                b.positions.extend(0..pad as u32);
            }
        }
        Ok(b)
    }

    /// Positions [`Self::batch`]`(indices)` feeds the model, padding included.
    pub fn input_positions(&self, indices: &[usize]) -> usize {
        let row = |i: usize| {
            let (p, j) = self.locate(i);
            self.parts[p].input_positions(&[j])
        };
        indices.len() * indices.iter().map(|&i| row(i)).max().unwrap_or(0)
    }
}

/// Each of `sizes.len()` parts `sizes[i]` times, in a smooth weighted
/// round-robin: each slot goes to the part with the most credit (credit
/// grows by its size per slot and shrinks by the total when it is chosen;
/// ties to the lower index), so every prefix holds each part within one
/// slot of its share.
fn round_robin(sizes: &[usize]) -> Vec<usize> {
    let total: usize = sizes.iter().sum();
    let mut credit = vec![0i128; sizes.len()];
    let mut out = Vec::with_capacity(total);
    for _ in 0..total {
        for (c, &s) in credit.iter_mut().zip(sizes) {
            *c += s as i128;
        }
        let mut best = 0;
        for (i, &c) in credit.iter().enumerate() {
            if c > credit[best] {
                best = i;
            }
        }
        credit[best] -= total as i128;
        out.push(best);
    }
    out
}

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
