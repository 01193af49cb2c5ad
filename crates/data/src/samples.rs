//! What a run samples from: fixed windows of a token stream (pretraining)
//! or fine-tuning examples (JSON Lines, padded or packed per micro-batch).
//! The sampler draws indices; this turns a micro-batch of indices into a
//! `TokenBatch` with its real target count.

use crate::dataset::TokenDataset;
use crate::error::DataError;
use crate::order::round_robin;
use crate::preference::PairDataset;
use crate::sft::SftDataset;
use engine::batch::IGNORE_INDEX;
use engine::TokenBatch;

/// A data set the sampler draws from.
#[derive(Debug, Clone)]
pub enum Samples {
    /// Non-overlapping windows of T + 1 tokens.
    Windows(TokenDataset),
    /// Fine-tuning examples (or packed rows of them).
    Examples(SftDataset),
    /// Preference pairs: a sample is a pair, two rows of its micro-batch.
    Pairs(PairDataset),
    /// Several sources end to end (`data.sources`).
    Mixed(Box<Mixed>),
}

impl Samples {
    /// Number of samples.
    pub fn n_samples(&self) -> usize {
        match self {
            Samples::Windows(d) => d.n_samples(),
            Samples::Examples(d) => d.n_samples(),
            Samples::Pairs(d) => d.n_samples(),
            Samples::Mixed(m) => m.n_samples(),
        }
    }

    /// The longest micro-batch row (positions): T for windows, the packing
    /// length or the longest example for fine-tuning data.
    pub fn seq_len(&self) -> usize {
        match self {
            Samples::Windows(d) => d.seq_len(),
            Samples::Examples(d) => d.max_positions(),
            Samples::Pairs(d) => d.max_positions(),
            Samples::Mixed(m) => m.seq_len(),
        }
    }

    /// The micro-batch of samples `indices` (padded to its longest row).
    /// Errors only where a token file is read: one that shrank or cannot be
    /// read since it was opened, or a token outside the vocabulary.
    pub fn batch(&self, indices: &[usize]) -> Result<TokenBatch, DataError> {
        match self {
            Samples::Windows(d) => {
                let t = d.seq_len();
                let mut b = TokenBatch {
                    n_seqs: indices.len(),
                    seq_len: t,
                    inputs: Vec::with_capacity(indices.len() * t),
                    targets: Vec::with_capacity(indices.len() * t),
                    positions: Vec::new(),
                };
                for &i in indices {
                    d.push_sample(i, &mut b.inputs, &mut b.targets)?;
                }
                Ok(b)
            }
            Samples::Examples(d) => Ok(d.micro_batch(indices)),
            Samples::Pairs(d) => Ok(d.micro_batch(indices)),
            Samples::Mixed(m) => m.batch(indices),
        }
    }

    /// Input positions the micro-batch of samples `indices` feeds the model,
    /// padding included (what peers count as tokens processed), without
    /// building it.
    pub fn input_positions(&self, indices: &[usize]) -> usize {
        match self {
            Samples::Windows(d) => indices.len() * d.seq_len(),
            Samples::Examples(d) => d.micro_batch_positions(indices),
            Samples::Pairs(d) => d.micro_batch_positions(indices),
            Samples::Mixed(m) => m.input_positions(indices),
        }
    }

    /// Bytes the data set holds in memory (token ids and flags).
    pub fn resident_bytes(&self) -> u64 {
        match self {
            Samples::Windows(d) => d.resident_bytes(),
            Samples::Examples(d) => d.examples().iter().map(|e| 5 * e.tokens.len() as u64).sum(),
            Samples::Pairs(d) => d.resident_bytes(),
            Samples::Mixed(m) => m.parts().iter().map(Samples::resident_bytes).sum(),
        }
    }
}

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
