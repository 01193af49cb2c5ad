//! Tests of fine-tuning examples: masking, padding, packing, truncation and errors.

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
        format!(r#"{{"messages": [{{"role": "user", "content": "{q}"}}, {{"role": "assistant", "content": "ok"}}]}}"#)
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
    assert!(e.contains("more than one schema: text (text) and messages (messages)"), "{e}");
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
