//! Fine-tuning a Llama on masked chat data (the tutorials' LoRA scenario),
//! through the command line: micro 1 × K 32 = micro 4 × K 8 = micro 32 × K 1
//! on the example's chat data, whose micro-batches hold different numbers
//! of target tokens (only the assistant's replies count); the naive mean of
//! micro-batch means does not; a LoRA run leaves the base bit-identical and
//! keeps no gradient or optimizer state for it. Needs the SmolLM2 GGUF for
//! its tokenizer and chat template (scripts/fetch-smollm.sh; CI has it).

mod common;
use common::*;

fn verify(sets: &[String]) -> std::process::Output {
    let mut c = bin();
    c.arg("verify");
    for s in sets {
        c.arg("--set").arg(s);
    }
    c.output().unwrap()
}

#[test]
fn micro_batch_factorizations_agree_on_masked_chat_data_and_mean_of_means_does_not() {
    let Some(gguf) = gguf::testing::smollm2_or_skip("finetune") else { return };
    let base = chat_sets(&gguf.display().to_string());
    for (micro, k) in [(1, 32), (4, 8)] {
        let sets =
            [base.clone(), vec![format!("batch.micro={micro}"), format!("batch.accumulation_steps={k}")]].concat();
        let o = verify(&sets);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "micro {micro} × K {k} vs micro 32 × K 1:\n{out}{}", stderr(&o));
        assert!(out.contains("PASS"), "{out}");
    }
    // DeepSpeed's / the tutorials' minimal recipe: each micro-batch's mean,
    // divided by K. Chats hold different numbers of reply tokens, so it is
    // not the loss of the whole batch: verify must fail (exit 1).
    let sets = [
        base,
        vec![
            "batch.micro=1".into(),
            "batch.accumulation_steps=32".into(),
            "train.loss_normalization=micro_batch_mean".into(),
        ],
    ]
    .concat();
    let o = verify(&sets);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "mean of means must fail verify:\n{out}{}", stderr(&o));
    assert!(out.contains("FAIL"), "{out}");
}

#[test]
fn lora_trains_adapters_only_and_leaves_the_base_bit_identical() {
    let Some(gguf) = gguf::testing::smollm2_or_skip("finetune") else { return };
    let out = tmp("lora-base");
    let sets = [chat_sets(&gguf.display().to_string()), vec!["batch.micro=4".into(), "train.steps=3".into()]].concat();
    let set_refs: Vec<&str> = sets.iter().map(String::as_str).collect();
    let mut c = bin();
    c.arg("train").arg("--out").arg(&out).arg("--merge");
    with_sets(&mut c, &set_refs);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // --merge: a plain Llama folder whose greedy answer is the adapted model's.
    let greedy = |dir: &std::path::Path| {
        let o = bin()
            .arg("generate")
            .arg(dir)
            .args(["--chat", "--prompt", "Who is Starbuck?", "--temperature", "0", "--max-new-tokens", "8"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let merged = out.join("merged");
    assert!(merged.join("model.safetensors").exists() && !merged.join("adapter_config.json").exists());
    assert_eq!(greedy(&out), greedy(&merged), "merged weights answer as base + adapters");
    // Only the adapters have gradients and optimizer state: 4 bytes each
    // for gradients, 8 for AdamW's moments.
    let m = metrics(&out);
    let (grads, opt) = (m[0]["mem_grads"].as_u64().unwrap(), m[0]["mem_optimizer"].as_u64().unwrap());
    let adapter = std::fs::metadata(out.join("adapter_model.safetensors")).unwrap().len();
    assert!(grads < adapter && opt == 2 * grads, "grads {grads}, optimizer {opt}, adapter file {adapter} bytes");
    // The saved base equals the freshly initialised base (same seed): frozen.
    let again = tmp("lora-base-init");
    let o = train(&again, &[set_refs.as_slice(), &["train.steps=1", "optim.lr=1e-12", "schedule.min_lr=0"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let base = |d: &std::path::Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(base(&out) == base(&again), "the frozen base changed");
    assert!(out.join("adapter_config.json").exists() && out.join("tokenizer.json").exists());
    for d in [out, again] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// `verify --init-from DIR` checks the factorization from a saved model's
/// weights (its shape pinned, as `train --init-from` pins it): the step's
/// loss is the trained model's, well under the random initialisation's
/// (ln 256 ≈ 5.5 on bytes), and a `--set` that contradicts the saved shape
/// is refused. The same batch and factorization pass either way.
#[test]
fn verify_checks_from_a_pretrained_model() {
    let run = tmp("verify-init");
    train_ok(&run, &tiny(&["train.steps=40", "optim.lr=0.01"]));
    let loss = |o: &std::process::Output| -> f64 {
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success() && out.contains("PASS"), "{out}{}", stderr(o));
        let line = out.lines().find(|l| l.trim_start().starts_with("loss")).unwrap_or_else(|| panic!("{out}"));
        line.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or_else(|| panic!("{line}"))
    };
    let sets: Vec<String> =
        tiny(&["dist.world_size=2", "batch.accumulation_steps=1"]).iter().map(|s| s.to_string()).collect();
    let fresh = loss(&verify(&sets));
    let mut c = bin();
    c.arg("verify").arg("--init-from").arg(&run);
    with_sets(&mut c, &sets.iter().map(String::as_str).collect::<Vec<_>>());
    let o = c.output().unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains(&format!("the parameters of {}", run.display())));
    let trained = loss(&o);
    assert!(trained < fresh - 1.0, "from the trained weights {trained}, from the initialisation {fresh}");
    let o = bin().arg("verify").arg("--init-from").arg(&run).args(["--set", "model.n_layer=3"]).output().unwrap();
    fails(&o, "model.n_layer");
    let _ = std::fs::remove_dir_all(&run);
}
