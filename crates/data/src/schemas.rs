//! The line schemas of fine-tuning JSON Lines (`data.schema`): what each
//! line holds and the record it becomes.
//!
//! | schema | a line | becomes |
//! |---|---|---|
//! | `text` | `{"text": str}` | text, every token a target |
//! | `messages` | `{"messages": [{"role", "content"}, …]}` | a chat |
//! | `alpaca` | `{"instruction", "input" (optional), "output"}` | a chat: user = instruction (+ `"\n\n"` + input when input is not empty), assistant = output |
//! | `sharegpt` | `{"conversations": [{"from", "value"}, …]}` | a chat: `from` = `system`, `human` / `user`, `gpt` / `assistant` |
//! | `prompt_completion` | `{"prompt": str, "completion": str}` | plain text, only the completion a target |
//! | `prompt_completion` | `{"prompt": [messages], "completion": [messages]}` | a chat, only the completion's (assistant) messages targets |
//!
//! With `auto` each line's schema is told by its keys: `text`, `messages`,
//! `conversations`, `instruction` + `output`, `prompt` + `completion`. A line
//! with the keys of two schemas is refused (set `data.schema` to say which);
//! other keys are ignored. A forced schema reads every line as that schema.

use crate::chat::{Message, Role};
use crate::error::DataError;
use serde_json::Value;
use std::path::Path;

/// `data.schema`: how the lines of a JSON Lines file are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schema {
    /// Each line's schema from its keys.
    #[default]
    Auto,
    /// `{"text": str}`.
    Text,
    /// `{"messages": [{"role", "content"}, …]}`.
    Messages,
    /// `{"instruction", "input", "output"}` (Stanford Alpaca).
    Alpaca,
    /// `{"conversations": [{"from", "value"}, …]}`.
    #[serde(rename = "sharegpt")]
    ShareGpt,
    /// `{"prompt", "completion"}` (TRL's prompt-completion format): two
    /// strings, or two lists of messages.
    PromptCompletion,
}

/// Every schema a line can have, with the keys that tell it (all must be
/// present) and how the error message describes it.
const SHAPES: [(Schema, &[&str], &str); 5] = [
    (Schema::Text, &["text"], "\"text\" (a string)"),
    (Schema::Messages, &["messages"], "\"messages\" (an array of {\"role\", \"content\"})"),
    (Schema::Alpaca, &["instruction", "output"], "\"instruction\" and \"output\" (Alpaca; \"input\" optional)"),
    (Schema::ShareGpt, &["conversations"], "\"conversations\" (ShareGPT: an array of {\"from\", \"value\"})"),
    (
        Schema::PromptCompletion,
        &["prompt", "completion"],
        "\"prompt\" and \"completion\" (two strings, or two arrays of messages)",
    ),
];

impl Schema {
    /// The name `data.schema` spells it with.
    pub fn name(self) -> &'static str {
        match self {
            Schema::Auto => "auto",
            Schema::Text => "text",
            Schema::Messages => "messages",
            Schema::Alpaca => "alpaca",
            Schema::ShareGpt => "sharegpt",
            Schema::PromptCompletion => "prompt_completion",
        }
    }

    /// The schemas whose keys are all present (`has` tells a key): one
    /// for a well-formed record, none or several for an ambiguous one.
    pub fn fitting(has: &dyn Fn(&str) -> bool) -> Vec<Schema> {
        SHAPES.iter().filter(|(_, keys, _)| keys.iter().all(|k| has(k))).map(|(s, _, _)| *s).collect()
    }

    /// The keys (columns) a record of this schema has, for messages: every
    /// schema's for `auto` ("\"text\" (a string), …, or \"prompt\" and …").
    pub fn describe_columns(self) -> String {
        let listed: Vec<&str> =
            SHAPES.iter().filter(|(s, _, _)| self == Schema::Auto || *s == self).map(|(_, _, d)| *d).collect();
        match listed.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{}, or {last}", rest.join(", ")),
            Some((last, _)) => (*last).into(),
            None => String::new(),
        }
    }

    /// The keys that tell this schema (none for `auto`).
    fn keys(self) -> &'static [&'static str] {
        SHAPES.iter().find(|(s, _, _)| *s == self).map_or(&[], |(_, keys, _)| keys)
    }
}

/// Where a line came from, for errors.
pub(crate) struct Line<'a> {
    pub(crate) path: &'a Path,
    pub(crate) line: usize,
}

impl Line<'_> {
    pub(crate) fn bad(&self, problem: impl Into<String>) -> DataError {
        DataError::BadExample { path: self.path.into(), line: self.line, problem: problem.into() }
    }

    pub(crate) fn no_targets(&self, problem: impl Into<String>) -> DataError {
        DataError::NoTargets { path: self.path.into(), line: self.line, problem: problem.into() }
    }
}

/// What a line says, before tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    /// Text trained on whole.
    Text(String),
    /// A conversation; the assistant messages from index `trained_from` on
    /// are the targets.
    Chat {
        /// The conversation.
        messages: Vec<Message>,
        /// The first message whose assistant content is trained (0: all).
        trained_from: usize,
    },
    /// Plain text whose first part is context and second the target.
    Completion {
        /// Context, masked.
        prompt: String,
        /// Target.
        completion: String,
    },
}

/// The schema of a line read with `schema`: the one forced, or the one its
/// keys tell (an error listing every schema when none or two do).
fn schema_of(at: &Line<'_>, v: &Value, schema: Schema) -> Result<Schema, DataError> {
    if schema != Schema::Auto {
        return Ok(schema);
    }
    let has = |k: &str| v.get(k).is_some();
    let found = Schema::fitting(&has);
    match found[..] {
        [one] => Ok(one),
        [] => {
            let mut problem = format!("expected an object with {}", Schema::describe_columns(Schema::Auto));
            for (_, keys, _) in SHAPES.iter().filter(|(_, keys, _)| keys.len() > 1) {
                let (present, missing): (Vec<&str>, Vec<&str>) = keys.iter().partition(|k| has(k));
                if let ([present], [missing]) = (&present[..], &missing[..]) {
                    problem.push_str(&format!(" (it has \"{present}\" but no \"{missing}\")"));
                }
            }
            Err(at.bad(problem))
        }
        _ => {
            let names: Vec<String> = found.iter().map(|s| format!("{} ({})", s.name(), s.keys().join(" + "))).collect();
            Err(at.bad(format!(
                "has the keys of more than one schema: {}; give one, or set data.schema to say which",
                names.join(" and ")
            )))
        }
    }
}

/// A line as a record, read as `schema` (`auto`: its keys tell which).
pub(crate) fn parse_record(at: &Line<'_>, v: &Value, schema: Schema) -> Result<Record, DataError> {
    let forced = |problem: String| match schema {
        Schema::Auto => problem,
        _ => format!("{problem} (read as data.schema = \"{}\")", schema.name()),
    };
    let schema = schema_of(at, v, schema)?;
    let string = |key: &str| -> Result<&str, DataError> {
        match v.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(_) => Err(at.bad(forced(format!("\"{key}\" must be a string")))),
            None => Err(at.bad(forced(format!("no \"{key}\"")))),
        }
    };
    let field = |key: &str| v.get(key).ok_or_else(|| at.bad(forced(format!("no \"{key}\""))));
    Ok(match schema {
        Schema::Auto | Schema::Text => Record::Text(string("text")?.into()),
        Schema::Messages => {
            Record::Chat { messages: chat(at, parse_messages(at, field("messages")?)?)?, trained_from: 0 }
        }
        Schema::Alpaca => {
            let mut user = string("instruction")?.to_string();
            match v.get("input") {
                None | Some(Value::Null) => {}
                Some(Value::String(input)) if input.is_empty() => {}
                Some(Value::String(input)) => {
                    user.push_str("\n\n");
                    user.push_str(input);
                }
                Some(_) => return Err(at.bad(forced("\"input\" must be a string (or absent)".into()))),
            }
            let messages = vec![Message::new(Role::User, user), Message::new(Role::Assistant, string("output")?)];
            Record::Chat { messages: chat(at, messages)?, trained_from: 0 }
        }
        Schema::ShareGpt => {
            let messages = parse_turns(at, field("conversations")?, "conversations", ("from", "value"), sharegpt_role)?;
            Record::Chat { messages: chat(at, messages)?, trained_from: 0 }
        }
        Schema::PromptCompletion => match (field("prompt")?, field("completion")?) {
            (Value::String(prompt), Value::String(completion)) => {
                if completion.is_empty() {
                    return Err(at.no_targets("\"completion\" is empty"));
                }
                Record::Completion { prompt: prompt.clone(), completion: completion.clone() }
            }
            (prompt @ Value::Array(_), completion @ Value::Array(_)) => {
                let mut messages = parse_messages(at, prompt)?;
                let trained_from = messages.len();
                let reply = parse_messages(at, completion)?;
                if reply.is_empty() {
                    return Err(at.no_targets("\"completion\" holds no message"));
                }
                if let Some(i) = reply.iter().position(|m| m.role != Role::Assistant) {
                    return Err(at.bad(format!(
                        "completion message {i} is not the assistant's: the completion is what the model is trained to say"
                    )));
                }
                messages.extend(reply);
                Record::Chat { messages: chat(at, messages)?, trained_from }
            }
            _ => {
                return Err(at.bad(forced(
                    "\"prompt\" and \"completion\" must both be strings or both arrays of {\"role\", \"content\"}"
                        .into(),
                )))
            }
        },
    })
}

/// `messages` checked to hold an assistant message, the only content
/// trained on, and no blank one.
fn chat(at: &Line<'_>, messages: Vec<Message>) -> Result<Vec<Message>, DataError> {
    let blank = messages.iter().position(|m| m.role == Role::Assistant && m.content.trim().is_empty());
    if let Some(message_idx) = blank {
        return Err(DataError::EmptyAssistant { path: at.path.into(), line: at.line, message_idx });
    }
    if !messages.iter().any(|m| m.role == Role::Assistant) {
        return Err(at.no_targets("no assistant message: only assistant content is trained on"));
    }
    Ok(messages)
}

/// ShareGPT's `from`, with the chat roles axolotl also accepts.
fn sharegpt_role(from: &str) -> Option<Role> {
    match from {
        "system" => Some(Role::System),
        "human" | "user" => Some(Role::User),
        "gpt" | "assistant" => Some(Role::Assistant),
        _ => None,
    }
}

/// An array of `{"role", "content"}` messages.
pub(crate) fn parse_messages(at: &Line<'_>, v: &Value) -> Result<Vec<Message>, DataError> {
    parse_turns(at, v, "messages", ("role", "content"), Role::parse)
}

/// The array `v` (called `name` in errors) of objects whose `keys` are
/// (speaker, text) strings, the speaker read by `role`.
fn parse_turns(
    at: &Line<'_>,
    v: &Value,
    name: &str,
    keys: (&str, &str),
    role: fn(&str) -> Option<Role>,
) -> Result<Vec<Message>, DataError> {
    let (role_key, content_key) = keys;
    let list = v
        .as_array()
        .ok_or_else(|| at.bad(format!("\"{name}\" must be an array of {{\"{role_key}\", \"{content_key}\"}}")))?;
    let mut messages = Vec::with_capacity(list.len());
    for (message_idx, m) in list.iter().enumerate() {
        let field = |key: &str| {
            m.get(key)
                .and_then(|f| f.as_str())
                .ok_or_else(|| at.bad(format!("message {message_idx} needs a string \"{key}\"")))
        };
        let role_name = field(role_key)?;
        let role = match role(role_name) {
            Some(r) => r,
            None if role_key == "role" => {
                return Err(DataError::UnknownRole {
                    path: at.path.into(),
                    line: at.line,
                    message_idx,
                    role: role_name.into(),
                })
            }
            None => {
                return Err(at.bad(format!(
                    "message {message_idx} is from `{role_name}`; expected system, human (or user), gpt (or assistant)"
                )))
            }
        };
        messages.push(Message::new(role, field(content_key)?));
    }
    Ok(messages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sft::tests::byte_chatml;
    use crate::sft::{Example, SftDataset, SftOptions};
    use crate::tokenizer::Tokenizer;

    fn examples_as(tok: &Tokenizer, jsonl: &str, schema: Schema) -> Result<Vec<Example>, DataError> {
        let ds = SftDataset::from_jsonl_as(Path::new("train.jsonl"), jsonl, tok, &SftOptions::default(), schema)?;
        Ok(ds.examples().to_vec())
    }

    fn examples(tok: &Tokenizer, jsonl: &str) -> Vec<Example> {
        examples_as(tok, jsonl, Schema::Auto).unwrap()
    }

    fn err_as(jsonl: &str, schema: Schema) -> String {
        examples_as(&byte_chatml(), jsonl, schema).unwrap_err().to_string()
    }

    /// `{"messages": …}` of (role, content) pairs.
    fn messages_line(turns: &[(&str, &str)]) -> String {
        let m: Vec<Value> = turns.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
        serde_json::json!({ "messages": m }).to_string()
    }

    /// Alpaca, ShareGPT and conversational prompt/completion lines with
    /// the messages line they stand for, in `tok`'s tokens.
    fn assert_chat_schemas_equal_messages(tok: &Tokenizer) {
        let cases: Vec<(Value, Vec<(&str, &str)>)> = vec![
            (
                serde_json::json!({"instruction": "Add.", "input": "2 3", "output": "5"}),
                vec![("user", "Add.\n\n2 3"), ("assistant", "5")],
            ),
            (
                serde_json::json!({"instruction": "Hi.", "input": "", "output": "Hello"}),
                vec![("user", "Hi."), ("assistant", "Hello")],
            ),
            (
                serde_json::json!({"instruction": "Hi.", "output": "Hello"}),
                vec![("user", "Hi."), ("assistant", "Hello")],
            ),
            (
                serde_json::json!({"instruction": "Hi.", "input": null, "output": "Hello"}),
                vec![("user", "Hi."), ("assistant", "Hello")],
            ),
            (
                serde_json::json!({"conversations": [
                    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q1"},
                    {"from": "gpt", "value": "A1"}, {"from": "user", "value": "Q2"}, {"from": "assistant", "value": "A2"}
                ], "id": "x"}),
                vec![("system", "Be brief."), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")],
            ),
            (
                serde_json::json!({"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]}),
                vec![("user", "Q"), ("assistant", "A")],
            ),
        ];
        for (line, turns) in cases {
            let want = examples(tok, &messages_line(&turns));
            assert_eq!(examples(tok, &line.to_string()), want, "{line}");
        }
    }

    #[test]
    fn chat_schemas_give_the_examples_of_their_messages_lines() {
        assert_chat_schemas_equal_messages(&byte_chatml());
    }

    /// The same on SmolLM2's own tokenizer and chat template (which inserts
    /// a default system prompt); prompt/completion strings are the prompt's
    /// ids, the completion's, then EOS, only the last two parts targets.
    #[test]
    fn schemas_on_smollm2_match_messages_and_text_plus_mask() {
        let Some(path) = gguf::testing::smollm2_or_skip("schemas_on_smollm2") else { return };
        let tok = Tokenizer::from_gguf(&path).unwrap();
        assert_chat_schemas_equal_messages(&tok);
        let (prompt, completion) = ("The capital of France is", " Paris.");
        let line = serde_json::json!({"prompt": prompt, "completion": completion}).to_string();
        let got = examples(&tok, &line).remove(0);
        let (p, c) = (tok.encode(prompt).unwrap(), tok.encode(completion).unwrap());
        let eos = tok.eos_id().unwrap();
        assert_eq!(got.tokens, [p.clone(), c.clone(), vec![eos]].concat());
        let want: Vec<bool> = (0..got.tokens.len()).map(|j| j >= p.len()).collect();
        assert_eq!(got.trained, want);
    }

    /// Prompt/completion strings on bytes: the tokens of the `text` line
    /// of prompt + completion, with the prompt's tokens no target.
    #[test]
    fn prompt_completion_strings_are_text_with_the_prompt_masked() {
        let tok = byte_chatml();
        let got = examples(&tok, r#"{"prompt": "2+2=", "completion": "4"}"#).remove(0);
        let text = examples(&tok, r#"{"text": "2+2=4"}"#).remove(0);
        assert_eq!(got.tokens, text.tokens);
        assert_eq!(got.trained, [vec![false; 4], vec![true; 2]].concat());
        assert_eq!(got.n_targets(), 2, "the completion's one token and the EOS");
        // an empty prompt trains as the `text` line of the completion
        let alone = examples(&tok, r#"{"prompt": "", "completion": "abc"}"#);
        assert_eq!(alone, examples(&tok, r#"{"text": "abc"}"#));
        // no chat template is needed
        let bytes = Tokenizer::Byte(crate::ByteTokenizer);
        assert_eq!(examples(&bytes, r#"{"prompt": "ab", "completion": "c"}"#)[0].tokens, vec![97, 98, 99]);
    }

    /// A conversational prompt holding an earlier assistant turn: the
    /// tokens of the messages line, but only the completion's turn trained.
    #[test]
    fn conversational_prompt_turns_are_context() {
        let tok = byte_chatml();
        let line = serde_json::json!({
            "prompt": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}],
            "completion": [{"role": "assistant", "content": "Z"}],
        });
        let got = examples(&tok, &line.to_string()).remove(0);
        let full =
            examples(&tok, &messages_line(&[("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "Z")]))
                .remove(0);
        assert_eq!(got.tokens, full.tokens);
        assert_eq!(full.n_targets(), 3 + 2);
        let trained: Vec<u32> = got.tokens.iter().zip(&got.trained).filter(|(_, &t)| t).map(|(&x, _)| x).collect();
        assert_eq!(trained, vec![u32::from(b'Z'), 257], "Z and <|im_end|>");
    }

    /// `auto` tells the schema by its keys and refuses a line with two
    /// schemas' keys; a forced schema reads that line as itself, and a line
    /// of another schema is an error naming the line and the schema.
    #[test]
    fn detection_and_forced_schemas() {
        let tok = byte_chatml();
        let both = r#"{"text": "Q: Hi A: Yo", "instruction": "Hi", "input": "", "output": "Yo"}"#;
        let e = err_as(both, Schema::Auto);
        assert!(
            e.starts_with(
                "train.jsonl:1: has the keys of more than one schema: text (text) and alpaca (instruction + output)"
            ),
            "{e}"
        );
        assert!(e.contains("data.schema"), "{e}");
        let as_alpaca = examples_as(&tok, both, Schema::Alpaca).unwrap();
        assert_eq!(as_alpaca, examples(&tok, &messages_line(&[("user", "Hi"), ("assistant", "Yo")])));
        let as_text = examples_as(&tok, both, Schema::Text).unwrap();
        assert_eq!(as_text, examples(&tok, r#"{"text": "Q: Hi A: Yo"}"#));
        // ultrachat's lines carry a "prompt" beside "messages": a messages line
        let ultrachat = r#"{"prompt": "Hi", "prompt_id": "1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}"#;
        assert_eq!(examples(&tok, ultrachat), as_alpaca);
        let jsonl = format!("{}\n{}", r#"{"text": "ok"}"#, messages_line(&[("user", "a"), ("assistant", "b")]));
        let e = err_as(&jsonl, Schema::Text);
        assert_eq!(e, "train.jsonl:2: no \"text\" (read as data.schema = \"text\")");
        let e = err_as(r#"{"messages": []}"#, Schema::ShareGpt);
        assert_eq!(e, "train.jsonl:1: no \"conversations\" (read as data.schema = \"sharegpt\")");
        let e = err_as(r#"{"prompt": "a", "completion": "b"}"#, Schema::Alpaca);
        assert_eq!(e, "train.jsonl:1: no \"instruction\" (read as data.schema = \"alpaca\")");
        let e = err_as(r#"{"text": "a"}"#, Schema::PromptCompletion);
        assert_eq!(e, "train.jsonl:1: no \"prompt\" (read as data.schema = \"prompt_completion\")");
        let e = err_as(r#"{"instruction": 3, "output": "b"}"#, Schema::Alpaca);
        assert_eq!(e, "train.jsonl:1: \"instruction\" must be a string (read as data.schema = \"alpaca\")");
    }

    /// Every malformed line is named by its line, with what is wrong.
    #[test]
    fn malformed_lines_name_their_line() {
        let e = err_as("\n{\"text\": \"ok\"}\n{\"instruction\": \"x\"}", Schema::Auto);
        assert!(e.starts_with("train.jsonl:3: expected an object with \"text\" (a string), \"messages\""), "{e}");
        for named in
            ["\"conversations\" (ShareGPT", "\"instruction\" and \"output\" (Alpaca", "\"prompt\" and \"completion\""]
        {
            assert!(e.contains(named), "{named}: {e}");
        }
        assert!(e.ends_with("(it has \"instruction\" but no \"output\")"), "{e}");
        let e = err_as(
            r#"{"conversations": [{"from": "human", "value": "x"}, {"from": "bot", "value": "y"}]}"#,
            Schema::Auto,
        );
        assert_eq!(e, "train.jsonl:1: message 1 is from `bot`; expected system, human (or user), gpt (or assistant)");
        let e = err_as(r#"{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt"}]}"#, Schema::Auto);
        assert_eq!(e, "train.jsonl:1: message 1 needs a string \"value\"");
        let e = err_as(r#"{"conversations": [{"from": "human", "value": "x"}]}"#, Schema::Auto);
        assert!(e.starts_with("train.jsonl:1: no assistant message"), "{e}");
        let e = err_as(r#"{"instruction": "x", "output": " "}"#, Schema::Auto);
        assert_eq!(e, "train.jsonl:1: message 1 (assistant) has empty content");
        let e = err_as(r#"{"instruction": "x", "input": 2, "output": "y"}"#, Schema::Auto);
        assert_eq!(e, "train.jsonl:1: \"input\" must be a string (or absent)");
        let e = err_as(r#"{"prompt": "x", "completion": ""}"#, Schema::Auto);
        assert_eq!(e, "train.jsonl:1: \"completion\" is empty");
        let e = err_as(r#"{"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]}"#, Schema::Auto);
        assert!(
            e.starts_with("train.jsonl:1: \"prompt\" and \"completion\" must both be strings or both arrays"),
            "{e}"
        );
        let e = err_as(r#"{"prompt": [], "completion": [{"role": "user", "content": "y"}]}"#, Schema::Auto);
        assert!(e.starts_with("train.jsonl:1: completion message 0 is not the assistant's"), "{e}");
        let e = err_as(r#"{"prompt": [], "completion": []}"#, Schema::Auto);
        assert_eq!(e, "train.jsonl:1: \"completion\" holds no message");
        // a chat schema without a chat template names the fix
        let bytes = Tokenizer::Byte(crate::ByteTokenizer);
        for line in [r#"{"instruction": "x", "output": "y"}"#, r#"{"conversations": [{"from": "gpt", "value": "y"}]}"#]
        {
            let e = examples_as(&bytes, line, Schema::Auto).unwrap_err();
            assert!(matches!(e, DataError::NoChatTemplate { .. }), "{e}");
            assert!(e.to_string().contains("Alpaca, ShareGPT"), "{e}");
        }
    }

    /// `split_tail`: the last round(n · f) examples, at least one, are
    /// validation, in file order; too few examples is an error.
    #[test]
    fn val_fraction_holds_out_the_last_examples() {
        let tok = byte_chatml();
        let jsonl = |n: usize| (0..n).map(|i| format!("{{\"text\": \"ex{i}\"}}")).collect::<Vec<_>>().join("\n");
        let load = |n: usize, pack: Option<usize>| {
            let opts = SftOptions { pack_seq_len: pack, ..SftOptions::default() };
            SftDataset::from_jsonl(Path::new("t.jsonl"), &jsonl(n), &tok, &opts).unwrap()
        };
        for (n, f, n_val) in [(10, 0.1, 1), (10, 0.25, 3), (10, 0.5, 5), (3, 0.01, 1), (2, 0.1, 1), (20, 0.04, 1)] {
            let whole = load(n, None);
            let (train, val) = whole.clone().split_tail(f).unwrap();
            assert_eq!((train.stats().n_examples, val.stats().n_examples), (n - n_val, n_val), "n {n} f {f}");
            assert_eq!(train.examples(), &whole.examples()[..n - n_val]);
            assert_eq!(val.examples(), &whole.examples()[n - n_val..]);
            assert_eq!(train.stats().n_targets + val.stats().n_targets, whole.stats().n_targets);
        }
        // packing applies to each part
        let (train, val) = load(10, Some(10)).split_tail(0.3).unwrap();
        assert_eq!((train.n_samples(), val.n_samples()), (4, 2), "7 examples of 4 tokens, then 3, two to a row");
        assert_eq!(train.max_positions(), 10);
        for (n, f) in [(1, 0.1), (2, 0.9), (4, 0.95)] {
            let e = load(n, None).split_tail(f).unwrap_err().to_string();
            let want = format!("t.jsonl: cannot hold out data.val_fraction = {f} of {n} example(s)");
            assert!(e.starts_with(&want), "{e}");
            assert!(e.contains("data.val_path"), "{e}");
        }
    }
}
