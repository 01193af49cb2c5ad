//! The memory wall from the command line: activation checkpointing changes
//! no loss, `batch.micro = "auto"` keeps the global batch and trains exactly
//! like the same factorization set by hand, an impossible budget is a clear
//! error, and `macrobatch plan` reports breakdowns for shapes far beyond
//! this machine.

mod common;
use common::*;

fn run_ok(out: &std::path::Path, sets: &[&str]) -> std::process::Output {
    let o = train(out, sets);
    assert!(o.status.success(), "{}", stderr(&o));
    o
}

#[test]
fn checkpointing_changes_no_loss_and_lowers_activation_memory() {
    let base = [SMALL, &["train.steps=4", "train.eval_every=2", "batch.global=8", "batch.micro=4"]].concat();
    let none = tmp("ck-none");
    run_ok(&none, &base);
    let ma = metrics(&none);
    let act = |m: &serde_json::Value| m["mem_activations"].as_u64().expect("mem_activations");
    // Each mode keeps less than none, and "selective" (everything made
    // without a matrix multiply) less than "attention" (its output alone).
    // ("blocks" keeps least per block but holds a whole block's working
    // set besides: on this 2-block model that is more than "selective".)
    let mut act_of = std::collections::BTreeMap::new();
    for mode in ["attention", "selective", "blocks"] {
        let b = tmp(&format!("ck-{mode}"));
        run_ok(&b, &[base.as_slice(), &[format!("train.activation_checkpointing={mode}").as_str()]].concat());
        let mb = metrics(&b);
        for (x, y) in ma.iter().zip(&mb) {
            for key in ["loss", "grad_norm", "val_loss"] {
                assert_eq!(x[key], y[key], "{mode}: {key} at step {}", x["step"]);
            }
        }
        assert!(act(&mb[0]) < act(&ma[0]), "{mode}: {} >= {}", act(&mb[0]), act(&ma[0]));
        act_of.insert(mode, act(&mb[0]));
        assert_eq!(weights(&none), weights(&b), "{mode}: final weights bit-identical");
        std::fs::remove_dir_all(b).unwrap();
    }
    assert!(act_of["selective"] < act_of["attention"], "{act_of:?}");
    std::fs::remove_dir_all(none).unwrap();
}

#[test]
fn auto_micro_keeps_the_global_batch_and_equals_the_hand_set_factorization() {
    let base = [SMALL, &["train.steps=3", "train.eval_every=0", "batch.global=16"]].concat();
    let auto = tmp("auto");
    let o = run_ok(&auto, &[base.as_slice(), &["batch.micro=auto", "train.memory_budget=2GiB"]].concat());
    let resolved = std::fs::read_to_string(auto.join("config.resolved.toml")).unwrap();
    let table: toml::Table = toml::from_str(&resolved).unwrap();
    let micro = table["batch"]["micro"].as_integer().expect("a number, not \"auto\"");
    let k = table["batch"]["accumulation_steps"].as_integer().unwrap();
    assert_eq!((table["batch"]["global"].as_integer(), micro * k), (Some(16), 16), "global batch kept");
    assert!(stderr(&o).contains("batch.micro = \"auto\": micro"), "{}", stderr(&o));
    // A 2 GiB budget holds the whole batch of this small model at once.
    assert_eq!(micro, 16);
    // A budget between the plans for micro 4 and 8: micro 4 is the largest
    // that fits (the run checks its measured peak against the budget).
    let planned = |micro: usize| -> u64 {
        let mut c = bin();
        c.args(["plan", "--json", "--memory", "1GiB"]);
        with_sets(&mut c, &[base.as_slice(), &[format!("batch.micro={micro}").as_str()]].concat());
        let o = c.output().unwrap();
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("plan --json");
        // What must fit: the peak over every phase with the margin.
        r["configured_needed"].as_u64().unwrap()
    };
    let tight = tmp("auto-tight");
    // Halfway between the plans for micro 4 and micro 8: each process
    // measures its own program size at start-up, which varies by a few
    // hundred KiB between processes; half the gap (~2 MiB) absorbs that.
    let budget = format!("train.memory_budget={}", (planned(4) + planned(8)) / 2);
    let budget = budget.as_str();
    let o = run_ok(&tight, &[base.as_slice(), &["batch.micro=auto", budget]].concat());
    let table: toml::Table =
        toml::from_str(&std::fs::read_to_string(tight.join("config.resolved.toml")).unwrap()).unwrap();
    let micro = table["batch"]["micro"].as_integer().unwrap();
    assert_eq!(micro, 4, "{}", stderr(&o));
    let peak = metrics(&tight)[0]["mem_peak_rss"].as_u64().unwrap();
    assert!(peak < planned(8), "measured peak {peak} over the budget");
    // The same factorization by hand: bit-identical losses.
    let hand = tmp("auto-hand");
    run_ok(&hand, &[base.as_slice(), &[format!("batch.micro={micro}").as_str()]].concat());
    assert_eq!(losses(&tight), losses(&hand));
    for d in [auto, tight, hand] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn an_impossible_budget_is_a_clear_error_and_leaves_nothing() {
    let out = tmp("auto-impossible");
    let o = train(&out, &[SMALL, &["batch.micro=auto", "train.memory_budget=1MiB"]].concat());
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("not even micro-batch 1 fits the memory budget of 1.0 MiB"), "{err}");
    assert!(err.contains("alternatives (global batch unchanged)"), "{err}");
    assert!(!out.exists(), "nothing created");
    let o = train(&out, &["batch.micro=auto", "batch.accumulation_steps=2"]);
    assert!(stderr(&o).contains("remove batch.accumulation_steps"), "{}", stderr(&o));
}

#[test]
fn plan_reports_shapes_beyond_this_machine() {
    let o = bin()
        .args(["plan", "--json", "--memory", "80GiB", "--world-size", "8"])
        .args(["--set", "model.preset=gpt2-xl", "--set", "batch.global=512", "--set", "batch.micro=1"])
        .args(["--set", "data.seq_len=1024", "--set", "dist.zero_stage=3", "--base-batch", "256"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["n_params"], 1_557_611_200u64);
    let c = &r["configured"];
    // ZeRO-3 over 8 ranks: 16 bytes per parameter / 8 (+ padding), f32 AdamW.
    let states = ["params", "grads", "optimizer"].iter().map(|k| c[k].as_u64().unwrap()).sum::<u64>();
    let want = 16 * 1_557_611_200u64 / 8;
    assert!(states >= want && states < want + (1 << 20), "{states} vs {want}");
    assert!(c["comm_buffers"].as_u64().unwrap() > 0, "stage 3 gathers a segment");
    assert_eq!(
        r["best"]["knobs"]["micro"].as_u64().unwrap() * r["best"]["accumulation_steps"].as_u64().unwrap() * 8,
        512
    );
    let lr = &r["lr_advice"];
    assert!((lr["sqrt"].as_f64().unwrap() / lr["base_lr"].as_f64().unwrap() - 2f64.sqrt()).abs() < 1e-6);
    // Text output names every component.
    let o = bin().args(["plan", "--memory", "8GiB"]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    for line in ["optimizer state", "activations (one micro-batch)", "largest micro-batch that fits", "alternatives"] {
        assert!(text.contains(line), "{line}: {text}");
    }
    let o = bin().args(["plan", "--memory", "lots"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not a size"), "{}", stderr(&o));
}
