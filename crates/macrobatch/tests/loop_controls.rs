//! Loop controls through the command line: early stopping and keep-best on
//! a run whose validation loss turns up (the stop step, the kept best, a
//! resume from the best that replays the run bit for bit), the moving
//! average of the weights against one computed by hand from every step's
//! parameters (one rank and two, and across a resume), and label smoothing
//! and z-loss keeping micro 1 × K 8 equal to micro 8 × K 1.

mod common;

use common::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A tiny GPT learning a short training file at a high learning rate and
/// validated on other text: the validation loss falls, then turns up as
/// it memorises the training file.
fn overfit_sets(dir: &Path, extra: &[&str]) -> Vec<String> {
    std::fs::create_dir_all(dir).unwrap();
    let (train, val) = (dir.join("train.txt"), dir.join("val.txt"));
    let corpus = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/moby-dick.txt")).unwrap();
    let text: String = corpus.chars().skip(20_000).take(1_500).collect();
    let other: String = corpus.chars().skip(200_000).take(6_000).collect();
    std::fs::write(&train, text).unwrap();
    std::fs::write(&val, other).unwrap();
    let mut s: Vec<String> = tiny(&[
        "model.n_layer=2",
        "model.n_embd=64",
        "train.steps=300",
        "train.eval_every=10",
        "train.eval_batches=4",
        "optim.lr=3e-3",
        "schedule.kind=constant",
        "schedule.warmup_steps=0",
        "train.keep_checkpoints=1",
    ])
    .iter()
    .map(|s| s.to_string())
    .collect();
    // `tiny` turns evaluation off; the sets above come later and win.
    s.retain(|x| x != "train.eval_every=0");
    s.push(format!("data.path={}", train.display()));
    s.push(format!("data.val_path={}", val.display()));
    s.extend(extra.iter().map(|x| x.to_string()));
    s
}

fn train_strings(out: &Path, sets: &[String]) -> std::process::Output {
    let refs: Vec<&str> = sets.iter().map(String::as_str).collect();
    train(out, &refs)
}

/// Keras' EarlyStopping on `vals` (one per evaluation): the index of the
/// evaluation that stops the run.
fn keras_stop(vals: &[f64], patience: u32, min_delta: f64) -> Option<usize> {
    let (mut reference, mut wait) = (f64::INFINITY, 0);
    for (i, &v) in vals.iter().enumerate() {
        if v < reference - min_delta {
            (reference, wait) = (v, 0);
        } else {
            wait += 1;
            if wait >= patience {
                return Some(i);
            }
        }
    }
    None
}

#[test]
fn early_stopping_and_keep_best_on_a_validation_loss_that_turns_up() {
    let dir = tmp("loop-es");
    let out = dir.join("run");
    let sets = overfit_sets(&dir, &["train.early_stopping={patience=3, min_delta=0.01}", "train.keep_best=true"]);
    let o = train_strings(&out, &sets);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let m = metrics(&out);
    let evals: Vec<(u64, f64)> =
        m.iter().filter_map(|r| Some((r["step"].as_u64()?, r["val_loss"].as_f64()?))).collect();
    let vals: Vec<f64> = evals.iter().map(|e| e.1).collect();
    let (best_i, _) = vals.iter().enumerate().fold((0, f64::INFINITY), |b, (i, &v)| if v < b.1 { (i, v) } else { b });
    assert!(best_i + 1 < vals.len() && vals[best_i] < vals[0], "the validation loss falls: {evals:?}");
    // The run stopped where Keras' rule says, said why, and saved its model.
    let stop_i = keras_stop(&vals, 3, 0.01).expect("the rule stops this run");
    let stop_step = evals[stop_i].0;
    assert!(vals[stop_i] > vals[best_i] + 0.1, "…then turns up: {evals:?}");
    assert!(stop_step < 300);
    let last = m.last().unwrap();
    assert_eq!(last["step"].as_u64(), Some(stop_step), "{evals:?}");
    let reason = last["stop_reason"].as_str().expect("the stop step's line says why");
    assert!(reason.contains("early stopping"), "{reason}");
    assert!(err.contains(&format!("stopped after step {stop_step} of 300: early stopping")), "{err}");
    assert!(err.contains(&format!("done: {stop_step} steps")), "{err}");
    assert!(out.join("model.safetensors").exists());
    let ckpts = out.join("checkpoints");
    let stop_dir = ckpts.join(format!("step-{stop_step:08}"));
    assert_eq!(weights(&out), weights(&stop_dir), "the final model is the stop step's");
    // Keep-best: `checkpoints/best` names the step of the lowest validation
    // loss, kept besides the newest one (keep_checkpoints = 1).
    let best_step = evals[best_i].0;
    let best_name = format!("step-{best_step:08}");
    assert_eq!(std::fs::read_link(ckpts.join("best")).unwrap(), PathBuf::from(&best_name));
    let mut kept: Vec<String> = std::fs::read_dir(&ckpts)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    kept.sort();
    assert_eq!(kept, [best_name.clone(), format!("step-{stop_step:08}")]);
    // Resuming from the best (the newer checkpoint removed from a copy)
    // replays the rest of the run bit for bit, early stopping included.
    let copy = dir.join("copy");
    copy_dir(&out, &copy);
    std::fs::remove_dir_all(copy.join("checkpoints").join(format!("step-{stop_step:08}"))).unwrap();
    let err = resume_ok(&copy, &[]);
    assert!(err.contains("resuming from") && err.contains(&best_name), "{err}");
    let lines = |d: &Path| -> Vec<String> {
        metrics(d).iter().map(|r| format!("{} {} {}", r["step"], r["loss"], r["val_loss"])).collect()
    };
    assert_eq!(lines(&copy), lines(&out));
    assert_eq!(weights(&copy), weights(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn early_stopping_on_two_ranks_stops_every_rank_and_saves_the_model() {
    // Rank 0 decides; the other rank learns it in the evaluation step's
    // all-reduce and joins the final save's collectives (ZeRO-1: the
    // optimizer state is gathered from both).
    let dir = tmp("loop-es-w2");
    let out = dir.join("run");
    let sets = overfit_sets(
        &dir,
        &[
            "train.early_stopping={patience=3, min_delta=0.01}",
            "train.keep_best=true",
            "dist.world_size=2",
            "dist.zero_stage=1",
        ],
    );
    let o = train_strings(&out, &sets);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let last = metrics(&out).last().cloned().unwrap();
    let stop_step = last["step"].as_u64().unwrap();
    assert!(stop_step < 300 && last["stop_reason"].is_string(), "{last}");
    assert!(err.contains(&format!("done: {stop_step} steps")), "{err}");
    assert!(out.join("checkpoints").join("best").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

fn copy_dir(from: &Path, to: &Path) {
    let ok = std::process::Command::new("cp").arg("-a").arg(from).arg(to).status().unwrap().success();
    assert!(ok);
}

/// The trainable tensors of `file` (a safetensors file) by name.
fn tensors(file: &Path) -> HashMap<String, Vec<f32>> {
    nn::io::read_safetensors(file).unwrap().0.into_iter().map(|(k, (_, v))| (k, v)).collect()
}

/// Every trainable tensor of the model saved in `dir`, by name.
fn trainable_of(dir: &Path, names: &[String]) -> HashMap<String, Vec<f32>> {
    let (cfg, params) = gpt::hf::load(dir).unwrap();
    let model = gpt::Gpt::new(cfg).unwrap();
    let layout = engine::Model::layout(&model);
    names.iter().map(|n| (n.clone(), params[layout.get(n).unwrap().range()].to_vec())).collect()
}

#[test]
fn ema_equals_the_average_computed_by_hand_on_one_and_two_ranks_and_across_a_resume() {
    const D: f32 = 0.75;
    let steps = 4u64;
    let mut finals = Vec::new();
    // `--dump-steps` (one rank only) records the initial trainable tensors;
    // two ranks start from the same ones (the same seed).
    let dump = tmp("ema-dump");
    for (tag, extra) in [("w1", &["dist.world_size=1"][..]), ("w2", &["dist.world_size=2", "dist.zero_stage=1"][..])] {
        let out = tmp(&format!("ema-{tag}"));
        let mut sets = tiny(&[
            "train.steps=4",
            "train.checkpoint_every=1",
            "train.keep_checkpoints=0",
            "train.ema_decay=0.75",
            "batch.micro=2",
        ]);
        sets.extend_from_slice(extra);
        let mut c = train_cmd(&out, &sets);
        if tag == "w1" {
            c.arg("--dump-steps").arg(&dump);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        // ema_0 = the initial parameters; ema_k = d·ema_{k−1} + (1 − d)·p_k.
        let mut ema = tensors(&dump.join("initial_trainable.safetensors"));
        let names: Vec<String> = ema.keys().cloned().collect();
        let mut per_step = Vec::new();
        for step in 1..=steps {
            let ckpt = out.join("checkpoints").join(format!("step-{step:08}"));
            let p = trainable_of(&ckpt, &names);
            for (name, e) in ema.iter_mut() {
                e.iter_mut().zip(&p[name]).for_each(|(e, &p)| *e = D * *e + (1.0 - D) * p);
            }
            assert_eq!(tensors(&ckpt.join("ema.safetensors")), ema, "{tag}: step {step}'s average, bit for bit");
            per_step.push(p);
        }
        // The averaged model loads like the run's own.
        assert_eq!(trainable_of(&out.join("ema"), &names), ema, "{tag}: RUN/ema holds the average");
        let o = bin()
            .args(["generate"])
            .arg(out.join("ema"))
            .args(["--prompt", "Call", "--max-new-tokens", "4"])
            .output()
            .unwrap();
        assert!(o.status.success(), "generate on RUN/ema: {}", stderr(&o));
        // Stopped after step 2 and resumed: the same average, bit for bit.
        let b = tmp(&format!("ema-resumed-{tag}"));
        let mut c = train_cmd(&b, &sets);
        c.args(["--stop-after", "2"]);
        assert!(c.output().unwrap().status.success());
        resume_ok(&b, &[]);
        assert_eq!(trainable_of(&b.join("ema"), &names), ema, "{tag}: resumed average");
        finals.push((ema, per_step));
        for d in [out, b] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    let _ = std::fs::remove_dir_all(&dump);
    // Two ranks average the parameters every rank holds after each step,
    // which match one rank's within the rounding of the reduction's order
    // (amplified by Adam's division by √v where gradients are tiny): the
    // average, a convex combination of them, is as close, element by
    // element, up to its own f32 rounding: each update rounds twice (≤ 2
    // half-ulps) and earlier errors shrink by d, so each run's average is
    // within 2⁻²³·|x|/(1 − d) = 4 ulps of the exact one: 8 ulps for two.
    let ((e1, p1), (e2, p2)) = (&finals[0], &finals[1]);
    for (name, a) in e1 {
        for (i, (&x, &y)) in a.iter().zip(&e2[name]).enumerate() {
            let bound = p1.iter().zip(p2).map(|(s1, s2)| (s1[name][i] - s2[name][i]).abs()).fold(0.0f32, f32::max);
            let rounding = 8.0 * f32::EPSILON * x.abs().max(y.abs());
            assert!((x - y).abs() <= bound + rounding, "{name}[{i}]: W=2 {y} vs W=1 {x}, parameters within {bound}");
        }
    }
}

#[test]
fn loop_controls_are_refused_where_they_cannot_work() {
    refused_train(
        "es-no-eval",
        None,
        &tiny(&["train.early_stopping={patience=2}"]),
        &["train.early_stopping", "train.eval_every"],
    );
    refused_train("best-no-eval", None, &tiny(&["train.keep_best=true"]), &["train.keep_best", "train.eval_every"]);
    refused_train(
        "es-patience",
        None,
        &tiny(&["train.eval_every=5", "train.early_stopping={patience=0}"]),
        &["train.early_stopping.patience"],
    );
    refused_train("ema-range", None, &tiny(&["train.ema_decay=1.0"]), &["train.ema_decay", "[0, 1)"]);
    refused_train(
        "ema-zero3",
        None,
        &tiny(&["train.ema_decay=0.9", "dist.world_size=2", "dist.zero_stage=3"]),
        &["train.ema_decay", "dist.zero_stage"],
    );
    refused_train("smoothing", None, &tiny(&["train.label_smoothing=1.0"]), &["train.label_smoothing"]);
    refused_train("z-loss", None, &tiny(&["train.z_loss=-1"]), &["train.z_loss"]);
    refused_train(
        "terms-micro-mean",
        None,
        &tiny(&["train.z_loss=1e-4", "train.loss_normalization=micro_batch_mean"]),
        &["train.loss_normalization", "token"],
    );
}

fn verify_ok(sets: &[String]) -> String {
    let mut c = bin();
    c.arg("verify");
    for s in sets {
        c.arg("--set").arg(s);
    }
    let o = c.output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success() && out.contains("PASS"), "{sets:?}\n{out}{}", stderr(&o));
    out
}

#[test]
fn label_smoothing_and_z_loss_keep_the_factorizations_equal_gpt() {
    let terms = ["train.label_smoothing=0.1", "train.z_loss=1e-3"];
    for (micro, k) in [(1, 8), (2, 4)] {
        let sets: Vec<String> = SMALL
            .iter()
            .chain(&terms)
            .map(|s| s.to_string())
            .chain([format!("batch.micro={micro}"), format!("batch.accumulation_steps={k}")])
            .collect();
        verify_ok(&sets);
    }
}

#[test]
fn label_smoothing_and_z_loss_keep_the_factorizations_equal_on_masked_chats_llama() {
    let Some(gguf) = gguf::testing::smollm2_or_skip("loop_controls") else { return };
    let base = chat_sets(&gguf.display().to_string());
    let sets: Vec<String> = base
        .into_iter()
        .chain(
            ["train.label_smoothing=0.1", "train.z_loss=1e-3", "batch.micro=1", "batch.accumulation_steps=32"]
                .map(String::from),
        )
        .collect();
    verify_ok(&sets);
}

#[test]
fn metrics_keep_plain_cross_entropy_as_loss_and_log_the_total() {
    let (a, b) = (tmp("terms-off"), tmp("terms-on"));
    train_ok(&a, &tiny(&["train.steps=2"]));
    train_ok(&b, &tiny(&["train.steps=2", "train.label_smoothing=0.1", "train.z_loss=1e-3"]));
    let (ma, mb) = (metrics(&a), metrics(&b));
    assert!(ma[0].get("loss_total").is_none(), "no total without the terms");
    // Step 1 starts from the same parameters: the same cross-entropy (the
    // terms' kernel sums a row in f64, the plain one in f32: 1e-6 relative).
    let (la, lb) = (ma[0]["loss"].as_f64().unwrap(), mb[0]["loss"].as_f64().unwrap());
    assert!((la - lb).abs() <= 1e-6 * la, "{la} vs {lb}");
    let total = mb[0]["loss_total"].as_f64().unwrap();
    // Both terms add: ε·(x_t − mean x) is positive once the target's logit
    // leads the mean, and c·lse² > 0 — on a fresh model about 1e-3·ln²V.
    assert!(total > lb, "{total} vs {lb}");
    assert_ne!(weights(&a), weights(&b), "the terms change the gradient");
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

/// `plan` counts the moving average: rank 0's process holds 4 bytes per
/// trainable parameter more with `train.ema_decay` on, and 4 more while a
/// checkpoint written in the background holds its copy.
#[test]
fn plan_counts_the_moving_average() {
    let plan = |extra: &[&str]| -> serde_json::Value {
        let mut c = bin();
        c.args(["plan", "--json"]);
        with_sets(&mut c, &tiny(extra));
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).expect("plan --json")
    };
    let (off, on) = (plan(&[]), plan(&["train.ema_decay=0.9"]));
    let n = on["n_params"].as_u64().unwrap();
    assert_eq!(off["configured"]["ema"].as_u64(), Some(0));
    assert_eq!(on["configured"]["ema"].as_u64(), Some(4 * n), "every parameter of this run trains");
    // The peak less the program's resident size (measured at start-up, it
    // varies from run to run) grows by the average.
    let fixed =
        |p: &serde_json::Value| p["configured_peak"].as_u64().unwrap() - p["configured"]["runtime"].as_u64().unwrap();
    assert_eq!(fixed(&on) - fixed(&off), 4 * n);
    // Written in the background (train.checkpoint_async), a checkpoint
    // takes a copy of the average with it while the steps go on.
    let asy = plan(&["train.ema_decay=0.9", "train.checkpoint_async=true"]);
    let ck = |p: &serde_json::Value| p["configured"]["checkpoint"].as_u64().unwrap();
    assert_eq!(ck(&asy) - ck(&on), 4 * n);
    assert_eq!(ck(&plan(&["train.checkpoint_async=true"])), ck(&off), "no average, nothing more");
    assert_eq!((asy["checkpoint_async"].as_bool(), on["checkpoint_async"].as_bool()), (Some(true), Some(false)));
}
