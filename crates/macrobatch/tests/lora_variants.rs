//! LoRA's variants through the command line: a run with `lora.dropout`
//! stopped and resumed continues bit for bit (the masks are keyed on the
//! optimizer step, which the checkpoint holds) and the dropout is really
//! applied; a DoRA run on an NF4-packed base trains its magnitudes,
//! resumes bit for bit, saves them under PEFT's names and merges.

mod common;
use common::*;
use linalg::packed::PackFormat;
use llama::{Llama, LlamaConfig};
use std::path::{Path, PathBuf};

/// The tiny Llama with an MLP width NF4's blocks of 64 divide.
fn shape() -> LlamaConfig {
    LlamaConfig { intermediate_size: 192, ..LlamaConfig::preset("tiny").unwrap() }
}

/// A pretrained-model folder of the tiny shape (a fixed initialisation).
fn pretrained(tag: &str) -> PathBuf {
    let model = Llama::new(shape()).unwrap();
    let params = model.init_params(21);
    let dir = tmp(tag);
    llama::hf::save(&dir, &shape(), &params).unwrap();
    dir
}

/// A LoRA run of 4 steps (checkpoint every 2) on the tiny shape from `init`.
fn run(out: &Path, init: &Path, sets: &[&str], extra: &[&str]) -> std::process::Output {
    tiny_lora_run(out, init, &[&["train.checkpoint_every=2"], sets].concat(), extra)
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Straight vs stopped after 2 steps and resumed: the same losses and
/// adapters to the bit. Returns the straight run's losses and folder.
fn resumes_bit_for_bit(tag: &str, init: &Path, sets: &[&str]) -> (Vec<f64>, PathBuf) {
    let straight = tmp(&format!("{tag}-straight"));
    let o = run(&straight, init, sets, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stopped = tmp(&format!("{tag}-stopped"));
    let o = run(&stopped, init, sets, &["--stop-after", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    resume_ok(&stopped, &[]);
    let l = losses(&straight);
    assert_eq!(l.len(), 4);
    assert_eq!(bits(&losses(&stopped)), bits(&l), "{tag}: resumed vs straight");
    let adapter = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
    assert!(adapter(&straight) == adapter(&stopped), "{tag}: the final adapters differ");
    std::fs::remove_dir_all(&stopped).unwrap();
    (l, straight)
}

#[test]
fn a_run_with_lora_dropout_resumes_bit_for_bit() {
    let init = pretrained("dropout-init");
    let (with, straight) = resumes_bit_for_bit("dropout", &init, &["lora.dropout=0.2"]);
    let out = tmp("dropout-none");
    let o = run(&out, &init, &[], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Step 1 starts from the same parameters (B = 0): only the masks differ.
    let without = losses(&out);
    assert!(with.iter().zip(&without).skip(1).any(|(a, b)| a != b), "dropout changed nothing: {with:?}");
    let cfg = std::fs::read_to_string(straight.join("adapter_config.json")).unwrap();
    assert!(cfg.contains("\"lora_dropout\": 0.2"), "{cfg}");
    for d in [out, init, straight] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn a_dora_run_on_a_packed_base_resumes_saves_and_merges() {
    let init = pretrained("dora-init");
    let sets = ["lora.use_dora=true", "lora.use_rslora=true", "train.frozen_dtype=\"nf4\"", "optim.lr=1e-2"];
    let (_, out) = resumes_bit_for_bit("dora", &init, &sets);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!((cfg["use_dora"].as_bool(), cfg["use_rslora"].as_bool()), (Some(true), Some(true)));
    // The magnitudes trained: they moved from the base rows' norms.
    let adapter = llama::lora::load_adapter(&out).unwrap();
    let m = &adapter.tensors["model.layers.0.self_attn.q_proj.lora_magnitude_vector"].1;
    // The base as the run held it: the pretrained weights in NF4 (the run
    // folder refers to them instead of holding a copy).
    let pretrained = llama::hf::load(&init).unwrap().1;
    let packed = llama::FrozenBase::quantize(&shape(), &pretrained, PackFormat::Nf4 { double_quant: true }).unwrap();
    let q = packed.dequantize(&shape(), 0, llama::Proj::Q);
    let c = shape().hidden_size;
    let norm0: f64 = q[..c].iter().map(|&w| (w as f64).powi(2)).sum::<f64>().sqrt();
    assert!((m[0] as f64 - norm0).abs() > 1e-6 * norm0, "magnitude {} vs the base row's norm {norm0}", m[0]);
    // Merged into a plain folder: it answers as base + adapters.
    let merged = tmp("dora-merged");
    let o = bin().arg("export").arg(&out).args(["--format", "hf", "--out"]).arg(&merged).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let greedy = |dir: &Path| {
        let o = bin()
            .arg("generate")
            .arg(dir)
            .args(["--prompt", "Call me", "--temperature", "0", "--max-new-tokens", "8"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(greedy(&out), greedy(&merged));
    for d in [out, merged, init] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// `lora.target_modules = "all-linear"`, PEFT's string form (README), plans
/// the same model as the list of every projection; another bare string is
/// refused naming the key and both accepted spellings.
#[test]
fn target_modules_takes_peft_s_all_linear_string() {
    let plan = |targets: &str| {
        let mut c = bin();
        c.args(["plan", "--json", "--memory", "8GiB"]);
        let key = format!("lora.target_modules={targets}");
        with_sets(&mut c, &["model.family=llama", "model.preset=tiny", "lora.r=4", &key]);
        c.output().unwrap()
    };
    let n_params = |targets: &str| {
        let o = plan(targets);
        assert!(o.status.success(), "{targets}: {}", stderr(&o));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        r["n_params"].as_u64().unwrap()
    };
    let every = n_params(r#"["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]"#);
    assert_eq!(n_params(r#""all-linear""#), every);
    assert_eq!(n_params(r#"["all-linear"]"#), every);
    let o = plan(r#""q_proj""#);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("target_modules") && e.contains("all-linear"), "{e}");
    assert!(e.contains(r#"["q_proj", "v_proj"]"#), "names the list form: {e}");
}
