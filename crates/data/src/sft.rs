//! Fine-tuning data: JSON Lines in one of the schemas of [`crate::schemas`]
//! (`text`, `messages`, Alpaca, ShareGPT, prompt/completion) → token
//! examples with prompt masking → micro-batches.
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
//!   `return_assistant_tokens_mask` does). Alpaca and ShareGPT lines are
//!   chats; so is a prompt/completion line of two message lists, whose
//!   targets are only the completion's messages.
//! - prompt/completion strings: the prompt and the completion tokenized
//!   apart and their ids concatenated (so the boundary is exact and the
//!   prompt's tokens are those a generation would start from), plus EOS as
//!   `text` lines get; the completion's tokens and the EOS are the targets.
//!   TRL's `SFTTrainer` tokenizes prompt + completion as one string and
//!   takes the prompt's own token count as the boundary, warning where the
//!   two disagree; both give the same tokens where the tokenizer does not
//!   merge across the boundary.
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
//! Everything is a pure function of the file, the tokenizer, the options and
//! the schema.

use crate::chat::{Message, Role, SpanError};
use crate::error::DataError;
use crate::schemas::{parse_record, Line, Record, Schema};
use crate::tokenizer::Tokenizer;
use engine::batch::{TokenBatch, IGNORE_INDEX};
use std::ops::Range;
use std::path::{Path, PathBuf};

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
    /// Of the lines read, chats (`messages`, Alpaca, ShareGPT and conversational
    /// prompt/completion lines).
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
    /// The file read.
    source: PathBuf,
    examples: Vec<Example>,
    /// Per example: its 1-based line, whether it is a chat, whether it was cut.
    origins: Vec<Origin>,
    /// Packed: row `i` holds examples `rows[i]` (consecutive, since packing is next-fit in order).
    rows: Option<(usize, Vec<Range<usize>>)>,
    pad_id: u32,
    stats: SftStats,
    /// The examples dropped for having no target left.
    dropped: Vec<Origin>,
    /// Their 1-based lines.
    dropped_lines: Vec<usize>,
}

/// Where an example came from and what loading did to it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin {
    pub(crate) line: usize,
    pub(crate) chat: bool,
    pub(crate) truncated: bool,
}

/// `tokens` ending in the tokenizer's EOS (appended unless already there).
fn push_eos(tok: &Tokenizer, tokens: &mut Vec<u32>) {
    if let Some(eos) = tok.eos_id() {
        if tokens.last() != Some(&eos) {
            tokens.push(eos);
        }
    }
}

/// A `text` example: all tokens after the first, and an appended EOS.
/// With a length cut `cap`, only the text's first `cap + 2` tokens are made
/// (the cut keeps `cap + 1`; one more marks the example as cut), so a huge
/// line costs what its head does.
fn text_example(at: &Line<'_>, tok: &Tokenizer, text: &str, cap: Option<usize>) -> Result<Example, DataError> {
    if text.is_empty() {
        return Err(at.no_targets("\"text\" is empty"));
    }
    let mut tokens = match cap {
        Some(cap) => tok.encode_prefix(text, cap.saturating_add(2))?,
        None => tok.encode(text)?,
    };
    push_eos(tok, &mut tokens);
    if tokens.len() < 2 {
        return Err(at.no_targets("\"text\" is a single token and the tokenizer has no EOS: nothing to predict"));
    }
    let mut trained = vec![true; tokens.len()];
    trained[0] = false;
    Ok(Example { tokens, trained })
}

/// A prompt/completion example of two strings: the prompt's ids (as a
/// `text` line of it starts, without an EOS the tokenizer may append), the
/// completion's (without a BOS the tokenizer may prepend), then EOS; the
/// completion's tokens and the EOS are the targets.
fn completion_example(at: &Line<'_>, tok: &Tokenizer, prompt: &str, completion: &str) -> Result<Example, DataError> {
    let mut tokens = tok.encode(prompt)?;
    if tok.eos_id().is_some() && tokens.last().copied() == tok.eos_id() {
        tokens.pop();
    }
    let n_prompt = tokens.len();
    let mut reply = tok.encode(completion)?;
    if tok.bos_id().is_some() && reply.first().copied() == tok.bos_id() {
        reply.remove(0);
    }
    tokens.extend(reply);
    push_eos(tok, &mut tokens);
    let trained: Vec<bool> = (0..tokens.len()).map(|j| j > 0 && j >= n_prompt).collect();
    let example = Example { tokens, trained };
    if example.n_targets() == 0 {
        return Err(at.no_targets("the completion maps to no token to predict"));
    }
    Ok(example)
}

/// A chat example: the rendered conversation, trained where the assistant
/// wrote in messages `trained_from..`.
fn chat_example(
    at: &Line<'_>,
    tok: &Tokenizer,
    messages: &[Message],
    trained_from: usize,
) -> Result<Example, DataError> {
    let template = tok.chat_template().ok_or_else(|| DataError::NoChatTemplate { tokenizer: tok.name().into() })?;
    let (text, spans) = template.assistant_spans(messages).map_err(|e| match e {
        SpanError::Render(e) => e,
        SpanError::NotPrefixStable { message_idx } => at.bad(format!(
            "the chat template does not render this conversation up to message {message_idx} as a prefix of the \
             whole, so the assistant's tokens cannot be located (does it start with an assistant message?)"
        )),
    })?;
    // `spans` has one entry per assistant message, in order.
    let assistant_idx = messages.iter().enumerate().filter(|(_, m)| m.role == Role::Assistant).map(|(i, _)| i);
    let spans: Vec<Range<usize>> =
        spans.into_iter().zip(assistant_idx).filter(|&(_, i)| i >= trained_from).map(|(span, _)| span).collect();
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

/// What loading may keep after the length cut `cap` dropped the lines
/// `dropped` and kept `n_kept` examples: an error when the drops are
/// refused (`drop_empty` false) or nothing is left.
pub(crate) fn check_kept(
    path: &Path,
    cap: Option<usize>,
    dropped: &[Origin],
    n_kept: usize,
    drop_empty: bool,
) -> Result<(), DataError> {
    if let (Some(cap), false) = (cap, dropped.is_empty()) {
        if !drop_empty || n_kept == 0 {
            let lines: Vec<usize> = dropped.iter().map(|o| o.line).collect();
            return Err(DataError::CutToNoTargets {
                path: path.into(),
                n: dropped.len(),
                n_lines: dropped.len() + n_kept,
                lines: line_list(&lines),
                max_len: cap,
                all: n_kept == 0,
            });
        }
    }
    if n_kept == 0 {
        return Err(DataError::Empty { name: path.display().to_string() });
    }
    Ok(())
}

/// The example a line's record becomes.
pub(crate) fn example_of(
    at: &Line<'_>,
    tok: &Tokenizer,
    record: Record,
    cap: Option<usize>,
) -> Result<Example, DataError> {
    match record {
        Record::Text(text) => text_example(at, tok, &text, cap),
        Record::Chat { messages, trained_from } => chat_example(at, tok, &messages, trained_from),
        Record::Completion { prompt, completion } => completion_example(at, tok, &prompt, &completion),
    }
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
pub(crate) fn json_lines<'a>(
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

/// The chat lines of a JSON Lines file (every schema read as a chat; the
/// schema of each line told by its keys under `Schema::Auto`, else
/// `schema`) as conversations, each with its 1-based line (`text` and prompt/completion string lines are skipped):
/// what `eval --exact-match` prompts with. Errors as [`SftDataset::load`]
/// names them.
pub fn conversations(path: &Path, text: &str, schema: Schema) -> Result<Vec<(usize, Vec<Message>)>, DataError> {
    let mut out = Vec::new();
    for line in json_lines(path, text) {
        let (at, v) = line?;
        if let Record::Chat { messages, .. } = parse_record(&at, &v, schema)? {
            out.push((at.line, messages));
        }
    }
    Ok(out)
}

impl SftDataset {
    /// Reads a JSON Lines file (see [`Self::from_jsonl`]), each line's
    /// schema told by its keys.
    pub fn load(path: &Path, tok: &Tokenizer, opts: &SftOptions) -> Result<Self, DataError> {
        Self::load_as(path, tok, opts, Schema::Auto)
    }

    /// Reads a JSON Lines file as `schema` (see [`Self::from_jsonl_as`]);
    /// bytes that are not UTF-8 are an error naming their line.
    pub fn load_as(path: &Path, tok: &Tokenizer, opts: &SftOptions, schema: Schema) -> Result<Self, DataError> {
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
        Self::from_jsonl_as(path, &text, tok, opts, schema)
    }

    /// [`Self::from_jsonl_as`] with each line's schema told by its keys.
    pub fn from_jsonl(path: &Path, text: &str, tok: &Tokenizer, opts: &SftOptions) -> Result<Self, DataError> {
        Self::from_jsonl_as(path, text, tok, opts, Schema::Auto)
    }

    /// Tokenizes JSON Lines `text` (`path` names it in errors): one example
    /// per non-blank line in `schema` (see [`crate::schemas`]: `{"text":
    /// string}`, `{"messages": [{"role": "system" | "user" | "assistant",
    /// "content": string}, …]}`, Alpaca, ShareGPT, prompt/completion); other
    /// fields are ignored. A UTF-8 byte order mark at the start is skipped.
    pub fn from_jsonl_as(
        path: &Path,
        text: &str,
        tok: &Tokenizer,
        opts: &SftOptions,
        schema: Schema,
    ) -> Result<Self, DataError> {
        Self::from_rows(path, json_lines(path, text), tok, opts, schema)
    }

    /// Tokenizes records — JSON lines, or the rows of a table
    /// ([`crate::tabular`]) — each with where it came from, as
    /// [`Self::from_jsonl_as`] does lines; `path` names the whole.
    pub(crate) fn from_rows<'a>(
        path: &Path,
        rows: impl Iterator<Item = Result<(Line<'a>, serde_json::Value), DataError>>,
        tok: &Tokenizer,
        opts: &SftOptions,
        schema: Schema,
    ) -> Result<Self, DataError> {
        for (field, v) in [("max_len", opts.max_len), ("pack_seq_len", opts.pack_seq_len)] {
            if v == Some(0) {
                return Err(DataError::ZeroSize { field });
            }
        }
        let cap = match (opts.max_len, opts.pack_seq_len) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mut examples = Vec::new();
        let mut origins = Vec::new();
        let mut dropped = Vec::new();
        for row in rows {
            let (at, v) = row?;
            let record = parse_record(&at, &v, schema)?;
            let chat = matches!(record, Record::Chat { .. });
            let mut ex = example_of(&at, tok, record, cap)?;
            let truncated = cap.is_some_and(|c| ex.n_positions() > c);
            let origin = Origin { line: at.line, chat, truncated };
            if let Some(cap) = cap.filter(|_| truncated) {
                ex.tokens.truncate(cap + 1);
                ex.trained.truncate(cap + 1);
                if ex.n_targets() == 0 {
                    dropped.push(origin);
                    continue;
                }
            }
            examples.push(ex);
            origins.push(origin);
        }
        check_kept(path, cap, &dropped, examples.len(), opts.drop_empty)?;
        let pad_id = tok.pad_id().or(tok.eos_id()).unwrap_or(0);
        Ok(Self::assemble(path.into(), examples, origins, dropped, opts.pack_seq_len, pad_id))
    }

    /// The dataset of `examples` (packed into rows of `pack_seq_len`
    /// positions when given) and its statistics, which count the `dropped`
    /// examples as read, cut and left without targets.
    pub(crate) fn assemble(
        source: PathBuf,
        examples: Vec<Example>,
        origins: Vec<Origin>,
        dropped: Vec<Origin>,
        pack_seq_len: Option<usize>,
        pad_id: u32,
    ) -> Self {
        let read = || origins.iter().chain(&dropped);
        let mut stats = SftStats {
            n_examples: examples.len(),
            n_chat: read().filter(|o| o.chat).count(),
            n_truncated: read().filter(|o| o.truncated).count(),
            n_without_targets: dropped.len(),
            n_targets: examples.iter().map(|e| e.n_targets() as u64).sum(),
            ..SftStats::default()
        };
        let rows = pack_seq_len.map(|seq_len| {
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
        let dropped_lines = dropped.iter().map(|o| o.line).collect();
        Self { source, examples, origins, rows, pad_id, stats, dropped, dropped_lines }
    }

    /// Splits into (training, validation): the last `round(n ·
    /// val_fraction)` of the n examples kept, at least one, are validation
    /// (as the text formats hold out the last `val_fraction` of their
    /// tokens); both are packed as this dataset is. A dropped line
    /// ([`Self::dropped_lines`]) stays with the part its line falls in. An
    /// error when either part would be empty.
    pub fn split_tail(self, val_fraction: f64) -> Result<(Self, Self), DataError> {
        let n = self.examples.len();
        let n_val = crate::dataset::n_val_tokens(n, val_fraction).max(1);
        if n_val >= n {
            return Err(DataError::TooFewExamples { path: self.source, n, n_val, val_fraction });
        }
        let n_train = n - n_val;
        let first_val_line = self.origins[n_train].line;
        let pack = self.rows.as_ref().map(|(seq_len, _)| *seq_len);
        let (mut examples, mut origins) = (self.examples, self.origins);
        let (val_examples, val_origins) = (examples.split_off(n_train), origins.split_off(n_train));
        let (train_dropped, val_dropped) = self.dropped.iter().partition(|o| o.line < first_val_line);
        let train = Self::assemble(self.source.clone(), examples, origins, train_dropped, pack, self.pad_id);
        let val = Self::assemble(self.source, val_examples, val_origins, val_dropped, pack, self.pad_id);
        Ok((train, val))
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
pub(crate) mod tests;
