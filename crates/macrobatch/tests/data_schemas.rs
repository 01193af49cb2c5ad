//! Fine-tuning data in Hugging Face's schemas through the command line:
//! the example's chats written as ShareGPT, Alpaca and conversational
//! prompt/completion lines train to the losses of their `messages` lines,
//! bit for bit, with validation held out by `data.val_fraction` (no
//! `data.val_path`); a forced `data.schema` refuses a line of another
//! schema before any run folder exists. The chat runs need the SmolLM2
//! GGUF for its tokenizer and chat template (scripts/fetch-smollm.sh).

mod common;
use common::*;
use serde_json::{json, Value};
use std::path::Path;

/// The first `n` conversations of the example's training data.
fn conversations(n: usize) -> Vec<Vec<Value>> {
    let text = std::fs::read_to_string("../../examples/smollm-lora/train.jsonl").unwrap();
    text.lines()
        .take(n)
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["messages"].as_array().unwrap().clone())
        .collect()
}

fn write_lines(path: &Path, lines: impl IntoIterator<Item = Value>) {
    let text: Vec<String> = lines.into_iter().map(|v| v.to_string()).collect();
    std::fs::write(path, text.join("\n") + "\n").unwrap();
}

/// Training and validation losses of a short LoRA run on `data`.
fn run(tag: &str, gguf: &Path, data: &Path, extra: &[&str]) -> (Vec<f64>, Vec<f64>) {
    let out = tmp(tag);
    let mut sets = vec![
        "model.family=llama".to_string(),
        "model.preset=tiny".into(),
        "model.vocab_size=49152".into(),
        "data.format=jsonl".into(),
        format!("data.path={}", data.display()),
        format!("data.tokenizer={}", gguf.display()),
        "data.seq_len=256".into(),
        "data.val_fraction=0.25".into(),
        "lora.r=4".into(),
        "lora.target_modules=[\"all-linear\"]".into(),
        "batch.micro=2".into(),
        "batch.accumulation_steps=2".into(),
        "train.steps=2".into(),
        "train.eval_every=2".into(),
        "train.threads=1".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    train_ok(&out, &sets);
    let got = (losses(&out), val_losses(&out));
    assert_eq!((got.0.len(), got.1.len()), (2, 1), "{tag}");
    std::fs::remove_dir_all(&out).unwrap();
    got
}

#[test]
fn chat_schemas_train_as_their_messages_lines() {
    let Some(gguf) = gguf::testing::smollm2_or_skip("data_schemas") else { return };
    let dir = tmp("schemas-data");
    std::fs::create_dir_all(&dir).unwrap();
    let chats = conversations(16);
    let text = |m: &Value, k: &str| m[k].as_str().unwrap().to_string();
    // system, user, assistant: as messages, ShareGPT and prompt/completion
    write_lines(&dir.join("messages.jsonl"), chats.iter().map(|c| json!({ "messages": c })));
    let from = |role: &str| {
        match role {
            "user" => "human",
            "assistant" => "gpt",
            other => other,
        }
        .to_string()
    };
    write_lines(
        &dir.join("sharegpt.jsonl"),
        chats.iter().map(|c| {
            let turns: Vec<Value> =
                c.iter().map(|m| json!({"from": from(&text(m, "role")), "value": text(m, "content")})).collect();
            json!({ "conversations": turns })
        }),
    );
    write_lines(
        &dir.join("prompt_completion.jsonl"),
        chats.iter().map(|c| json!({"prompt": c[..c.len() - 1], "completion": c[c.len() - 1..]})),
    );
    // Alpaca has no system turn: the question's first paragraph is the
    // instruction, the passage the input
    let alpaca: Vec<(String, String, String)> = chats
        .iter()
        .map(|c| {
            let user = text(&c[1], "content");
            let (instruction, input) = user.split_once("\n\n").unwrap();
            (instruction.to_string(), input.to_string(), text(&c[2], "content"))
        })
        .collect();
    write_lines(
        &dir.join("alpaca.jsonl"),
        alpaca.iter().map(|(i, x, o)| json!({"instruction": i, "input": x, "output": o})),
    );
    write_lines(
        &dir.join("alpaca_messages.jsonl"),
        alpaca.iter().map(|(i, x, o)| {
            json!({"messages": [{"role": "user", "content": format!("{i}\n\n{x}")}, {"role": "assistant", "content": o}]})
        }),
    );
    let want = run("schemas-messages", &gguf, &dir.join("messages.jsonl"), &[]);
    assert!(want.0.iter().chain(&want.1).all(|l| l.is_finite() && *l > 0.0), "{want:?}");
    for (name, schema) in [("sharegpt", "auto"), ("prompt_completion", "auto"), ("sharegpt", "sharegpt")] {
        let set = format!("data.schema={schema}");
        let got = run(&format!("schemas-{name}-{schema}"), &gguf, &dir.join(format!("{name}.jsonl")), &[&set]);
        assert_eq!(got, want, "{name} read as {schema}");
    }
    let alpaca_want = run("schemas-alpaca-messages", &gguf, &dir.join("alpaca_messages.jsonl"), &[]);
    assert_ne!(alpaca_want, want, "a different conversation (no system turn) must change the losses");
    let got = run("schemas-alpaca", &gguf, &dir.join("alpaca.jsonl"), &["data.schema=alpaca"]);
    assert_eq!(got, alpaca_want);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Refusals before anything is created: a forced schema names the line of
/// another schema; `data.schema` applies to JSON Lines only; too few
/// examples to hold out `data.val_fraction` name the fix.
#[test]
fn schema_and_val_fraction_refusals_name_the_line_and_the_fix() {
    let dir = tmp("schemas-refused");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("pc.jsonl");
    write_lines(&data, [json!({"prompt": "a", "completion": "b"}), json!({"text": "c"})]);
    let path = format!("data.path={}", data.display());
    let jsonl = tiny(&["data.format=jsonl", &path, "data.seq_len=16"]);
    let forced = [jsonl.clone(), vec!["data.schema=prompt_completion"]].concat();
    refused_train(
        "forced",
        None,
        &forced,
        &[&format!("{}:2: no \"prompt\" (read as data.schema = \"prompt_completion\")", data.display())],
    );
    refused_train(
        "schema-text",
        None,
        &tiny(&["data.schema=alpaca"]),
        &["data.schema = \"alpaca\"", "data.format = \"jsonl\""],
    );
    let one = dir.join("one.jsonl");
    write_lines(&one, [json!({"prompt": "a", "completion": "b"})]);
    let path = format!("data.path={}", one.display());
    refused_train(
        "too-few",
        None,
        &tiny(&["data.format=jsonl", &path, "data.seq_len=16"]),
        &["cannot hold out data.val_fraction = 0.1 of 1 example(s)", "data.val_path"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
