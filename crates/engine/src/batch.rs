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
    /// Packed rows: each input's position within its document (0 where a
    /// document starts, then +1 per token), so that a document neither
    /// attends to the one before it nor sees shifted positions. Empty:
    /// one document per row, positions `0..T`.
    pub positions: Vec<u32>,
}

impl TokenBatch {
    /// One sequence of `tokens` with no targets: a forward-only pass
    /// (generation's logits).
    pub fn prompt(tokens: &[u32]) -> Self {
        let t = tokens.len();
        TokenBatch {
            n_seqs: 1,
            seq_len: t,
            inputs: tokens.to_vec(),
            targets: vec![IGNORE_INDEX; t],
            positions: Vec::new(),
        }
    }

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
        if let Some(p) = self.positions_problem() {
            return Some(p);
        }
        if let Some(&tok) = self.inputs.iter().find(|&&x| x as usize >= v) {
            return Some(format!("input token {tok} is outside the vocabulary of {v}"));
        }
        if let Some(&tok) = self.targets.iter().find(|&&x| x >= 0 && x as usize >= v) {
            return Some(format!("target token {tok} is outside the vocabulary of {v}"));
        }
        None
    }

    /// What is wrong with [`TokenBatch::positions`], if anything.
    fn positions_problem(&self) -> Option<String> {
        let (b, t) = (self.n_seqs, self.seq_len);
        if self.positions.is_empty() {
            return None;
        }
        if self.positions.len() != b * t {
            return Some(format!("{} positions for {b} sequences of {t} tokens", self.positions.len()));
        }
        for (r, row) in self.positions.chunks(t).enumerate() {
            for (i, &p) in row.iter().enumerate() {
                if p != 0 && (i == 0 || p != row[i - 1] + 1) {
                    return Some(format!(
                        "row {r}, position {i}: document position {p} must be 0 (a document starts) or one more than the previous position's"
                    ));
                }
            }
        }
        None
    }

    /// Where each input's document starts in its row (`i − position`), for
    /// attention that keeps packed documents apart; empty without
    /// positions. Call on a batch [`TokenBatch::problem`] accepted.
    pub fn doc_starts(&self) -> Vec<u32> {
        let t = self.seq_len.max(1);
        self.positions.iter().enumerate().map(|(i, &p)| (i % t) as u32 - p).collect()
    }
}
