//! Preference pairs for DPO: JSON Lines of `{"prompt", "chosen",
//! "rejected"}` (TRL's explicit-prompt preference format), either three
//! strings or three lists of messages (conversational: the prompt's
//! messages, then the chosen or the rejected assistant reply).
//!
//! Each line becomes two examples built exactly as a prompt/completion
//! line with that reply would be (`schemas`): the prompt's tokens masked,
//! the reply's tokens (and EOS) the targets. A sample is a pair; its
//! micro-batch rows are `[chosen₀, rejected₀, chosen₁, rejected₁, …]`,
//! each padded to the longest row of the micro-batch (never packed).
//! A pair the length limit leaves without a target on either side is
//! dropped (or refused, as `drop_empty` says), since its loss would be
//! undefined.

use crate::error::DataError;
use crate::schemas::{parse_record, Schema};
use crate::sft::{check_kept, example_of, json_lines, Example, Origin, SftDataset, SftOptions};
use crate::tokenizer::Tokenizer;
use engine::TokenBatch;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// The keys of a preference line.
pub const PAIR_KEYS: [&str; 3] = ["prompt", "chosen", "rejected"];

/// Tokenized preference pairs (see the module docs).
#[derive(Debug, Clone)]
pub struct PairDataset {
    source: PathBuf,
    /// Each pair's line (one per pair).
    origins: Vec<Origin>,
    dropped: Vec<Origin>,
    /// The pairs' examples interleaved, chosen then rejected, unpacked: the
    /// one copy of the tokens, which batches are cut from.
    rows: SftDataset,
}

impl PairDataset {
    /// Reads a JSON Lines file of preference pairs. `opts.max_len` cuts
    /// each side; `opts.pack_seq_len` must be unset.
    pub fn load(path: &Path, tok: &Tokenizer, opts: &SftOptions) -> Result<Self, DataError> {
        let text = std::fs::read_to_string(path).map_err(|source| DataError::Read { path: path.into(), source })?;
        Self::from_jsonl(path, &text, tok, opts)
    }

    /// [`Self::load`] from the file's text (`path` names it in errors).
    pub fn from_jsonl(path: &Path, text: &str, tok: &Tokenizer, opts: &SftOptions) -> Result<Self, DataError> {
        if opts.pack_seq_len.is_some() {
            return Err(DataError::PackedPairs { path: path.into() });
        }
        if opts.max_len == Some(0) {
            return Err(DataError::ZeroSize { field: "max_len" });
        }
        let (mut examples, mut origins, mut dropped) = (Vec::new(), Vec::new(), Vec::new());
        for line in json_lines(path, text) {
            let (at, v) = line?;
            let side = |reply: &str| -> Result<Example, DataError> {
                let record = parse_record(&at, &completion_line(&at, &v, reply)?, Schema::PromptCompletion)
                    .map_err(|e| named_as(e, reply))?;
                example_of(&at, tok, record, opts.max_len)
            };
            let (mut chosen, mut rejected) = (side("chosen")?, side("rejected")?);
            let chat = v.get("prompt").is_some_and(Value::is_array);
            let cap = opts.max_len;
            let truncated = cap.is_some_and(|c| chosen.n_positions() > c || rejected.n_positions() > c);
            let origin = Origin { line: at.line, chat, truncated };
            if let Some(cap) = cap {
                for e in [&mut chosen, &mut rejected] {
                    e.tokens.truncate(cap + 1);
                    e.trained.truncate(cap + 1);
                }
            }
            if chosen.n_targets() == 0 || rejected.n_targets() == 0 {
                dropped.push(origin);
                continue;
            }
            examples.extend([chosen, rejected]);
            origins.push(origin);
        }
        check_kept(path, opts.max_len, &dropped, origins.len(), opts.drop_empty)?;
        let pad_id = tok.pad_id().or(tok.eos_id()).unwrap_or(0);
        Ok(Self::assemble(path.into(), examples, origins, dropped, pad_id))
    }

    /// The dataset of `examples` (chosen, rejected for each of the pairs of `origins`).
    fn assemble(source: PathBuf, examples: Vec<Example>, origins: Vec<Origin>, dropped: Vec<Origin>, pad: u32) -> Self {
        let row_origins: Vec<Origin> = origins.iter().flat_map(|&o| [o, o]).collect();
        let rows = SftDataset::assemble(source.clone(), examples, row_origins, Vec::new(), None, pad);
        Self { source, origins, dropped, rows }
    }

    /// Splits into (training, validation): the last `round(n ·
    /// val_fraction)` of the n pairs, at least one, are validation.
    pub fn split_tail(self, val_fraction: f64) -> Result<(Self, Self), DataError> {
        let n = self.origins.len();
        let n_val = crate::dataset::n_val_tokens(n, val_fraction).max(1);
        if n_val >= n {
            return Err(DataError::TooFewExamples { path: self.source, n, n_val, val_fraction });
        }
        let n_train = n - n_val;
        let first_val_line = self.origins[n_train].line;
        let pad = self.rows.pad_id();
        let (mut examples, mut origins) = (self.rows.examples().to_vec(), self.origins);
        let (val_examples, val_origins) = (examples.split_off(2 * n_train), origins.split_off(n_train));
        let (train_dropped, val_dropped) = self.dropped.iter().partition(|o| o.line < first_val_line);
        let train = Self::assemble(self.source.clone(), examples, origins, train_dropped, pad);
        let val = Self::assemble(self.source, val_examples, val_origins, val_dropped, pad);
        Ok((train, val))
    }

    /// Number of pairs (the sampler's samples).
    pub fn n_samples(&self) -> usize {
        self.origins.len()
    }

    /// 1-based lines of the pairs dropped because the length limit left a
    /// side without a target.
    pub fn dropped_lines(&self) -> Vec<usize> {
        self.dropped.iter().map(|o| o.line).collect()
    }

    /// The longest row (positions).
    pub fn max_positions(&self) -> usize {
        self.rows.max_positions()
    }

    /// The row indices of pairs `indices`: chosen, rejected, in order.
    fn row_indices(indices: &[usize]) -> Vec<usize> {
        indices.iter().flat_map(|&i| [2 * i, 2 * i + 1]).collect()
    }

    /// Positions of [`Self::micro_batch`]`(indices)`.
    pub fn micro_batch_positions(&self, indices: &[usize]) -> usize {
        self.rows.micro_batch_positions(&Self::row_indices(indices))
    }

    /// The micro-batch of pairs `indices`: `2·len` rows, chosen then
    /// rejected for each pair, padded to the longest.
    ///
    /// # Panics
    /// If an index is not below [`Self::n_samples`].
    pub fn micro_batch(&self, indices: &[usize]) -> TokenBatch {
        self.rows.micro_batch(&Self::row_indices(indices))
    }

    /// Target tokens over all pairs (both sides).
    pub fn n_targets(&self) -> u64 {
        self.rows.stats().n_targets
    }

    /// Bytes held in memory (token ids and flags).
    pub fn resident_bytes(&self) -> u64 {
        self.rows.examples().iter().map(|e| 5 * e.tokens.len() as u64).sum::<u64>()
    }
}

/// `{"prompt": …, "completion": <reply>}` of a preference line: the
/// prompt/completion line its `reply` side stands for.
fn completion_line(at: &crate::schemas::Line<'_>, v: &Value, reply: &str) -> Result<Value, DataError> {
    let missing: Vec<&str> = PAIR_KEYS.iter().copied().filter(|k| v.get(k).is_none()).collect();
    if !missing.is_empty() {
        return Err(at.bad(format!(
            "a preference line needs \"prompt\", \"chosen\" and \"rejected\" (three strings, or three arrays of messages); \"{}\" missing",
            missing.join("\", \"")
        )));
    }
    let mut m = Map::new();
    m.insert("prompt".into(), v["prompt"].clone());
    m.insert("completion".into(), v[reply].clone());
    Ok(Value::Object(m))
}

/// An error about the `"completion"` a preference side stands for, naming
/// the line's own key for it, `reply` (`"chosen"` or `"rejected"`).
fn named_as(e: DataError, reply: &str) -> DataError {
    let rename = |problem: String| problem.replace("\"completion\"", &format!("\"{reply}\""));
    match e {
        DataError::BadExample { path, line, problem } => DataError::BadExample { path, line, problem: rename(problem) },
        DataError::NoTargets { path, line, problem } => DataError::NoTargets { path, line, problem: rename(problem) },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::ByteTokenizer;

    fn bytes() -> Tokenizer {
        Tokenizer::Byte(ByteTokenizer)
    }

    #[test]
    fn a_line_becomes_chosen_and_rejected_rows_with_the_prompt_masked() {
        let text = "{\"prompt\": \"ab\", \"chosen\": \"cd\", \"rejected\": \"xyz\"}\n";
        let d = PairDataset::from_jsonl(Path::new("p.jsonl"), text, &bytes(), &SftOptions::default()).unwrap();
        assert_eq!(d.n_samples(), 1);
        let b = d.micro_batch(&[0]);
        assert_eq!((b.n_seqs, b.seq_len), (2, 4));
        let ig = engine::IGNORE_INDEX;
        // Byte tokens, no EOS: inputs a b c | targets (b masked) c d.
        assert_eq!(&b.inputs[..3], &[b'a' as u32, b'b' as u32, b'c' as u32]);
        assert_eq!(&b.targets[..4], &[ig, b'c' as i32, b'd' as i32, ig]);
        assert_eq!(&b.targets[4..], &[ig, b'x' as i32, b'y' as i32, b'z' as i32]);
    }

    #[test]
    fn missing_keys_and_packing_are_refused_with_the_fix() {
        let text = "{\"prompt\": \"ab\", \"chosen\": \"cd\"}\n";
        let e = PairDataset::from_jsonl(Path::new("p.jsonl"), text, &bytes(), &SftOptions::default()).unwrap_err();
        assert!(e.to_string().contains("\"rejected\" missing"), "{e}");
        let packed = SftOptions { pack_seq_len: Some(8), ..SftOptions::default() };
        let e = PairDataset::from_jsonl(Path::new("p.jsonl"), "", &bytes(), &packed).unwrap_err();
        assert!(e.to_string().contains("data.pack = false"), "{e}");
    }

    #[test]
    fn a_pair_cut_to_no_target_on_one_side_is_dropped_whole() {
        let text = "{\"prompt\": \"abcd\", \"chosen\": \"e\", \"rejected\": \"f\"}\n\
                    {\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n";
        let opts = SftOptions { max_len: Some(3), drop_empty: true, ..SftOptions::default() };
        let d = PairDataset::from_jsonl(Path::new("p.jsonl"), text, &bytes(), &opts).unwrap();
        assert_eq!((d.n_samples(), d.dropped_lines()), (1, vec![1]));
        let (train, val) = {
            let text = text.replace("abcd", "a").repeat(5);
            PairDataset::from_jsonl(Path::new("p.jsonl"), &text, &bytes(), &SftOptions::default())
                .unwrap()
                .split_tail(0.2)
                .unwrap()
        };
        assert_eq!((train.n_samples(), val.n_samples()), (8, 2));
    }
}
