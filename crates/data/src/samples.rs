//! What a run samples from: fixed windows of a token stream (pretraining)
//! or fine-tuning examples (JSON Lines, padded or packed per micro-batch).
//! The sampler draws indices; this turns a micro-batch of indices into a
//! `TokenBatch` with its real target count.

use crate::dataset::TokenDataset;
use crate::error::DataError;
use crate::mixture::Mixed;
use crate::preference::PairDataset;
use crate::sft::SftDataset;
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
