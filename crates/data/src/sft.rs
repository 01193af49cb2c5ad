//! Fine-tuning data: JSON Lines of `{"text": …}` or `{"messages": [{"role",
//! "content"}, …]}` → token examples with prompt masking → micro-batches.
//!
//! **What is trained.** An example is tokens `t_0 … t_n` with a flag per
//! token saying whether it is a target; position `p` has input `t_p` and
//! target `t_{p+1}` if that token is flagged, else −100 (ignored).
//! - `text`: every token but the first, plus the tokenizer's EOS, which is
//!   appended (as TRL does for language-modelling data) so the model learns
//!   where a document ends.
//! - `messages`: only what the assistant writes — its content and its
//!   end-of-turn token (`<|im_end|>` in ChatML), as TRL's assistant-only
//!   loss does; everything else (system and user turns, the template's role
//!   headers, the separator after `<|im_end|>`, a default system prompt the
//!   template inserts) is prompt and masked. A token that straddles a
//!   boundary counts as the assistant's (as transformers'
//!   `return_assistant_tokens_mask` does).
//!
//! The first token of an example is never a target. That makes packing
//! safe: in a packed row the position before an example's first token is
//! masked, so no example is trained to predict the next one's start.
//!
//! **Lengths** are in positions (inputs = targets), like `TokenBatch::seq_len`:
//! an example of n tokens has n − 1 positions. `max_len` keeps at most
//! `max_len` positions (`max_len + 1` tokens; the tail is cut and counted in
//! [`SftStats::n_truncated`]). With packing, rows hold `seq_len` positions and
//! examples longer than that are cut to it. An example left without targets
//! by the cut (a chat whose reply lies beyond the limit) is dropped
//! ([`SftOptions::drop_empty`], counted in [`SftStats::n_without_targets`],
//! its line in [`SftDataset::dropped_lines`]) or refused: every sample has
//! a target, so no global batch can be without one.
//!
//! **Packing** is next-fit in file order: examples are appended to the current
//! row while its tokens fit in `seq_len + 1`, else a new row starts; the tail
//! of a row is padding. Examples are never split across rows. The rows attend
//! across example boundaries (`TokenBatch` has no document mask); only the
//! targets are kept apart.
//!
//! Everything is a pure function of the file, the tokenizer and the options.

use crate::chat::{Message, Role, SpanError};
use crate::error::DataError;
use crate::tokenizer::Tokenizer;
use engine::batch::{TokenBatch, IGNORE_INDEX};
use std::ops::Range;
use std::path::Path;

/// How examples are cut and arranged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SftOptions {
    /// The most positions one example keeps (`None`: no limit).
    pub max_len: Option<usize>,
    /// Pack examples into rows of this many positions (`None`: one example a
    /// row, padded per micro-batch to its longest).
    pub pack_seq_len: Option<usize>,
    /// Drop the examples that the length limit leaves without a target
    /// (else they are an error naming their lines).
    pub drop_empty: bool,
}

/// One tokenized example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// `trained[j]`: token `j` is a target (predicted at position `j − 1`);
    /// `trained[0]` is always false.
    pub trained: Vec<bool>,
}

impl Example {
    /// Positions (tokens − 1).
    pub fn n_positions(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }

    /// Positions whose target counts.
    pub fn n_targets(&self) -> usize {
        self.trained.iter().skip(1).filter(|&&t| t).count()
    }
}

/// Appends the positions of `examples` laid end to end (one example, or a
/// packed row): inputs `t_0 … t_{m−2}` of the concatenated tokens, targets
/// `t_{p+1}` where that token is trained, else [`IGNORE_INDEX`]. An example's
/// first token is never trained, so a target never crosses into the next
/// example. Returns the number of positions.
fn push_positions(examples: &[Example], inputs: &mut Vec<u32>, targets: &mut Vec<i32>) -> usize {
    let tokens = examples.iter().flat_map(|e| e.tokens.iter().copied());
    let trained = examples.iter().flat_map(|e| e.trained.iter().copied());
    let n_before = inputs.len();
    let mut prev: Option<u32> = None;
    for (t, on) in tokens.zip(trained) {
        if let Some(p) = prev {
            inputs.push(p);
            targets.push(if on { t as i32 } else { IGNORE_INDEX });
        }
        prev = Some(t);
    }
    inputs.len() - n_before
}

/// What loading did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SftStats {
    /// Examples kept (non-blank lines, less the dropped ones).
    pub n_examples: usize,
    /// Of which `messages` lines.
    pub n_chat: usize,
    /// Examples cut to the length limit (the dropped ones included).
    pub n_truncated: usize,
    /// Examples the cut left without any target, dropped
    /// ([`SftDataset::dropped_lines`] names them).
    pub n_without_targets: usize,
    /// Targets over all examples (= over all samples: packing and padding add none).
    pub n_targets: u64,
    /// Samples the sampler sees: examples, or packed rows.
    pub n_samples: usize,
    /// Padding positions in packed rows (0 without packing, where padding
    /// depends on the micro-batch).
    pub n_pad_positions: usize,
}

/// Fine-tuning examples and the samples built from them.
#[derive(Debug, Clone)]
pub struct SftDataset {
    examples: Vec<Example>,
    /// Packed: row `i` holds examples `rows[i]` (consecutive, since packing is next-fit in order).
    rows: Option<(usize, Vec<Range<usize>>)>,
    pad_id: u32,
    stats: SftStats,
    /// 1-based lines of the examples dropped for having no target left.
    dropped_lines: Vec<usize>,
}

/// Where a line came from, for errors.
struct Line<'a> {
    path: &'a Path,
    line: usize,
}

impl Line<'_> {
    fn bad(&self, problem: impl Into<String>) -> DataError {
        DataError::BadExample { path: self.path.into(), line: self.line, problem: problem.into() }
    }

    fn no_targets(&self, problem: impl Into<String>) -> DataError {
        DataError::NoTargets { path: self.path.into(), line: self.line, problem: problem.into() }
    }
}

fn parse_messages(at: &Line<'_>, v: &serde_json::Value) -> Result<Vec<Message>, DataError> {
    let list = v.as_array().ok_or_else(|| at.bad("\"messages\" must be an array of {\"role\", \"content\"}"))?;
    let mut messages = Vec::with_capacity(list.len());
    for (message_idx, m) in list.iter().enumerate() {
        let field = |name: &str| {
            m.get(name)
                .and_then(|f| f.as_str())
                .ok_or_else(|| at.bad(format!("message {message_idx} needs a string \"{name}\"")))
        };
        let role_name = field("role")?;
        let role = Role::parse(role_name).ok_or_else(|| DataError::UnknownRole {
            path: at.path.into(),
            line: at.line,
            message_idx,
            role: role_name.into(),
        })?;
        let content = field("content")?;
        if role == Role::Assistant && content.trim().is_empty() {
            return Err(DataError::EmptyAssistant { path: at.path.into(), line: at.line, message_idx });
        }
        messages.push(Message::new(role, content));
    }
    if !messages.iter().any(|m| m.role == Role::Assistant) {
        return Err(at.no_targets("no assistant message: only assistant content is trained on"));
    }
    Ok(messages)
}

/// A `text` example: all tokens after the first, and an appended EOS.
fn text_example(at: &Line<'_>, tok: &Tokenizer, text: &str) -> Result<Example, DataError> {
    if text.is_empty() {
        return Err(at.no_targets("\"text\" is empty"));
    }
    let mut tokens = tok.encode(text)?;
    if let Some(eos) = tok.eos_id() {
        if tokens.last() != Some(&eos) {
            tokens.push(eos);
        }
    }
    if tokens.len() < 2 {
        return Err(at.no_targets("\"text\" is a single token and the tokenizer has no EOS: nothing to predict"));
    }
    let mut trained = vec![true; tokens.len()];
    trained[0] = false;
    Ok(Example { tokens, trained })
}

/// A `messages` example: the rendered conversation, trained where the
/// assistant wrote.
fn chat_example(at: &Line<'_>, tok: &Tokenizer, messages: &[Message]) -> Result<Example, DataError> {
    let template = tok.chat_template().ok_or_else(|| DataError::NoChatTemplate { tokenizer: tok.name().into() })?;
    let (text, spans) = template.assistant_spans(messages).map_err(|e| match e {
        SpanError::Render(e) => e,
        SpanError::NotPrefixStable { message_idx } => at.bad(format!(
            "the chat template does not render this conversation up to message {message_idx} as a prefix of the \
             whole, so the assistant's tokens cannot be located (does it start with an assistant message?)"
        )),
    })?;
    let enc = tok.encode_chat(&text)?;
    let mut trained: Vec<bool> =
        enc.offsets.iter().map(|&(s, e)| spans.iter().any(|span| s < span.end && e > span.start)).collect();
    if let Some(first) = trained.first_mut() {
        *first = false;
    }
    let example = Example { tokens: enc.ids, trained };
    if example.n_targets() == 0 {
        return Err(at.no_targets("the assistant's content maps to no token"));
    }
    Ok(example)
}

/// The first few of `lines`, for a message: `3, 5, 9` or `3, 5, 9, … (12 in all)`.
pub fn line_list(lines: &[usize]) -> String {
    const SHOWN: usize = 8;
    let mut s = lines.iter().take(SHOWN).map(|l| l.to_string()).collect::<Vec<_>>().join(", ");
    if lines.len() > SHOWN {
        s.push_str(&format!(", … ({} in all)", lines.len()));
    }
    s
}

/// The non-blank lines of JSON Lines `text` (a UTF-8 byte order mark at
/// its start skipped), each parsed, with where it came from.
fn json_lines<'a>(
    path: &'a Path,
    text: &'a str,
) -> impl Iterator<Item = Result<(Line<'a>, serde_json::Value), DataError>> + 'a {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    text.lines().enumerate().filter(|(_, raw)| !raw.trim().is_empty()).map(move |(line_idx, raw)| {
        let at = Line { path, line: line_idx + 1 };
        serde_json::from_str(raw).map(|v| (at, v)).map_err(|error| DataError::BadJson {
            path: path.into(),
            line: line_idx + 1,
            error,
        })
    })
}

/// The `messages` lines of a JSON Lines file as conversations, each with
/// its 1-based line (`text` lines are skipped): what `eval --exact-match`
/// prompts with. Errors as [`SftDataset::load`] names them.
pub fn conversations(path: &Path, text: &str) -> Result<Vec<(usize, Vec<Message>)>, DataError> {
    let mut out = Vec::new();
    for line in json_lines(path, text) {
        let (at, v) = line?;
        if let Some(m) = v.get("messages") {
            out.push((at.line, parse_messages(&at, m)?));
        }
    }
    Ok(out)
}

impl SftDataset {
    /// Reads a JSON Lines file (see [`Self::from_jsonl`]); bytes that are
    /// not UTF-8 are an error naming their line.
    pub fn load(path: &Path, tok: &Tokenizer, opts: &SftOptions) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|source| DataError::Read { path: path.into(), source })?;
        let text = String::from_utf8(bytes).map_err(|e| {
            let at = e.utf8_error().valid_up_to();
            let bytes = e.as_bytes();
            let line_start = bytes[..at].iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            DataError::NotUtf8Line {
                path: path.into(),
                line: 1 + bytes[..at].iter().filter(|&&b| b == b'\n').count(),
                column: 1 + at - line_start,
            }
        })?;
        Self::from_jsonl(path, &text, tok, opts)
    }

    /// Tokenizes JSON Lines `text` (`path` names it in errors): one example
    /// per non-blank line, `{"text": string}` or `{"messages": [{"role":
    /// "system" | "user" | "assistant", "content": string}, …]}`; other fields
    /// are ignored. A UTF-8 byte order mark at the start is skipped.
    pub fn from_jsonl(path: &Path, text: &str, tok: &Tokenizer, opts: &SftOptions) -> Result<Self, DataError> {
        for (field, v) in [("max_len", opts.max_len), ("pack_seq_len", opts.pack_seq_len)] {
            if v == Some(0) {
                return Err(DataError::ZeroSize { field });
            }
        }
        let cap = match (opts.max_len, opts.pack_seq_len) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mut stats = SftStats::default();
        let mut examples = Vec::new();
        let mut dropped_lines = Vec::new();
        for line in json_lines(path, text) {
            let (at, v) = line?;
            let mut ex = match (v.get("text"), v.get("messages")) {
                (Some(_), Some(_)) => return Err(at.bad("has both \"text\" and \"messages\"; give one")),
                (Some(t), None) => {
                    text_example(&at, tok, t.as_str().ok_or_else(|| at.bad("\"text\" must be a string"))?)?
                }
                (None, Some(m)) => {
                    stats.n_chat += 1;
                    chat_example(&at, tok, &parse_messages(&at, m)?)?
                }
                (None, None) => return Err(at.bad(
                    "expected an object with \"text\" (a string) or \"messages\" (an array of {\"role\", \"content\"})",
                )),
            };
            if let Some(cap) = cap.filter(|&c| ex.n_positions() > c) {
                ex.tokens.truncate(cap + 1);
                ex.trained.truncate(cap + 1);
                stats.n_truncated += 1;
                if ex.n_targets() == 0 {
                    stats.n_without_targets += 1;
                    dropped_lines.push(at.line);
                    continue;
                }
            }
            stats.n_targets += ex.n_targets() as u64;
            examples.push(ex);
        }
        stats.n_examples = examples.len();
        if let (Some(cap), false) = (cap, dropped_lines.is_empty()) {
            if !opts.drop_empty || examples.is_empty() {
                return Err(DataError::CutToNoTargets {
                    path: path.into(),
                    n: dropped_lines.len(),
                    n_lines: dropped_lines.len() + examples.len(),
                    lines: line_list(&dropped_lines),
                    max_len: cap,
                    all: examples.is_empty(),
                });
            }
        }
        if examples.is_empty() {
            return Err(DataError::Empty { name: path.display().to_string() });
        }
        let rows = opts.pack_seq_len.map(|seq_len| {
            let mut rows: Vec<Range<usize>> = Vec::new();
            let mut row_tokens = 0;
            for (idx, ex) in examples.iter().enumerate() {
                match rows.last_mut() {
                    Some(row) if row_tokens + ex.tokens.len() <= seq_len + 1 => {
                        row.end = idx + 1;
                        row_tokens += ex.tokens.len();
                    }
                    _ => {
                        rows.push(idx..idx + 1);
                        row_tokens = ex.tokens.len();
                    }
                }
            }
            let used: usize =
                rows.iter().map(|r| examples[r.clone()].iter().map(|e| e.tokens.len()).sum::<usize>() - 1).sum();
            stats.n_pad_positions = rows.len() * seq_len - used;
            (seq_len, rows)
        });
        stats.n_samples = rows.as_ref().map_or(examples.len(), |(_, r)| r.len());
        let pad_id = tok.pad_id().or(tok.eos_id()).unwrap_or(0);
        Ok(Self { examples, rows, pad_id, stats, dropped_lines })
    }

    /// 1-based lines of the examples dropped because the length limit left
    /// them without a target ([`SftOptions::drop_empty`]).
    pub fn dropped_lines(&self) -> &[usize] {
        &self.dropped_lines
    }

    /// What loading did.
    pub fn stats(&self) -> &SftStats {
        &self.stats
    }

    /// Samples for the sampler: examples, or packed rows.
    pub fn n_samples(&self) -> usize {
        self.stats.n_samples
    }

    /// Positions of the longest sample (a packed row, or the longest example).
    pub fn max_positions(&self) -> usize {
        match &self.rows {
            Some((seq_len, _)) => *seq_len,
            None => self.examples.iter().map(Example::n_positions).max().unwrap_or(0),
        }
    }

    /// All examples, in file order (blank lines skipped).
    pub fn examples(&self) -> &[Example] {
        &self.examples
    }

    /// The id written at padded input positions (pad, else EOS, else 0; its
    /// targets are always ignored).
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Positions of [`Self::micro_batch`]`(indices)`: rows × its padded length.
    pub fn micro_batch_positions(&self, indices: &[usize]) -> usize {
        indices.len() * self.row_len(indices)
    }

    /// The row length of [`Self::micro_batch`]`(indices)`: the packing
    /// length, or the longest of the examples.
    fn row_len(&self, indices: &[usize]) -> usize {
        match &self.rows {
            Some((seq_len, _)) => *seq_len,
            None => indices.iter().map(|&i| self.examples[i].n_positions()).max().unwrap_or(1),
        }
    }

    /// The micro-batch of samples `indices`, in that order. Packed: `B` rows
    /// of `seq_len`. Not packed: each example one row, padded (pad id,
    /// targets ignored) to the longest in this micro-batch. No indices: zero
    /// rows of length `seq_len` (packed) or 1, which every model accepts as a
    /// rank without data.
    ///
    /// # Panics
    /// If an index is not below [`Self::n_samples`].
    pub fn micro_batch(&self, indices: &[usize]) -> TokenBatch {
        let samples: Vec<&[Example]> = match &self.rows {
            Some((_, rows)) => indices.iter().map(|&i| &self.examples[rows[i].clone()]).collect(),
            None => indices.iter().map(|&i| std::slice::from_ref(&self.examples[i])).collect(),
        };
        let seq_len = self.row_len(indices);
        let n = samples.len() * seq_len;
        let (mut inputs, mut targets) = (Vec::with_capacity(n), Vec::with_capacity(n));
        // Packed rows keep their examples apart: each input's position
        // within its example (the padding after them a document of its own).
        let mut positions = Vec::with_capacity(if self.rows.is_some() { n } else { 0 });
        for s in &samples {
            let used = push_positions(s, &mut inputs, &mut targets);
            let pad = seq_len - used;
            inputs.extend(std::iter::repeat_n(self.pad_id, pad));
            targets.extend(std::iter::repeat_n(IGNORE_INDEX, pad));
            if self.rows.is_some() {
                let row_start = positions.len();
                positions.extend(s.iter().flat_map(|e| 0..e.tokens.len() as u32));
                positions.truncate(row_start + used);
                positions.extend(0..pad as u32);
            }
        }
        TokenBatch { n_seqs: samples.len(), seq_len, inputs, targets, positions }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::bpe::{byte_to_char, BpeParts, BpeTokenizer, PreTokenizer};

    /// ChatML without a default system prompt.
    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    const IM_START: u32 = 256;
    const IM_END: u32 = 257;

    /// One token per byte (id = byte), `<|im_start|>` = 256, `<|im_end|>` =
    /// 257 (EOS), no merges: every position can be checked by hand.
    pub(crate) fn byte_chatml() -> Tokenizer {
        byte_tokenizer_with(CHATML)
    }

    /// [`byte_chatml`] with another chat template.
    pub(crate) fn byte_tokenizer_with(template: &str) -> Tokenizer {
        let mut tokens: Vec<String> = byte_to_char().iter().map(|c| c.to_string()).collect();
        tokens.extend(["<|im_start|>".to_string(), "<|im_end|>".to_string()]);
        let t = BpeTokenizer::from_parts(BpeParts {
            source_name: "test".into(),
            tokens,
            merges: vec![],
            special_ids: vec![IM_START, IM_END],
            added_ids: vec![],
            pre_tokenizer: PreTokenizer::Gpt2,
            bos_id: None,
            eos_id: Some(IM_END),
            pad_id: None,
            add_bos: false,
            add_eos: false,
            chat_template: Some(template.into()),
        })
        .unwrap();
        Tokenizer::Bpe(Box::new(t))
    }

    fn load(jsonl: &str, opts: SftOptions) -> Result<SftDataset, DataError> {
        SftDataset::from_jsonl(Path::new("train.jsonl"), jsonl, &byte_chatml(), &opts)
    }

    fn b(s: &str) -> Vec<i32> {
        s.bytes().map(i32::from).collect()
    }

    /// `<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n`
    /// is 25 tokens, 24 positions; tokens 21–23 (`Y`, `o`, `<|im_end|>`) are
    /// the assistant's, so exactly positions 20–22 have targets.
    #[test]
    fn chat_masking_positions_by_hand() {
        let ds = load(
            r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}"#,
            SftOptions::default(),
        )
        .unwrap();
        let batch = ds.micro_batch(&[0]);
        assert_eq!((batch.n_seqs, batch.seq_len), (1, 24));
        let mut want_inputs = vec![IM_START as i32];
        want_inputs.extend(b("user\nHi"));
        want_inputs.push(IM_END as i32);
        want_inputs.extend(b("\n"));
        want_inputs.push(IM_START as i32);
        want_inputs.extend(b("assistant\nYo"));
        want_inputs.push(IM_END as i32);
        assert_eq!(batch.inputs.iter().map(|&t| t as i32).collect::<Vec<_>>(), want_inputs);
        let mut want_targets = vec![IGNORE_INDEX; 24];
        want_targets[20..23].copy_from_slice(&[b'Y' as i32, b'o' as i32, IM_END as i32]);
        assert_eq!(batch.targets, want_targets);
        assert_eq!(ds.stats().n_targets, 3);
    }

    /// Two assistant turns and a system prompt: only the two replies and
    /// their `<|im_end|>` are targets.
    #[test]
    fn only_assistant_turns_are_targets() {
        let line = r#"{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "V"}, {"role": "assistant", "content": "B"}], "id": 7}"#;
        let ds = load(line, SftOptions::default()).unwrap();
        let batch = ds.micro_batch(&[0]);
        let targets: Vec<i32> = batch.targets.iter().copied().filter(|&t| t >= 0).collect();
        assert_eq!(targets, vec![b'A' as i32, b'1' as i32, IM_END as i32, b'B' as i32, IM_END as i32]);
    }

    #[test]
    fn text_lines_train_everything_after_the_first_token_and_end_with_eos() {
        let ds = load("{\"text\": \"abc\"}\n\n{\"text\": \"de\"}\n", SftOptions::default()).unwrap();
        assert_eq!(ds.stats().n_examples, 2);
        let batch = ds.micro_batch(&[0, 1]);
        assert_eq!((batch.n_seqs, batch.seq_len), (2, 3));
        assert_eq!(batch.inputs, vec![97, 98, 99, 100, 101, IM_END]);
        assert_eq!(batch.targets, vec![98, 99, IM_END as i32, 101, IM_END as i32, IGNORE_INDEX]);
    }

    /// Padding to the longest example adds positions, never targets; every
    /// micro-batch carries exactly its examples' targets.
    #[test]
    fn padding_never_adds_targets() {
        let jsonl = ["{\"text\": \"a\"}", "{\"text\": \"a much longer line\"}", "{\"text\": \"mid size\"}"].join("\n");
        let ds = load(&jsonl, SftOptions::default()).unwrap();
        for idx in [vec![0], vec![0, 1], vec![2, 0, 1], vec![1, 1]] {
            let batch = ds.micro_batch(&idx);
            let want: usize = idx.iter().map(|&i| ds.examples()[i].n_targets()).sum();
            assert_eq!(batch.n_targets(), want as u64, "{idx:?}");
            assert_eq!(batch.seq_len, idx.iter().map(|&i| ds.examples()[i].n_positions()).max().unwrap());
            for (row, &i) in idx.iter().enumerate() {
                let n = ds.examples()[i].n_positions();
                let range = row * batch.seq_len + n..(row + 1) * batch.seq_len;
                assert!(batch.targets[range.clone()].iter().all(|&t| t == IGNORE_INDEX));
                assert!(batch.inputs[range].iter().all(|&t| t == ds.pad_id()));
            }
        }
        let empty = ds.micro_batch(&[]);
        assert_eq!((empty.n_seqs, empty.seq_len, empty.inputs.len()), (0, 1, 0));
    }

    /// Packed rows: examples in order, whole, a row's tokens ≤ seq_len + 1;
    /// the position before each example's first token is masked, so no
    /// target crosses a boundary; the total target count is unchanged.
    #[test]
    fn packing_keeps_examples_apart() {
        // token counts (with EOS): 3, 4, 2, 6, 3
        let jsonl = ["ab", "cde", "f", "ghijk", "lm"].map(|t| format!("{{\"text\": \"{t}\"}}")).join("\n");
        let opts = SftOptions { max_len: None, pack_seq_len: Some(6), drop_empty: true };
        let ds = load(&jsonl, opts).unwrap();
        let unpacked = load(&jsonl, SftOptions::default()).unwrap();
        // next-fit over capacity 7 tokens: [3 + 4], [2] (2 + 6 > 7), [6] (6 + 3 > 7), [3]
        assert_eq!(ds.n_samples(), 4);
        let batch = ds.micro_batch(&[0, 1, 2, 3]);
        assert_eq!((batch.n_seqs, batch.seq_len), (4, 6));
        let e = IM_END as i32;
        let row0_targets = [b'b' as i32, e, IGNORE_INDEX, b'd' as i32, b'e' as i32, e];
        assert_eq!(&batch.targets[..6], &row0_targets);
        assert_eq!(&batch.inputs[..6], &[97, 98, IM_END, 99, 100, 101]);
        assert_eq!(&batch.targets[6..12], &[e, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]);
        // Positions restart with each example (and with the padding), so
        // the second example of row 0 attends from its own start.
        assert_eq!(&batch.positions[..6], &[0, 1, 2, 0, 1, 2]);
        assert_eq!(&batch.positions[6..12], &[0, 0, 1, 2, 3, 4]);
        assert_eq!(batch.doc_starts()[..6], [0, 0, 0, 3, 3, 3]);
        assert_eq!(batch.problem(6, "max", 300), None);
        assert!(unpacked.micro_batch(&[0, 1]).positions.is_empty());
        assert_eq!(batch.n_targets(), unpacked.stats().n_targets);
        assert_eq!(ds.stats().n_targets, unpacked.stats().n_targets);
        // a row of n tokens fills n − 1 positions (the masked boundary one included)
        assert_eq!(ds.stats().n_pad_positions, 4 * 6 - (6 + 1 + 5 + 2));
    }

    /// Sum over every sample of its micro-batch's targets = Σ over examples,
    /// packed or not, truncated or not.
    #[test]
    fn total_target_count_is_the_sum_over_examples() {
        let mut lines = Vec::new();
        for i in 0..23 {
            let text: String = (0..(i * 7 % 19) + 1).map(|k| (b'a' + (k % 26) as u8) as char).collect();
            if i % 3 == 0 {
                lines.push(format!(
                    r#"{{"messages": [{{"role": "user", "content": "q{i}"}}, {{"role": "assistant", "content": "{text}"}}]}}"#
                ));
            } else {
                lines.push(format!(r#"{{"text": "{text}"}}"#));
            }
        }
        let jsonl = lines.join("\n");
        for opts in [
            SftOptions::default(),
            SftOptions { max_len: Some(9), pack_seq_len: None, drop_empty: true },
            SftOptions { max_len: None, pack_seq_len: Some(40), drop_empty: true },
            SftOptions { max_len: Some(12), pack_seq_len: Some(25), drop_empty: true },
        ] {
            let ds = load(&jsonl, opts).unwrap();
            let per_example: u64 = ds.examples().iter().map(|e| e.n_targets() as u64).sum();
            assert_eq!(ds.stats().n_targets, per_example);
            let all: Vec<usize> = (0..ds.n_samples()).collect();
            let via_batches: u64 = all.chunks(3).map(|c| ds.micro_batch(c).n_targets()).sum();
            assert_eq!(via_batches, per_example, "{opts:?}");
            assert_eq!(ds.micro_batch(&all).n_targets(), per_example);
        }
    }

    #[test]
    fn truncation_is_counted() {
        let jsonl = "{\"text\": \"abcdefghij\"}\n{\"text\": \"ab\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"a long question here\"}, {\"role\": \"assistant\", \"content\": \"x\"}]}";
        let ds = load(jsonl, SftOptions { max_len: Some(4), pack_seq_len: None, drop_empty: true }).unwrap();
        let s = ds.stats();
        assert_eq!((s.n_examples, s.n_chat, s.n_truncated, s.n_without_targets), (2, 1, 2, 1));
        assert_eq!(ds.examples()[0].tokens, vec![97, 98, 99, 100, 101]);
        assert_eq!(ds.examples()[1].n_positions(), 2);
        assert_eq!(s.n_targets, 4 + 2);
        assert_eq!(ds.dropped_lines(), &[3]);
    }

    /// Chats whose reply lies beyond the limit keep no target once cut:
    /// dropped (named by line), so every sample — and so every global
    /// batch — has a target; or refused with their lines and the fix; a
    /// file of nothing else is an error either way. Packed too.
    #[test]
    fn examples_cut_to_no_targets_are_dropped_or_refused() {
        let chat = |q: &str| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": "{q}"}}, {{"role": "assistant", "content": "ok"}}]}}"#
            )
        };
        let long = "a question far longer than the limit";
        let lines = [chat("q"), chat(long), "{\"text\": \"plain\"}".into(), chat(long), chat("q"), chat("hi")];
        let jsonl = lines.join("\n");
        for pack in [None, Some(40)] {
            let keep = SftOptions { max_len: Some(30), pack_seq_len: pack, drop_empty: true };
            let ds = load(&jsonl, keep).unwrap();
            assert_eq!(ds.dropped_lines(), &[2, 4]);
            assert_eq!((ds.stats().n_examples, ds.stats().n_without_targets), (4, 2));
            assert!(ds.examples().iter().all(|e| e.n_targets() > 0));
            for i in 0..ds.n_samples() {
                assert!(ds.micro_batch(&[i]).n_targets() > 0, "sample {i} has no target");
            }
            let e = load(&jsonl, SftOptions { drop_empty: false, ..keep }).unwrap_err().to_string();
            assert!(e.starts_with("train.jsonl: 2 of 6 examples keep no target"), "{e}");
            assert!(e.contains("lines 2, 4;") && e.contains("data.drop_empty = true"), "{e}");
            let only_long = [chat(long), chat(long)].join("\n");
            let e = load(&only_long, keep).unwrap_err().to_string();
            assert!(e.contains("2 of 2 examples") && e.contains("no example is left"), "{e}");
        }
    }

    /// A byte order mark is skipped; a JSON error is said once (no source
    /// chain repeating it); bytes that are not UTF-8 are named by line.
    #[test]
    fn bom_json_errors_and_bad_utf8_lines() {
        let ds = load("\u{feff}{\"text\": \"abc\"}\n", SftOptions::default()).unwrap();
        assert_eq!(ds.examples()[0].tokens[..3], [97, 98, 99]);
        let e = load("{\"text\": \"ok\"}\n{\"text\": oops}", SftOptions::default()).unwrap_err();
        assert!(std::error::Error::source(&e).is_none(), "the parser's error is in the message already: {e}");
        let dir = std::env::temp_dir().join(format!("macrobatch-sft-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("latin1.jsonl");
        std::fs::write(&path, b"{\"text\": \"ok\"}\n\n{\"text\": \"caf\xe9\"}\n").unwrap();
        let e = SftDataset::load(&path, &byte_chatml(), &SftOptions::default()).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:3: not UTF-8 (invalid byte at column 14)", path.display())), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_name_the_line() {
        let err = |jsonl: &str| load(jsonl, SftOptions::default()).unwrap_err().to_string();
        let e = err("{\"text\": \"ok\"}\n{\"text\": oops}");
        assert!(e.starts_with("train.jsonl:2: not valid JSON"), "{e}");
        let e = err("\n\n{\"prompt\": \"x\"}");
        assert!(e.starts_with("train.jsonl:3: expected an object with \"text\""), "{e}");
        let e = err(r#"{"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}"#);
        assert_eq!(e, "train.jsonl:1: message 1 has role `bot`; expected system, user or assistant");
        let e = err(r#"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}"#);
        assert_eq!(e, "train.jsonl:1: message 1 (assistant) has empty content");
        let e = err(r#"{"messages": [{"role": "user"}]}"#);
        assert_eq!(e, "train.jsonl:1: message 0 needs a string \"content\"");
        let e = err(r#"{"messages": [{"role": "user", "content": "only a question"}]}"#);
        assert!(e.contains("no assistant message"), "{e}");
        let e = err(r#"{"text": ""}"#);
        assert!(e.contains("\"text\" is empty"), "{e}");
        let e = err(r#"{"text": "a", "messages": []}"#);
        assert!(e.contains("both"), "{e}");
        let e = err(r#"{"text": 3}"#);
        assert!(e.contains("\"text\" must be a string"), "{e}");
        // SmolLM2's template inserts a system prompt before a first message that
        // is not one, so an assistant-first conversation is not prefix-stable
        let smollm2 = byte_tokenizer_with(crate::chat::tests::SMOLLM2);
        let line = r#"{"messages": [{"role": "assistant", "content": "first"}]}"#;
        let e = SftDataset::from_jsonl(Path::new("t.jsonl"), line, &smollm2, &SftOptions::default()).unwrap_err();
        assert!(e.to_string().starts_with("t.jsonl:1: the chat template does not render"), "{e}");
        assert!(matches!(load("\n  \n", SftOptions::default()), Err(DataError::Empty { .. })));
        let bytes = SftDataset::from_jsonl(
            Path::new("b.jsonl"),
            r#"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}"#,
            &Tokenizer::Byte(crate::ByteTokenizer),
            &SftOptions::default(),
        );
        assert!(matches!(bytes, Err(DataError::NoChatTemplate { .. })));
        let zero = load("{\"text\": \"a\"}", SftOptions { max_len: Some(0), pack_seq_len: None, drop_empty: true });
        assert!(matches!(zero, Err(DataError::ZeroSize { field: "max_len" })));
    }
}
