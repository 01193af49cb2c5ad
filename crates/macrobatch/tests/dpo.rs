//! `train.objective = "dpo"` through the command line on a small Llama
//! with LoRA and byte tokens: the first step's loss is exactly ln 2 (the
//! adapters start at B = 0, so the policy is the reference), the rewards
//! are reported and learning separates them, micro 1 × K 8 computes the
//! same step as micro 8 × K 1 (`verify`), and settings DPO cannot run with
//! are refused before the first step.

mod common;
use common::*;
use std::path::{Path, PathBuf};

/// 48 preference pairs: the chosen reply names the prompt's number, the
/// rejected one another.
fn pairs_file(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("pairs.jsonl");
    let lines: Vec<String> = (0..48)
        .map(|i| {
            serde_json::json!({
                "prompt": format!("Q{}: which number? ", i % 12),
                "chosen": format!("A{}.", i % 12),
                "rejected": format!("B{}!", (i * 5 + 3) % 12),
            })
            .to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

fn dpo_sets(pairs: &Path) -> Vec<String> {
    [
        "model.family=llama",
        "model.preset=tiny",
        "model.n_layer=2",
        "data.tokenizer=byte",
        "data.format=jsonl",
        "data.seq_len=32",
        "data.val_fraction=0.25",
        "lora.r=4",
        "lora.alpha=8",
        "lora.target_modules=[\"all-linear\"]",
        "train.objective=dpo",
        "train.dpo_beta=0.5",
        "batch.global=8",
        "optim.lr=1e-2",
        "optim.weight_decay=0.0",
        "schedule.warmup_steps=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("data.path={}", pairs.display())])
    .collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn dpo_starts_at_ln2_reports_rewards_and_learns_to_prefer_the_chosen_reply() {
    let dir = tmp("dpo-train");
    let pairs = pairs_file(&dir);
    let sets =
        [dpo_sets(&pairs), vec!["batch.micro=2".into(), "train.steps=12".into(), "train.eval_every=6".into()]].concat();
    let out = dir.join("run");
    let o = train(&out, &refs(&sets));
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(&out);
    // Step 1: B = 0 ⇒ π = ρ ⇒ Δ = 0 for every pair: loss = softplus(0) = ln 2,
    // each reward 0 (the mean of 8 exact ln 2 values may round by an ulp).
    let first = &m[0];
    assert!((first["loss"].as_f64().unwrap() - std::f64::consts::LN_2).abs() < 1e-12, "{first}");
    for key in ["rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"] {
        assert_eq!(first[key].as_f64(), Some(0.0), "{key} at step 1: {first}");
    }
    assert_eq!(first["tokens"].as_u64(), Some(8), "one target per pair of the global batch");
    // The progress line names what the rate counts.
    let err = stderr(&o);
    assert!(err.contains(" pairs/s)") && !err.contains("targets/s"), "{err}");
    let last = m.last().unwrap();
    assert!(last["loss"].as_f64().unwrap() < 0.6, "the DPO loss falls below ln 2: {last}");
    assert!(last["rewards_margin"].as_f64().unwrap() > 0.0, "{last}");
    assert!(last["rewards_accuracy"].as_f64().unwrap() >= 0.75, "{last}");
    assert!(last["val_loss"].as_f64().is_some_and(|v| v.is_finite()), "validation pairs are scored: {last}");
    // The adapters are saved in PEFT's format, as for any LoRA run.
    assert!(out.join("adapter_model.safetensors").exists() && out.join("adapter_config.json").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dpo_micro_1_k_8_takes_the_same_step_as_micro_8() {
    let dir = tmp("dpo-verify");
    let pairs = pairs_file(&dir);
    let sets = [dpo_sets(&pairs), vec!["batch.micro=1".into(), "batch.accumulation_steps=8".into()]].concat();
    let mut c = bin();
    c.arg("verify");
    with_sets(&mut c, &refs(&sets));
    let o = c.output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    assert!(out.contains("PASS"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn settings_dpo_cannot_run_with_are_refused_before_the_first_step() {
    let dir = tmp("dpo-refused");
    let pairs = pairs_file(&dir);
    let base = dpo_sets(&pairs);
    let no_lora: Vec<String> = base.iter().filter(|s| !s.starts_with("lora.")).cloned().collect();
    refused_train("dpo-no-lora", None, &refs(&no_lora), &["[lora]"]);
    let packed = [base.clone(), vec!["data.pack=true".into()]].concat();
    refused_train("dpo-packed", None, &refs(&packed), &["data.pack"]);
    let beta = [base.clone(), vec!["train.dpo_beta=0".into()]].concat();
    refused_train("dpo-beta", None, &refs(&beta), &["train.dpo_beta"]);
    let text = [base, vec!["data.format=text".into()]].concat();
    refused_train("dpo-text", None, &refs(&text), &["data.format", "jsonl"]);
    // A line without "rejected" names its line and the keys.
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"a\", \"chosen\": \"b\"}\n").unwrap();
    let sets = [dpo_sets(&bad), vec!["data.val_fraction=0.5".into()]].concat();
    refused_train("dpo-bad-line", None, &refs(&sets), &["bad.jsonl:1", "\"rejected\" missing"]);
    // An empty reply is named by its own key, not the "completion" it stands for.
    for side in ["chosen", "rejected"] {
        let empty = dir.join(format!("empty-{side}.jsonl"));
        let mut line = serde_json::json!({"prompt": "a", "chosen": "b", "rejected": "c"});
        line[side] = "".into();
        std::fs::write(&empty, format!("{line}\n")).unwrap();
        let sets = [dpo_sets(&empty), vec!["data.val_fraction=0.5".into()]].concat();
        let needle = format!("\"{side}\" is empty");
        refused_train(&format!("dpo-empty-{side}"), None, &refs(&sets), &[&format!("empty-{side}.jsonl:1"), &needle]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
