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
}
