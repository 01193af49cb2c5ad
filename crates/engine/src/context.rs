//! Context parallelism: a sequence's positions split over the `C` ranks of
//! a context group, each rank running every layer on its positions only
//! and attention over the keys and values of all of them (gathered from
//! the group each layer; their gradients summed back to their owners).
//!
//! Causal attention costs a position in proportion to how many positions
//! precede it, so contiguous blocks would load the last rank most. Each
//! sequence is cut into `2C` chunks of `⌈T/2C⌉` positions and rank `c`
//! holds chunks `c` and `2C − 1 − c` (Megatron-LM's and Llama 3's load
//! balancing): every rank gets one early and one late chunk.
//!
//! Attention reaches the other ranks' keys and values one of two ways
//! ([`ContextAttention`]): as a ring (each rank's block passed to the next
//! rank C − 1 times, each partial attention folded in with the online
//! softmax; Liu et al.'s ring attention, Megatron-LM's default) or as one
//! all-gather per layer (Llama 3's choice).
//!
//! The ranks of a group take the same micro-batches; the engine folds them
//! into the data-parallel group (gradients, loss and target counts summed
//! over data × context ranks), so each rank's loss and targets are those of
//! its positions ([`ContextRank::local_batch`]).

use crate::batch::TokenBatch;

/// `dist.context_attention`: how attention under context parallelism
/// reaches the keys and values of the other ranks' positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum ContextAttention {
    /// Each rank's keys and values travel around the ring of the group's
    /// ranks (C − 1 sends per layer, each overlapping the attention over
    /// the block at hand; in backward with their gradients, which reach
    /// their owner after C hops): a rank holds two blocks of keys and
    /// values at a time, never the whole sequence's.
    #[default]
    #[serde(rename = "ring")]
    Ring,
    /// One all-gather of every rank's keys and values per layer (forward,
    /// and again in backward) and one reduce-scatter of their gradients:
    /// fewer messages, but the whole sequence's keys and values (and their
    /// gradients) on every rank during a layer's attention.
    #[serde(rename = "all_gather")]
    AllGather,
}

impl std::fmt::Display for ContextAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ContextAttention::Ring => "ring",
            ContextAttention::AllGather => "all_gather",
        })
    }
}

/// Rank `rank` of a context-parallel group of `size` (`size == 1`: every
/// rank holds whole sequences).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContextRank {
    /// This rank's place in the group.
    pub rank: usize,
    /// Ranks in the group (C).
    pub size: usize,
    /// How attention reaches the other ranks' keys and values.
    pub attention: ContextAttention,
}

impl Default for ContextRank {
    fn default() -> Self {
        ContextRank::WHOLE
    }
}

impl ContextRank {
    /// No split: every position here.
    pub const WHOLE: ContextRank = ContextRank { rank: 0, size: 1, attention: ContextAttention::Ring };

    /// Rank `rank` of a group of `size`, attention as a ring.
    pub const fn new(rank: usize, size: usize) -> Self {
        ContextRank { rank, size, attention: ContextAttention::Ring }
    }

    /// The same rank, attention reaching the other ranks by `attention`.
    pub const fn with(self, attention: ContextAttention) -> Self {
        ContextRank { attention, ..self }
    }

    /// Whether sequences are split over more than one rank.
    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// Positions in one of a sequence of `t`'s `2C` chunks (the last
    /// chunks shorter or empty where `2C` does not divide `t`).
    pub fn chunk(&self, t: usize) -> usize {
        t.div_ceil(2 * self.size.max(1))
    }

    /// The positions `[start, end)` of a sequence of `t` rank `rank`
    /// holds: chunks `rank` and `2C − 1 − rank`, in position order
    /// (unsplit: `[(0, t), (t, t)]`).
    pub fn chunks_of(&self, rank: usize, t: usize) -> [(usize, usize); 2] {
        if !self.is_split() {
            return [(0, t), (t, t)];
        }
        let l = self.chunk(t);
        let at = |k: usize| ((k * l).min(t), ((k + 1) * l).min(t));
        [at(rank), at(2 * self.size - 1 - rank)]
    }

    /// This rank's positions of a sequence of `t` ([`ContextRank::chunks_of`]).
    pub fn chunks(&self, t: usize) -> [(usize, usize); 2] {
        self.chunks_of(self.rank, t)
    }

    /// How many positions of a sequence of `t` this rank holds.
    pub fn local_len(&self, t: usize) -> usize {
        self.chunks(t).iter().map(|(a, b)| b - a).sum()
    }

    /// Positions per sequence each rank sends in a gather: the most any
    /// rank holds (two chunks), its own padded to it.
    pub fn block(&self, t: usize) -> usize {
        match self.is_split() {
            true => 2 * self.chunk(t),
            false => t,
        }
    }

    /// The positions this rank holds of a sequence of `t`, in order.
    pub fn positions(&self, t: usize) -> impl Iterator<Item = usize> {
        self.chunks(t).into_iter().flat_map(|(a, b)| a..b)
    }

    /// This rank's share of `batch`: the same sequences, each cut to the
    /// rank's positions, with every input's position explicit (the batch's
    /// own within a packed document, else its index in the sequence) —
    /// the rotary tables, learned positions and targets of those rows.
    /// Unsplit: `batch` itself.
    pub fn local_batch(&self, batch: &TokenBatch) -> TokenBatch {
        if !self.is_split() {
            return batch.clone();
        }
        let t = batch.seq_len;
        let rows: Vec<usize> = (0..batch.n_seqs).flat_map(|b| self.positions(t).map(move |p| b * t + p)).collect();
        let positions = match batch.positions.is_empty() {
            true => rows.iter().map(|&r| (r % t) as u32).collect(),
            false => rows.iter().map(|&r| batch.positions[r]).collect(),
        };
        TokenBatch {
            n_seqs: batch.n_seqs,
            seq_len: self.local_len(t),
            inputs: rows.iter().map(|&r| batch.inputs[r]).collect(),
            targets: rows.iter().map(|&r| batch.targets[r]).collect(),
            positions,
        }
    }

    /// Targets of `batch` that count on this rank (its positions').
    pub fn n_targets(&self, batch: &TokenBatch) -> u64 {
        let (t, chunks) = (batch.seq_len, self.chunks(batch.seq_len));
        let held = |i: &usize| chunks.iter().any(|&(a, b)| (a..b).contains(&(i % t)));
        batch.targets.iter().enumerate().filter(|(i, &x)| x >= 0 && held(i)).count() as u64
    }
}

impl std::fmt::Display for ContextRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "context rank {} of {}", self.rank, self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every position of a sequence is held by exactly one rank, each rank
    /// holding one early and one late chunk, also where `2C` does not
    /// divide `T`; a local batch carries its rows' tokens, targets and
    /// positions, and the ranks' targets add up to the batch's.
    #[test]
    fn ranks_hold_every_position_once_in_balanced_chunks() {
        for (t, c) in [(16, 2), (8, 4), (7, 2), (130, 3), (3, 4)] {
            let mut held = vec![0; t];
            for r in 0..c {
                let cr = ContextRank::new(r, c);
                cr.positions(t).for_each(|p| held[p] += 1);
                assert!(cr.local_len(t) <= cr.block(t), "t {t}, rank {r}");
            }
            assert!(held.iter().all(|&h| h == 1), "t {t} over {c}: {held:?}");
        }
        assert_eq!(ContextRank::new(0, 2).chunks(16), [(0, 4), (12, 16)]);
        assert_eq!(ContextRank::new(1, 2).chunks(16), [(4, 8), (8, 12)]);
        assert_eq!(ContextRank::WHOLE.chunks(5), [(0, 5), (5, 5)]);
        let batch = TokenBatch {
            n_seqs: 2,
            seq_len: 8,
            inputs: (0..16).collect(),
            targets: (0..16).map(|i| if i % 3 == 0 { -100 } else { i }).collect(),
            positions: vec![],
        };
        let mut total = 0;
        for r in 0..2 {
            let cr = ContextRank::new(r, 2);
            let local = cr.local_batch(&batch);
            total += cr.n_targets(&batch);
            assert_eq!(local.n_targets(), cr.n_targets(&batch));
            if r == 1 {
                assert_eq!(local.inputs, [2, 3, 4, 5, 10, 11, 12, 13]);
                assert_eq!(local.positions, [2, 3, 4, 5, 2, 3, 4, 5]);
                assert_eq!(local.seq_len, 4);
            }
        }
        assert_eq!(total, batch.n_targets());
    }
}
