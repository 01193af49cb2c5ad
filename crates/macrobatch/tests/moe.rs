//! Mixtures of experts through the command line: `verify` proves the
//! global-batch load-balancing loss makes micro × K × W one big batch, and
//! fails the micro-batch form with the size of the difference; a short
//! training run reports the router losses, the routing pass and the
//! experts' loads, and the
//! splits a mixture does not implement yet are refused by name.

mod common;
use common::*;

const TINY: &[&str] =
    &["model.preset=tiny", "batch.global=16", "batch.micro=2", "batch.accumulation_steps=4", "dist.world_size=2"];

fn verify(family: &str, balancing: &str) -> (Option<i32>, String) {
    let mut c = bin();
    c.arg("verify");
    let fam = format!("model.family={family}");
    let lb = format!("model.load_balancing={balancing}");
    let mut sets: Vec<&str> = TINY.to_vec();
    sets.extend([fam.as_str(), lb.as_str()]);
    with_sets(&mut c, &sets);
    let o = c.output().unwrap();
    (o.status.code(), format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o)))
}

/// The aux loss's two values on verify's "aux loss" line.
fn aux_pair(out: &str) -> (f64, f64) {
    let line = out.lines().find(|l| l.trim_start().starts_with("aux loss")).unwrap_or_else(|| panic!("{out}"));
    let nums: Vec<f64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    (nums[0], nums[1])
}

#[test]
fn verify_passes_the_global_batch_balance_loss_and_fails_the_micro_batch_one() {
    for family in ["mixtral", "qwen2_moe", "qwen3_moe"] {
        let (code, out) = verify(family, "global_batch");
        assert_eq!(code, Some(0), "{family}, global batch:\n{out}");
        let (a, b) = aux_pair(&out);
        // Both sides sum the same per-row terms with the same coefficients.
        assert!(a > 0.0 && (a - b).abs() <= 1e-9 * b, "{family}: {out}");
    }
    // Mixtral's α = 0.02: the micro-batch form's gradient differs by ~2e-4 of
    // its largest value (measured 2.4e-4), twenty times verify's tolerance.
    let (code, out) = verify("mixtral", "micro_batch");
    assert_eq!(code, Some(1), "the micro-batch form must fail verify:\n{out}");
    let (a, b) = aux_pair(&out);
    assert!((a - b).abs() > 1e-6 * b, "the per-micro-batch aux loss is not the batch's: {out}");
    assert!(out.contains("gradient") && out.contains("FAIL"), "{out}");
}

#[test]
fn a_mixture_trains_reports_its_router_losses_and_refuses_splits_it_lacks() {
    let out = tmp("moe-train");
    let mut c = bin();
    c.arg("train").arg("--out").arg(&out);
    with_sets(
        &mut c,
        &[
            "model.family=qwen3_moe",
            "model.preset=tiny",
            "train.steps=3",
            "batch.global=8",
            "batch.micro=2",
            "dist.world_size=2",
        ],
    );
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(&out);
    assert_eq!(m.len(), 3);
    for r in &m {
        let (loss, total) = (r["loss"].as_f64().unwrap(), r["loss_total"].as_f64().unwrap());
        // α = 0.001, aux ≈ k = 2 at balance: the router loss is ~0.002 per target.
        assert!(total > loss && total - loss < 0.01, "{r}");
        assert!(r["routing_pass_s"].as_f64().is_some_and(|s| s > 0.0), "{r}");
        // The global batch's choices per expert, as shares of all of them.
        let load: Vec<f64> = r["expert_load"].as_array().unwrap().iter().filter_map(|x| x.as_f64()).collect();
        assert!(load.len() == 4 && (load.iter().sum::<f64>() - 1.0).abs() < 1e-12, "{r}");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!((config["model_type"].as_str(), config["num_experts"].as_u64()), (Some("qwen3_moe"), Some(4)));
    let _ = std::fs::remove_dir_all(&out);
    let refused = [
        ("dist.tensor_parallel=2", "dist.tensor_parallel"),
        ("dist.pipeline_parallel=2", "pipeline"),
        ("train.objective=dpo", "train.objective = \"dpo\" with a mixture of experts"),
    ];
    for (set, key) in refused {
        let out = tmp("moe-refused");
        let mut c = bin();
        c.arg("train").arg("--out").arg(&out);
        // DPO trains adapters: give it some, so that the mixture is what it refuses.
        let lora: &[&str] = if set.contains("dpo") {
            &["lora.r=4", "lora.target_modules=[\"q_proj\"]", "data.format=jsonl", "data.path=pairs.jsonl"]
        } else {
            &[]
        };
        let base =
            ["model.family=mixtral", "model.preset=tiny", "train.steps=1", "batch.global=4", "batch.micro=2", set];
        with_sets(&mut c, &[&base[..], lora].concat());
        let o = c.output().unwrap();
        assert!(!o.status.success() && stderr(&o).contains(key), "{set}: {}", stderr(&o));
        let _ = std::fs::remove_dir_all(&out);
    }
}
