//! A DeepSpeed JSON config as CONFIG: it trains, its mapping shows in the
//! resolved config, its errors exit 2 naming the key, and it gives the same
//! losses as the equivalent TOML.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Output;

/// A small model and a short run, for what DeepSpeed's file does not say.
const COMPANION: &str =
    "[model]\nn_layer = 2\nn_embd = 64\nn_head = 2\nblock_size = 64\n\n[train]\nsteps = 2\neval_batches = 1\n";

/// Writes `text` to `dir/name`.
fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// `macrobatch <cmd> ds.json --config-model model.toml [extra…]`.
fn run_ds(cmd: &str, dir: &Path, json: &str, extra: &[&str]) -> Output {
    let ds = write(dir, "ds_config.json", json);
    let model = write(dir, "model.toml", COMPANION);
    let mut c = bin();
    c.arg(cmd).arg(&ds).arg("--config-model").arg(&model).args(extra);
    c.output().expect("binary runs")
}

fn resolved(out: &Path) -> String {
    std::fs::read_to_string(out.join("config.resolved.toml")).expect("config.resolved.toml")
}

#[test]
fn gpt2_fp16_zero1_trains() {
    let dir = tmp("ds-fp16");
    let out = dir.join("run");
    let json = r#"{
      "train_batch_size": 8,
      "train_micro_batch_size_per_gpu": 4,
      "steps_per_print": 1,
      "gradient_clipping": 1.0,
      "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 100, "hysteresis": 2, "min_loss_scale": 1},
      "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7, "overlap_comm": true, "contiguous_gradients": true},
      "optimizer": {"type": "Adam", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-4, "warmup_num_steps": 1, "warmup_type": "linear"}}
    }"#;
    let o = run_ds("train", &dir, json, &["--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(&out).len(), 2);
    let r = resolved(&out);
    for want in [
        "precision = \"f16\"",
        "initial_loss_scale = 4096.0",
        "loss_scale_hysteresis = 2",
        "zero_stage = 1",
        "accumulation_steps",
        "name = \"adamw\"",
    ] {
        assert!(r.contains(want), "{want}:\n{r}");
    }
    let e = stderr(&o);
    assert!(e.contains("overlap_comm") && e.contains("adam_w_mode"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bf16_zero2_on_two_thread_ranks_trains_and_shows_the_mapping() {
    let dir = tmp("ds-bf16");
    let out = dir.join("run");
    let json = r#"{
      "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 2,
      "bf16": {"enabled": true},
      "zero_optimization": {"stage": 2, "reduce_bucket_size": 262144, "reduce_scatter": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2, "warmup_num_steps": 1, "cos_min_ratio": 0.1, "warmup_type": "linear"}}
    }"#;
    let o = run_ds("train", &dir, json, &["--out", out.to_str().unwrap(), "--set", "dist.world_size=2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(&out).len(), 2);
    let r = resolved(&out);
    for want in [
        "precision = \"bf16\"",
        "zero_stage = 2",
        "world_size = 2",
        "bucket_mb = 1.0",
        "global = 8",
        "micro = 2",
        "accumulation_steps = 2",
        "kind = \"cosine\"",
        "warmup_steps = 1",
        "beta2 = 0.999",
    ] {
        assert!(r.contains(want), "{want}:\n{r}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// "auto" takes macrobatch's own value (here `--set batch.micro=2` and
/// `optim.lr`), named in a note, as Hugging Face's Trainer fills it from its
/// arguments; an "auto" macrobatch has no value for exits 2 naming the key.
#[test]
fn auto_values_take_our_settings_or_exit_2_naming_the_key() {
    let dir = tmp("ds-auto");
    let json = r#"{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}"#;
    let out = dir.join("run");
    let o = run_ds(
        "train",
        &dir,
        json,
        &["--out", out.to_str().unwrap(), "--set", "batch.micro=2", "--set", "optim.lr=5e-4", "--set", "train.steps=2"],
    );
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("train_micro_batch_size_per_gpu = \"auto\": 2, macrobatch's batch.micro"), "{e}");
    assert!(e.contains("optimizer.params.lr = \"auto\": 0.0005, macrobatch's optim.lr"), "{e}");
    let r = resolved(&out);
    assert!(r.contains("micro = 2") && r.contains("accumulation_steps = 2") && r.contains("lr = 0.0005"), "{r}");
    let json = r#"{"train_batch_size": 8, "pipeline": {"stages": "auto"}}"#;
    let o = run_ds("train", &dir, json, &["--out", dir.join("run2").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("pipeline.stages needs") && e.contains("Hugging Face"), "{e}");
    assert!(!dir.join("run2").exists(), "nothing is created");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_inconsistent_triple_exits_2_with_deepspeeds_numbers() {
    let dir = tmp("ds-triple");
    let json = r#"{"train_batch_size": 512, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 4}"#;
    let o = run_ds("train", &dir, json, &["--out", dir.join("run").to_str().unwrap(), "--set", "dist.world_size=2"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("train_batch_size 512 = 16 × 4 × world needs world 8, but world is 2"), "{e}");
    // `plan` checks against the world it plans for.
    let o = run_ds("plan", &dir, json, &["--world-size", "8", "--memory", "80GiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_keys_warn_by_name_and_fail_under_strict() {
    let dir = tmp("ds-unknown");
    let json = r#"{
      "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
      "sparse_attention": {"mode": "fixed"},
      "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}, "not_a_knob": 3},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1, "warmup_type": "linear"}}
    }"#;
    let out = dir.join("run");
    let o = run_ds("train", &dir, json, &["--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    for key in ["sparse_attention", "zero_optimization.not_a_knob", "zero_optimization.offload_optimizer"] {
        assert!(e.contains("warning: ") && e.contains(key), "{key}: {e}");
    }
    let o = run_ds("train", &dir, json, &["--strict", "--out", dir.join("strict").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("--strict") && e.contains("sparse_attention") && e.contains("not_a_knob"), "{e}");
    // The flags belong to a JSON config.
    let toml = write(&dir, "plain.toml", COMPANION);
    let o = bin().arg("train").arg(&toml).arg("--strict").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("DeepSpeed JSON"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn deepspeed_json_and_the_equivalent_toml_give_bit_identical_losses() {
    let dir = tmp("ds-same");
    let json = r#"{
      "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
      "gradient_clipping": 0.5, "steps_per_print": 1,
      "zero_optimization": {"stage": 1, "reduce_bucket_size": 262144},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.05}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 4, "warmup_type": "linear"}}
    }"#;
    let equivalent = format!(
        "{COMPANION}grad_clip = 0.5\nlog_every = 1\n\n[batch]\nglobal = 8\nmicro = 2\naccumulation_steps = 2\n\n\
         [dist]\nworld_size = 2\nzero_stage = 1\nbucket_mb = 1.0\n\n\
         [optim]\nname = \"adamw\"\nlr = 1e-3\nbeta1 = 0.9\nbeta2 = 0.98\neps = 1e-8\nweight_decay = 0.05\n\n\
         [schedule]\nkind = \"linear\"\nwarmup_steps = 2\nmin_lr = 0.0\n"
    );
    // COMPANION's [train] is last but one line: the two keys above join it.
    let toml = write(&dir, "equivalent.toml", &equivalent.replace("\nsteps = 2\n", "\nsteps = 4\n"));
    let (a, b) = (dir.join("from-json"), dir.join("from-toml"));
    let o = run_ds("train", &dir, json, &["--out", a.to_str().unwrap(), "--set", "dist.world_size=2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = bin().arg("train").arg(&toml).arg("--out").arg(&b).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let key = |out: &Path| -> Vec<String> {
        metrics(out).iter().map(|r| format!("{} {} {}", r["loss"], r["lr"], r["grad_norm"])).collect()
    };
    let (ka, kb) = (key(&a), key(&b));
    assert_eq!(ka.len(), 4);
    assert_eq!(ka, kb, "same losses, learning rates and gradient norms, bit for bit");
    assert_eq!(resolved(&a), resolved(&b), "the same resolved config");
    let _ = std::fs::remove_dir_all(&dir);
}
