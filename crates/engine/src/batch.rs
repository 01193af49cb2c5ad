//! The micro-batch every language-model family consumes: token sequences
//! with per-position targets, some of which may be ignored (padding, masked
//! prompts). Shared so that data pipelines, the binary and the conformance
//! suite need not know which family they feed.

/// Targets below zero are ignored (PyTorch's `ignore_index = -100`).
pub const IGNORE_INDEX: i32 = -100;

/// One micro-batch of token sequences.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TokenBatch {
    /// Number of sequences B (0 is allowed: a rank without data).
    pub n_seqs: usize,
    /// Sequence length T.
    pub seq_len: usize,
    /// `B·T` input tokens, row-major.
    pub inputs: Vec<u32>,
    /// `B·T` targets; negative values are ignored.
    pub targets: Vec<i32>,
}

impl TokenBatch {
    /// Number of targets that count.
    pub fn n_targets(&self) -> u64 {
        self.targets.iter().filter(|&&t| t >= 0).count() as u64
    }

    /// What is wrong with this batch for a model of `vocab_size` tokens and
    /// at most `max_len` positions (`max_len_name` names that limit in the
    /// message), if anything: a length out of range, inputs and targets that
    /// do not fill B × T, or a token outside the vocabulary.
    pub fn problem(&self, max_len: usize, max_len_name: &str, vocab_size: usize) -> Option<String> {
        let (b, t, v) = (self.n_seqs, self.seq_len, vocab_size);
        if t == 0 || t > max_len {
            return Some(format!("sequence length {t} must be between 1 and the model's {max_len_name} {max_len}"));
        }
        if self.inputs.len() != b * t || self.targets.len() != b * t {
            return Some(format!(
                "{} inputs and {} targets for {b} sequences of {t} tokens",
                self.inputs.len(),
                self.targets.len()
            ));
        }
        if let Some(&tok) = self.inputs.iter().find(|&&x| x as usize >= v) {
            return Some(format!("input token {tok} is outside the vocabulary of {v}"));
        }
        if let Some(&tok) = self.targets.iter().find(|&&x| x >= 0 && x as usize >= v) {
            return Some(format!("target token {tok} is outside the vocabulary of {v}"));
        }
        None
    }
}
