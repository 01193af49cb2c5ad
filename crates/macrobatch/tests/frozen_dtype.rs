//! `train.frozen_dtype` through the command line: a LoRA run on a packed
//! base (bf16, NF4) trains exactly as the f32 run on the base's
//! dequantised values; a resumed run packs the same base again from
//! `train.frozen_source` and continues bit for bit; every refusal names the
//! key and the fix; `plan` counts the packed bytes of a 65B shape.

mod common;
use common::*;
use engine::Model;
use linalg::packed::PackFormat;
use llama::{FrozenBase, Llama, LlamaConfig, Proj};
use std::path::{Path, PathBuf};

/// The tiny Llama with an MLP width NF4's blocks of 64 divide.
fn shape() -> LlamaConfig {
    LlamaConfig { intermediate_size: 192, ..LlamaConfig::preset("tiny").unwrap() }
}

/// A pretrained-model folder of the tiny shape whose projections are
/// `project(layer, proj, values)` of a fixed initialisation.
fn folder(tag: &str, project: impl Fn(usize, Proj, &[f32]) -> Vec<f32>) -> PathBuf {
    let cfg = shape();
    let model = Llama::new(cfg.clone()).unwrap();
    let mut params = model.init_params(21);
    for layer in 0..cfg.n_layer {
        for pr in Proj::ALL {
            let r = model.layer_params(layer).w(pr);
            let w = project(layer, pr, &params[r.clone()]);
            params[r].copy_from_slice(&w);
        }
    }
    let dir = tmp(tag);
    llama::hf::save(&dir, &cfg, &params).unwrap();
    assert!(model.layout().n_params() == params.len());
    dir
}

/// A LoRA run on the tiny shape from `init` (the byte corpus; two ranks
/// as threads share one packed base).
fn lora_run(out: &Path, init: &Path, sets: &[&str], extra: &[&str]) -> std::process::Output {
    tiny_lora_run(out, init, &[&["dist.world_size=2"], sets].concat(), extra)
}

fn lora_ok(out: &Path, init: &Path, sets: &[&str]) -> Vec<f64> {
    let o = lora_run(out, init, sets, &[]);
    assert!(o.status.success(), "{sets:?}: {}", stderr(&o));
    losses(out)
}

/// `eval RUN --data TEXT --json` with `extra` flags.
fn eval_run(run: &Path, text: &Path, extra: &[&str]) -> std::process::Output {
    bin().arg("eval").arg(run).arg("--data").arg(text).arg("--json").args(extra).output().unwrap()
}

/// The loss a successful [`eval_run`] reports.
fn loss(o: &std::process::Output) -> f64 {
    assert!(o.status.success(), "{}", stderr(o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["loss"].as_f64().unwrap()
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn packed_bases_train_as_the_f32_run_on_their_dequantised_values() {
    let src = folder("frozen-src", |_, _, w| w.to_vec());
    let cfg = shape();
    let plain = Llama::new(cfg.clone()).unwrap();
    for (dtype, format) in [("bf16", PackFormat::Bf16), ("nf4", PackFormat::Nf4 { double_quant: true })] {
        // The base as the packed run sees it, written out in f32.
        let params = llama::hf::load(&src).unwrap().1;
        let base = FrozenBase::quantize(&cfg, &params, format).unwrap();
        let deq = folder(&format!("frozen-deq-{dtype}"), |layer, pr, _| base.dequantize(&cfg, layer, pr));
        assert_eq!(plain.layout().n_params(), params.len());
        let packed_out = tmp(&format!("frozen-run-{dtype}"));
        let packed = lora_ok(&packed_out, &src, &[&format!("train.frozen_dtype=\"{dtype}\"")]);
        let f32_run = lora_ok(&tmp(&format!("frozen-ref-{dtype}")), &deq, &["train.frozen_dtype=\"f32\""]);
        assert_eq!(packed.len(), 4);
        assert_eq!(bits(&packed), bits(&f32_run), "{dtype}: {packed:?} vs {f32_run:?}");
        // The packed run records its source, and saves its adapters with a reference to it.
        let resolved = std::fs::read_to_string(packed_out.join("config.resolved.toml")).unwrap();
        assert!(resolved.contains("frozen_source") && resolved.contains(&format!("frozen_dtype = \"{dtype}\"")));
        // memory.json: the plan's packed bytes are the base's, the parameters the layout's.
        let mem: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(packed_out.join("memory.json")).unwrap()).unwrap();
        assert_eq!(mem["predicted"]["frozen"].as_u64(), Some(base.bytes() as u64), "{dtype}");
        assert_eq!(mem["accounting"]["params"], mem["predicted"]["params"], "{dtype}");
        assert!(!packed_out.join("model.safetensors").exists() && packed_out.join("base.json").exists());
    }
    // A 16-bit source is not this folder (f32): auto keeps f32, bit-identical to "f32".
    let auto = lora_ok(&tmp("frozen-auto"), &src, &[]);
    let f32_run = lora_ok(&tmp("frozen-f32"), &src, &["train.frozen_dtype=\"f32\""]);
    assert_eq!(bits(&auto), bits(&f32_run));
}

#[test]
fn a_packed_run_resumes_bit_for_bit() {
    let src = folder("frozen-resume-src", |_, _, w| w.to_vec());
    let nf4 = ["train.frozen_dtype=\"nf4\"", "train.checkpoint_every=2"];
    let straight = lora_ok(&tmp("frozen-straight"), &src, &nf4);
    let out = tmp("frozen-stopped");
    let o = lora_run(&out, &src, &nf4, &["--stop-after", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = resume_ok(&out, &[]);
    assert!(!err.contains("error"), "{err}");
    assert_eq!(bits(&losses(&out)), bits(&straight), "resumed vs straight");
    // The resumed run packed its base again from the recorded source.
    let resolved = std::fs::read_to_string(out.join("config.resolved.toml")).unwrap();
    assert!(resolved.contains(&format!("frozen_source = {:?}", src.display().to_string())), "{resolved}");
    // That source changed after a stop (one projection scaled): the resume
    // is refused instead of training on another base.
    let later = tmp("frozen-stopped-later");
    let o = lora_run(&later, &src, &nf4, &["--stop-after", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(&src).unwrap();
    let changed = folder("frozen-resume-src", |layer, pr, w| match (layer, pr) {
        (0, Proj::Down) => w.iter().map(|x| x * 2.0).collect(),
        _ => w.to_vec(),
    });
    assert_eq!(changed, src);
    let err = fails(&resume(&later, &[]), "is not the one it was trained on");
    assert!(err.contains("cannot resume from"), "{err}");
}

#[test]
fn every_refusal_names_the_key_and_the_fix() {
    let src = folder("frozen-refusals", |_, _, w| w.to_vec());
    // "source" on an f32 file: nothing to keep.
    let out = tmp("frozen-refused-source");
    let o = lora_run(&out, &src, &["train.frozen_dtype=\"source\""], &[]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("train.frozen_dtype") && e.contains("F32") && e.contains("nf4"), "{e}");
    // NF4 on a width its blocks of 64 do not divide (the tiny preset's MLP,
    // 176): the width and the block are named, before the file is read.
    let odd_cfg = LlamaConfig::preset("tiny").unwrap();
    assert_ne!(odd_cfg.intermediate_size % 64, 0);
    let odd = tmp("frozen-odd-width");
    let odd_params = Llama::new(odd_cfg.clone()).unwrap().init_params(21);
    llama::hf::save(&odd, &odd_cfg, &odd_params).unwrap();
    let out = tmp("frozen-refused-odd");
    let o = lora_run(&out, &odd, &["train.frozen_dtype=\"nf4\""], &[]);
    let e = stderr(&o);
    let width = odd_cfg.intermediate_size.to_string();
    assert!(!o.status.success() && e.contains("train.frozen_dtype") && e.contains("blocks of 64"), "{e}");
    assert!(e.contains(&width) && e.contains("\"bf16\""), "{e}");
    let _ = std::fs::remove_dir_all(&odd);
    // A packed format without a pretrained base.
    refused_train(
        "frozen-no-init",
        None,
        &["model.family=llama", "lora.r=4", "lora.target_modules=[\"q_proj\"]", "train.frozen_dtype=\"nf4\""],
        &["train.frozen_dtype", "--init-from"],
    );
    // Nothing frozen.
    refused_train("frozen-no-lora", None, &["train.frozen_dtype=\"bf16\""], &["train.frozen_dtype", "[lora]"]);
    // A split base.
    refused_train(
        "frozen-tp",
        None,
        &[
            "model.family=llama",
            "lora.r=4",
            "lora.target_modules=[\"q_proj\"]",
            "train.frozen_dtype=\"bf16\"",
            "dist.world_size=2",
            "dist.tensor_parallel=2",
        ],
        &["train.frozen_dtype", "dist.tensor_parallel = 1"],
    );
    // GPT-2 without [lora]: nothing frozen there either.
    let o = bin()
        .args(["plan", "--memory", "8GiB", "--set", "model.family=gpt2", "--set", "train.frozen_dtype=\"nf4\""])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("train.frozen_dtype") && e.contains("[lora]"), "{e}");
}

/// `plan --json` of LLaMA-1 65B with an NF4 base + LoRA on one device.
/// `macrobatch plan ARGS --memory MEMORY` with `sets`: its output, which must succeed.
fn plan_out(args: &[&str], sets: &[&str], memory: &str) -> Vec<u8> {
    let mut c = bin();
    c.arg("plan").args(args).args(["--memory", memory]);
    with_sets(&mut c, sets);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    o.stdout
}

/// The plan's text.
fn plan_common_text(sets: &[&str], memory: &str) -> String {
    String::from_utf8_lossy(&plan_out(&[], sets, memory)).into_owned()
}

fn plan_json(sets: &[&str], memory: &str) -> serde_json::Value {
    serde_json::from_slice(&plan_out(&["--json", "--world-size", "1"], sets, memory)).unwrap()
}

/// QLoRA's recipe on the preset llama-70b: LoRA on every projection, bf16
/// activations recomputed per block, micro 1 × K 16 at seq 512.
const QLORA: &[&str] = &[
    "model.family=llama",
    "model.preset=llama-70b",
    "lora.r=16",
    "lora.target_modules=[\"all-linear\"]",
    "data.seq_len=512",
    "batch.micro=1",
    "batch.accumulation_steps=16",
    "train.precision=\"bf16\"",
    "train.activation_checkpointing=\"blocks\"",
];

#[test]
fn plan_counts_the_packed_base_of_65b_and_70b() {
    // LLaMA-1 65B: multi-head attention, a wider MLP, 32000 tokens.
    let shape65 = [
        "model.n_layer=80",
        "model.n_embd=8192",
        "model.n_head=64",
        "model.n_kv_head=64",
        "model.intermediate_size=22016",
        "model.vocab_size=32000",
    ];
    // 80 × (4 · 8192² + 3 · 8192 · 22016) = 64.7e9 frozen projection weights.
    let (c, f, layers) = (8192usize, 22016usize, 80u128);
    let per_layer = |fmt: PackFormat| 4 * fmt.bytes_for(c, c) + 2 * fmt.bytes_for(f, c) + fmt.bytes_for(c, f);
    for (dtype, fmt) in [("nf4", PackFormat::Nf4 { double_quant: true }), ("bf16", PackFormat::Bf16)] {
        let key = format!("train.frozen_dtype=\"{dtype}\"");
        let sets = [QLORA, &shape65[..], &[key.as_str()]].concat();
        let r = plan_json(&sets, "48GiB");
        let frozen = r["configured"]["frozen"].as_u64().unwrap() as u128;
        assert_eq!(frozen, layers * per_layer(fmt), "{dtype}");
        assert_eq!(r["frozen_dtype"], fmt.name());
        // The frozen projections are no longer parameters of the model,
        // but the plan counts them: packed, frozen, in the total.
        assert!(r["n_params"].as_u64().unwrap() < 2_000_000_000, "{}", r["n_params"]);
        assert_eq!(r["n_packed"].as_u64().unwrap() as u128, layers * (4 * c * c + 3 * c * f) as u128, "{dtype}");
        // r = 16 on q, k, v, o (C → C), gate, up (C → F) and down (F → C): r · (in + out) each.
        let adapters = layers * 16 * (4 * 2 * c + 3 * (c + f)) as u128;
        assert_eq!(r["n_trainable"].as_u64().unwrap() as u128, adapters, "{dtype}: the adapters train");
    }
    // The header reads as the model's size: total, trainable, frozen, packed.
    let o = plan_common_text(&[QLORA, &shape65[..], &["train.frozen_dtype=\"nf4\""]].concat(), "48GiB");
    assert!(o.contains(" trainable, ") && o.contains(" of them packed outside the layout), seq "), "{o}");
    // NF4 with double quantisation: QLoRA's 4.127 bits per weight.
    let bits = 8.0 * (layers * per_layer(PackFormat::Nf4 { double_quant: true })) as f64
        / (80.0 * (4.0 * (c * c) as f64 + 3.0 * (c * f) as f64));
    assert!((bits - 4.127).abs() < 0.01, "{bits} bits per weight");
    // llama-70b (grouped-query attention) QLoRA on one 80 GB device.
    let r = plan_json(&[QLORA, &["train.frozen_dtype=\"nf4\""]].concat(), "80GB");
    assert!(r["configured_fits"].as_bool().unwrap(), "{}", r["configured_needed"]);
}

/// `plan --init-from DIR` plans what `train --init-from DIR` runs: the
/// folder's shape rather than the configured preset, its frozen base in the
/// asked format, and the same refusal of a format the file cannot keep.
#[test]
fn plan_takes_the_shape_and_base_of_init_from() {
    let src = folder("frozen-plan-src", |_, _, w| w.to_vec());
    let plan = |dtype: &str| {
        let mut c = bin();
        c.args(["plan", "--json", "--memory", "8GiB", "--init-from"]).arg(&src);
        let key = format!("train.frozen_dtype=\"{dtype}\"");
        with_sets(
            &mut c,
            &[
                "model.family=llama",
                "model.preset=smollm2-135m",
                "lora.r=4",
                "lora.target_modules=[\"all-linear\"]",
                &key,
            ],
        );
        c.output().unwrap()
    };
    let o = plan("bf16");
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let cfg = shape();
    let per_layer: u128 =
        Proj::ALL.iter().map(|p| PackFormat::Bf16.bytes_for(p.shape(&cfg)[0], p.shape(&cfg)[1])).sum();
    assert_eq!(r["configured"]["frozen"].as_u64().unwrap() as u128, cfg.n_layer as u128 * per_layer, "{r}");
    let o = plan("source");
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("F32") && e.contains("train.frozen_dtype"), "{e}");
    let _ = std::fs::remove_dir_all(&src);
}

/// `eval` (and `generate`, which loads the same way) on the folder of a run
/// that kept its base packed reads that base packed again from
/// `train.frozen_source`, checked against the bytes the folder's
/// `base.json` names: the same loss as `--dequantize` (that base
/// dequantised into the f32 model), bit for bit, since the packed GEMMs
/// compute the f32 model on the dequantised values. A source changed since
/// the run, or gone, is refused with the fix (the folder holds no copy).
#[test]
fn a_packed_runs_folder_evaluates_on_its_packed_base() {
    let src = folder("frozen-eval-src", |_, _, w| w.to_vec());
    let out = tmp("frozen-eval-run");
    lora_ok(&out, &src, &["train.frozen_dtype=\"nf4\""]);
    let text = out.with_extension("txt");
    std::fs::write(
        &text,
        "Call me Ishmael. Some years ago, never mind how long precisely, having little money.\n".repeat(8),
    )
    .unwrap();
    let eval = |extra: &[&str]| eval_run(&out, &text, extra);
    let packed = loss(&eval(&[]));
    let whole = loss(&eval(&["--dequantize"]));
    assert_eq!(packed.to_bits(), whole.to_bits(), "packed {packed} vs the folder's f32 base {whole}");
    // The source changed after the run (one projection scaled): refused, naming the way out.
    let original = src.with_extension("orig");
    std::fs::rename(&src, &original).unwrap();
    let changed = folder("frozen-eval-src", |layer, pr, w| match (layer, pr) {
        (1, Proj::Up) => w.iter().map(|x| x * 2.0).collect(),
        _ => w.to_vec(),
    });
    assert_eq!(changed, src);
    let err = fails(&eval(&[]), "is not the one it was trained on");
    assert!(err.contains("Put the run's base back"), "{err}");
    fails(&eval(&["--dequantize"]), "is not the one it was trained on");
    // The source is gone.
    std::fs::remove_dir_all(&src).unwrap();
    fails(&eval(&[]), "is gone");
    // Back: the same loss again.
    std::fs::rename(&original, &src).unwrap();
    assert_eq!(loss(&eval(&[])).to_bits(), whole.to_bits());
    let _ = std::fs::remove_dir_all(&src);
}

/// Phi-3's files store q|k|v and gate|up fused: a bf16 QLoRA run from a
/// `Phi3ForCausalLM` folder (its projections bf16 values already, so
/// packing rounds nothing) trains exactly as the f32 run, and resumes from
/// a checkpoint of its adapters bit for bit (the fused base packed again
/// from its source).
#[test]
fn a_phi3_base_packs_from_its_fused_weights() {
    use family::Family;
    use llama::Dialect;
    let cfg = phi3::PHI3.preset("tiny").unwrap();
    let model = Llama::new(cfg.clone()).unwrap();
    let mut params = model.init_params(21);
    for layer in 0..cfg.n_layer {
        for pr in Proj::ALL {
            let r = model.layer_params(layer).w(pr);
            params[r].iter_mut().for_each(|x| *x = f32::from_bits(x.to_bits() & 0xffff_0000));
        }
    }
    let src = tmp("frozen-phi3-src");
    let fam = llama::LlamaFamily::new(&phi3::PHI3, cfg, None).unwrap();
    fam.save_hf(&src, model.layout(), &params).unwrap();
    let sets = ["model.family=phi3", "lora.target_modules=[\"all-linear\"]", "train.checkpoint_every=2"];
    let with = |dtype: &'static str| [&sets[..], &[dtype]].concat();
    let bf16 = with("train.frozen_dtype=\"bf16\"");
    let f32_run = lora_ok(&tmp("frozen-phi3-f32"), &src, &with("train.frozen_dtype=\"f32\""));
    let packed = lora_ok(&tmp("frozen-phi3-bf16"), &src, &bf16);
    assert_eq!(bits(&packed), bits(&f32_run), "bf16-valued projections pack exactly");
    let out = tmp("frozen-phi3-stopped");
    let o = lora_run(&out, &src, &bf16, &["--stop-after", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = resume_ok(&out, &[]);
    assert!(!err.contains("error"), "{err}");
    assert_eq!(bits(&losses(&out)), bits(&packed), "resumed vs straight");
}

/// `bench --init-from` measures the steps `train --init-from` runs: the
/// pretrained folder's shape (its MLP width, not the preset's) with its
/// base packed outside the parameters (what remains: the embedding, the
/// norms and the adapters), from its weights — the same losses, bit for
/// bit. Without it, a packed base is refused naming `--init-from` instead
/// of failing at the first pass.
#[test]
fn bench_measures_the_fine_tuning_steps_of_init_from() {
    let src = folder("bench-src", |_, _, w| w.to_vec());
    let sets = ["train.frozen_dtype=\"bf16\""];
    let run = tmp("bench-train");
    let o = tiny_lora_run(&run, &src, &sets, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let trained = losses(&run);
    let bench = |init: Option<&Path>| {
        let mut c = bin();
        c.args(["bench", "--json", "--steps", "2", "--warmup", "1", "--no-k-sweep"]);
        with_sets(&mut c, &[TINY_LORA, &sets].concat());
        if let Some(p) = init {
            c.arg("--init-from").arg(p);
        }
        c.output().expect("binary runs")
    };
    let o = bench(Some(&src));
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    let lora = llama::lora::LoraConfig::new(4, 8.0, &["all-linear"]);
    let packed = Llama::with_packed_layout(shape(), Some(lora)).unwrap();
    assert_eq!(r["n_params"].as_u64(), Some(packed.layout().n_params() as u64), "{r}");
    assert!(r["preset"].as_str().unwrap().contains(src.to_str().unwrap()), "{r}");
    let measured: Vec<f64> = r["step"]["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    assert_eq!(bits(&measured), bits(&trained[..3]), "bench {measured:?}, train {trained:?}");
    let rows = r["profile"].as_array().unwrap();
    assert!(rows.iter().any(|p| p["kind"] == "adapters"), "{rows:?}");
    fails(&bench(None), "--init-from");
}

/// A GPT-2 folder of `cfg` (init seed 21) whose `Conv1D` weights are
/// `project(values)`.
fn gpt2_folder(tag: &str, cfg: &gpt::GptConfig, project: impl Fn(&[f32]) -> Vec<f32>) -> PathBuf {
    let model = gpt::Gpt::new(*cfg).unwrap();
    let mut params = gpt::init_params(cfg, 21);
    for t in model.layout().tensors().iter().filter(|t| t.name.contains(".c_") && t.name.ends_with(".weight")) {
        let w = project(&params[t.range()]);
        params[t.range()].copy_from_slice(&w);
    }
    let dir = tmp(tag);
    gpt::hf::save(&dir, cfg, model.layout(), &params).unwrap();
    dir
}

/// QLoRA on GPT-2: its `Conv1D` weights pack too. A bf16 run from a
/// folder whose weights are bf16 values trains as the f32 run does, up to
/// the order of each GEMM's sums (the f32 model multiplies `[in, out]`
/// weights, the packed one the transposed rows through the packed GEMM):
/// the first loss, before any update, within 1e-5 relative (a dot product
/// of ≤ 1024 terms reordered moves by ≤ 1024·2⁻²⁴ ≈ 6e-5 of its terms'
/// magnitudes, far less in the mean a loss is), the later ones within
/// 1e-3 (AdamW's first steps move each weight by about lr whatever the
/// gradient's size, so reordering noise in a near-zero gradient is
/// amplified). An NF4 run stops and resumes bit for bit, the saved folder
/// evaluates on its packed base as on that base dequantised, and a source changed
/// since the run is refused naming the fix. `plan` counts the packed bytes.
#[test]
fn a_gpt2_base_packs_from_its_conv1d_weights() {
    let cfg = gpt::GptConfig::preset("tiny").unwrap();
    let bf16 = |w: &[f32]| w.iter().map(|x| f32::from_bits(x.to_bits() & 0xffff_0000)).collect();
    let src = gpt2_folder("frozen-gpt2-src", &cfg, bf16);
    let sets = ["model.family=gpt2", "lora.target_modules=[\"all-linear\"]", "train.checkpoint_every=2"];
    let with = |dtype: &'static str| [&sets[..], &[dtype]].concat();
    let f32_run = lora_ok(&tmp("frozen-gpt2-f32"), &src, &with("train.frozen_dtype=\"f32\""));
    let packed_out = tmp("frozen-gpt2-bf16");
    let o = lora_run(&packed_out, &src, &with("train.frozen_dtype=\"bf16\""), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let packed = losses(&packed_out);
    // The start-up line counts the packed base beside the layout's parameters.
    let conv_values = cfg.n_layer as f64 * 12.0 * (cfg.n_embd * cfg.n_embd) as f64 / 1e6;
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &stderr(&o);
    assert!(out.contains(&format!("M params + {conv_values:.2}M frozen in bf16")), "{out}");
    assert_eq!(packed.len(), 4);
    assert!((packed[0] - f32_run[0]).abs() <= 1e-5 * f32_run[0], "{packed:?} vs {f32_run:?}");
    assert_close_rel("bf16 packed vs f32", &packed, &f32_run, 1e-3);
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(packed_out.join("memory.json")).unwrap()).unwrap();
    let planned = gpt::FrozenBase::planned_bytes(&cfg, PackFormat::Bf16);
    assert_eq!(mem["predicted"]["frozen"].as_u64(), Some(planned as u64));
    // The saved folder refers to the base instead of copying it.
    assert!(!packed_out.join("model.safetensors").exists() && packed_out.join("base.json").exists());

    let nf4 = with("train.frozen_dtype=\"nf4\"");
    let straight_out = tmp("frozen-gpt2-nf4");
    let straight = lora_ok(&straight_out, &src, &nf4);
    let out = tmp("frozen-gpt2-stopped");
    let o = lora_run(&out, &src, &nf4, &["--stop-after", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = resume_ok(&out, &[]);
    assert!(!err.contains("error"), "{err}");
    assert_eq!(bits(&losses(&out)), bits(&straight), "resumed vs straight");
    // Stopped again, to be resumed after the source changes (below).
    let later = tmp("frozen-gpt2-stopped-later");
    let o = lora_run(&later, &src, &nf4, &["--stop-after", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let text = out.with_extension("txt");
    std::fs::write(&text, "Call me Ishmael. Some years ago, never mind how long precisely.\n".repeat(8)).unwrap();
    let eval = |extra: &[&str]| eval_run(&straight_out, &text, extra);
    let (packed_eval, whole) = (loss(&eval(&[])), loss(&eval(&["--dequantize"])));
    assert!((packed_eval - whole).abs() <= 1e-5 * whole, "packed {packed_eval} vs the folder's f32 base {whole}");
    let original = src.with_extension("orig");
    std::fs::rename(&src, &original).unwrap();
    let changed = gpt2_folder("frozen-gpt2-src", &cfg, |w| w.iter().map(|x| 2.0 * x).collect());
    assert_eq!(changed, src);
    fails(&eval(&[]), "is not the one it was trained on");
    // A resume of the changed source: refused, not trained on another base.
    let err = fails(&resume(&later, &[]), "is not the one it was trained on");
    assert!(err.contains("cannot resume from"), "{err}");
    let _ = std::fs::remove_dir_all(&original);
}

/// A LoRA run folder refers to its base by an absolute path, whatever
/// `--init-from` spelled: a run started with a relative path resumes and
/// evaluates on its NF4 base from any directory as from its own, bit for
/// bit (the f32 reading too). A resume that would hold the base otherwise
/// (another `train.frozen_dtype`: other roundings, another base) is
/// refused, as is `--init-from` of the run folder (adapters, not a model),
/// naming the base to start from.
#[test]
fn a_lora_folder_refers_to_its_base_absolutely_and_as_it_was_held() {
    let src = folder("frozen-rel-src", |_, _, w| w.to_vec());
    let (parent, name) = (src.parent().unwrap(), src.file_name().unwrap());
    let out = tmp("frozen-rel-run");
    let sets = ["train.frozen_dtype=\"nf4\"", "train.checkpoint_every=2"];
    let mut c = train_cmd(&out, &[TINY_LORA, &sets].concat());
    let o = c.current_dir(parent).arg("--init-from").arg(name).args(["--stop-after", "2"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let resume_in = |dir: &Path, extra: &[&str]| {
        let mut c = bin();
        c.current_dir(dir).arg("train").arg("--resume").arg(&out);
        with_sets(&mut c, extra);
        c.output().unwrap()
    };
    let err = fails(&resume_in(Path::new("/"), &["train.frozen_dtype=\"bf16\""]), "held its frozen base as nf4");
    assert!(err.contains("this one would hold it as bf16"), "{err}");
    let o = resume_in(Path::new("/"), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = out.with_extension("txt");
    std::fs::write(&text, "Call me Ishmael. Some years ago, never mind how long precisely.\n".repeat(8)).unwrap();
    let eval_in = |dir: &Path, extra: &[&str]| {
        let c =
            bin().current_dir(dir).arg("eval").arg(&out).arg("--data").arg(&text).arg("--json").args(extra).output();
        loss(&c.unwrap())
    };
    let here = eval_in(parent, &[]);
    assert_eq!(eval_in(Path::new("/"), &[]).to_bits(), here.to_bits());
    assert_eq!(eval_in(Path::new("/"), &["--dequantize"]).to_bits(), here.to_bits());
    // `auto` keeps a 16-bit file's values whether it packs them (one
    // stage) or not (a split): a resume at another split holds the same base.
    let half =
        folder("frozen-rel-bf16", |_, _, w| w.iter().map(|x| f32::from_bits(x.to_bits() & 0xffff_0000)).collect());
    let split = tmp("frozen-rel-split");
    let o = lora_run(&split, &half, &["train.checkpoint_every=2"], &["--stop-after", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = resume_ok(&split, &["dist.pipeline_parallel=2"]);
    assert!(err.contains("resuming from"), "{err}");
    assert_eq!(losses(&split).len(), 4);
    let _ = (std::fs::remove_dir_all(&half), std::fs::remove_dir_all(&split));
    let err = fails(&tiny_lora_run(&tmp("frozen-rel-again"), &out, &[], &[]), "holds LoRA adapters over the base");
    assert!(err.contains(&*src.to_string_lossy()), "{err}");
    for d in [&src, &out, &text] {
        let _ = std::fs::remove_dir_all(d).or_else(|_| std::fs::remove_file(d));
    }
}
