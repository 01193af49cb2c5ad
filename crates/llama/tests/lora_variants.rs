//! rsLoRA, DoRA and LoRA dropout: rsLoRA is LoRA at α·√r/r; DoRA starts as
//! the base, its gradient is the detached-norm gradient PEFT computes
//! (finite differences of the whole function, corrected by the norm's own
//! path, computed here independently), it trains K-, rank- and
//! resume-invariantly (the engine's conformance checks), saves under PEFT's
//! names and merges; dropout's gradient is the gradient of the dropped-out
//! loss, evaluation runs without it, and its masks keep K micro-batches
//! equal to one.

mod common;
#[path = "common/peft.rs"]
mod peft;
use common::suite::{self, UnderTest};
use common::{batch, fixture, loss_and_grad, rel_err, tmpdir};
use engine::conformance::{self, ModelUnderTest};
use engine::rng::SplitMix64;
use engine::{Model, Precision};
use llama::lora::{self, LoraConfig};
use llama::{hf, Llama, LlamaConfig, Proj};

fn dora(r: usize, alpha: f32, targets: &[&str]) -> LoraConfig {
    LoraConfig { use_dora: true, ..LoraConfig::new(r, alpha, targets) }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every adapter tensor set to N(0, σ) noise added to its value (B away
/// from zero, magnitudes away from the base's norms).
fn perturb(model: &Llama, params: &mut [f32], seed: u64, sigma: f64) {
    let mut rng = SplitMix64::new(seed);
    for t in model.layout().tensors().iter().filter(|t| lora::is_adapter(&t.name)) {
        params[t.range()].iter_mut().for_each(|x| *x += (rng.normal() * sigma) as f32);
    }
}

#[test]
fn rslora_is_lora_scaled_by_alpha_over_the_root_of_r() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    // r = 4: α/√r = 8/2 = α'/r with α' = 16, both exact in f32.
    let rs = LoraConfig { use_rslora: true, ..LoraConfig::new(4, 8.0, &["all-linear"]) };
    assert_eq!(rs.scale(), 4.0);
    assert_eq!(LoraConfig { use_rslora: true, ..LoraConfig::new(8, 16.0, &["q_proj"]) }.scale(), 16.0 / 8f32.sqrt());
    let mut rs_model = Llama::with_lora(cfg.clone(), rs, Precision::F32).unwrap();
    let mut plain = Llama::with_lora(cfg, LoraConfig::new(4, 16.0, &["all-linear"]), Precision::F32).unwrap();
    let mut params = lora::attach(&rs_model, &base, 2).unwrap();
    perturb(&rs_model, &mut params, 4, 0.1);
    let b = batch("untied");
    assert!(bits(&rs_model.logits(&params, &b).unwrap()) == bits(&plain.logits(&params, &b).unwrap()));
    // adapter_config.json says so, and reads back.
    let dir = tmpdir("rslora-config");
    lora::save_adapter(&dir, &rs_model, &params, None).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(lora::ADAPTER_CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!((v["use_rslora"].as_bool(), v["use_dora"].as_bool()), (Some(true), Some(false)));
    let back = lora::load_adapter(&dir).unwrap().0.config;
    assert!(back.use_rslora && back.scale() == 4.0 && lora::target_names(&back, false).unwrap().len() == 7, "{back:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dora_starts_as_the_base_saves_under_peft_names_and_merges() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let mut model = Llama::with_lora(cfg.clone(), dora(3, 6.0, &["all-linear"]), Precision::F32).unwrap();
    let mut params = lora::attach(&model, &base, 5).unwrap();
    // The magnitudes start at the base rows' norms: with B = 0 the model is the base.
    let plain = Llama::new(cfg.clone()).unwrap();
    let q = plain.layer_params(1).w(Proj::Q);
    let m = model.layout().get("model.layers.1.self_attn.q_proj.lora_magnitude_vector").unwrap();
    let norm0: f64 = base[q.start..q.start + cfg.hidden_size].iter().map(|&w| (w as f64).powi(2)).sum::<f64>().sqrt();
    assert_eq!(params[m.range()][0], norm0 as f32);
    let b = batch("untied");
    let base_logits = Llama::new(cfg.clone()).unwrap().logits(&base, &b).unwrap();
    // m/‖W‖ = 1 exactly; o and down add (x·Wᵀ) to the residual in another order: ~1e-7.
    let e = rel_err(&model.logits(&params, &b).unwrap(), &base_logits);
    assert!(e <= 1e-6, "DoRA at initialisation vs the base: {e:e}");
    perturb(&model, &mut params, 9, 0.1);
    let adapted = model.logits(&params, &b).unwrap();
    assert!(rel_err(&adapted, &base_logits) > 1e-2, "the perturbed adapters change the model");
    // PEFT's names: A, B and the magnitude of 7 projections in 2 layers.
    let dir = tmpdir("dora-save");
    lora::save_adapter(&dir, &model, &params, None).unwrap();
    let names: Vec<String> =
        hf::read_tensors(&dir.join(lora::ADAPTER_WEIGHTS_FILE)).unwrap().into_iter().map(|t| t.0).collect();
    assert_eq!(names.len(), 3 * 7 * 2);
    assert!(names.contains(&"base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector".to_string()));
    let adapter = lora::load_adapter(&dir).unwrap();
    assert!(adapter.config.use_dora);
    let mut back = lora::attach(&model, &base, 1).unwrap();
    adapter.apply(&model, &mut back).unwrap();
    assert!(bits(&back) == bits(&params), "save → load is bit-exact");
    // A DoRA adapter does not load into a LoRA model.
    let lora_model = Llama::with_lora(cfg.clone(), LoraConfig::new(3, 6.0, &["all-linear"]), Precision::F32).unwrap();
    let e = adapter.apply(&lora_model, &mut lora::attach(&lora_model, &base, 1).unwrap()).unwrap_err();
    assert!(e.to_string().contains("use_dora"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    // Merged: each row of W + s·B·A scaled to its magnitude, in one f32
    // rounding per element where the adapted model rounds each product:
    // ~1e-7 relative per value, ~1e-6 after two layers.
    let merged = lora::merge(&model, &params).unwrap();
    let e = rel_err(&Llama::new(cfg).unwrap().logits(&merged, &b).unwrap(), &adapted);
    assert!(e <= 1e-5, "merged vs adapted: {e:e}");
}

/// The samples of the finite-difference checks (the suite's own: four
/// sequences of different numbers of targets).
const FD_SAMPLES: &[usize] = &[0, 1, 2, 3];

/// Central differences of the training loss (one micro-step at optimizer
/// step `step` on [`FD_SAMPLES`]) against `analytic`, the adapters'
/// gradient, with the suite's step and tolerances (common/suite.rs says why).
fn fd_check(what: &str, f: &UnderTest, params: &[f32], analytic: &[f32], step: u64) {
    let mut model = f.model();
    model.set_trainable(&|t| lora::is_adapter(&t.name));
    model.begin_step(step);
    let trainable: Vec<std::ops::Range<usize>> =
        model.layout().tensors().iter().filter(|t| t.trainable).map(|t| t.range()).collect();
    let x: Vec<f32> = trainable.iter().flat_map(|r| params[r.clone()].to_vec()).collect();
    let (b, model) = (f.batch(FD_SAMPLES), std::cell::RefCell::new(model));
    let (h, rtol, atol) = f.fd_tolerance();
    nn::fd::check_gradient(what, &x, analytic, (h as f32, atol, rtol), |xs| {
        let mut p = params.to_vec();
        let mut o = 0;
        for r in &trainable {
            p[r.clone()].copy_from_slice(&xs[o..o + r.len()]);
            o += r.len();
        }
        loss_and_grad(&mut model.borrow_mut(), &p, &b).0
    });
}

/// The tiny GQA model of the conformance suite with `lora`.
fn under_test(lora: LoraConfig) -> UnderTest {
    UnderTest::new(suite::tiny_gqa(), Some(lora))
}

/// DoRA's gradient is the gradient with the norms ‖W + s·B·A‖ held
/// constant (PEFT's `weight_norm.detach()`). Central differences see the
/// whole function, whose gradient adds the norms' path: with
/// `∂L/∂‖·‖_j = −(m_j/‖·‖_j)·dm_j` (y = (m/‖·‖)⊙z) and `W = W₀ + s·B·A`,
/// `∂‖·‖_j/∂B_ji = s·(W_j·A_i)/‖·‖_j` and `∂‖·‖_j/∂A_ik = s·B_ji·W_jk/‖·‖_j`.
/// That path is computed here in f64 from the parameters and the model's
/// magnitude gradient (itself checked directly: the norms do not depend on
/// m), and subtracted from the finite differences.
#[test]
fn dora_gradients_are_the_detached_norm_gradients() {
    let f = under_test(dora(2, 4.0, &["all-linear"]));
    let mut model = f.model();
    model.set_trainable(&|t| lora::is_adapter(&t.name));
    let params = f.init();
    let b = f.batch(FD_SAMPLES);
    let (_, g) = loss_and_grad(&mut model, &params, &b);
    let cfg = model.config().clone();
    let s = model.lora().unwrap().scale() as f64;
    let r = 2;
    // The gradient buffer holds the trainable tensors back to back, in layout order.
    let mut at = std::collections::HashMap::new();
    let mut off = 0;
    for t in model.layout().tensors().iter().filter(|t| t.trainable) {
        at.insert(t.name.clone(), off..off + t.numel());
        off += t.numel();
    }
    let mut full_grad = g.clone();
    for layer in 0..cfg.n_layer {
        for pr in Proj::ALL {
            let [oc, ic] = pr.shape(&cfg);
            let name = |s: &str| format!("model.layers.{layer}.{}.{s}", pr.path());
            let range = |s: &str| model.layout().get(&name(s)).unwrap().range();
            let (a, bm, m) = (
                &params[range("lora_A.weight")],
                &params[range("lora_B.weight")],
                &params[range("lora_magnitude_vector")],
            );
            let w0 = &params[range("weight")];
            let dm = &g[at[&name("lora_magnitude_vector")].clone()];
            // W = W₀ + s·B·A in f64, and its row norms.
            let w: Vec<f64> = (0..oc * ic)
                .map(|e| {
                    let (j, k) = (e / ic, e % ic);
                    w0[e] as f64 + s * (0..r).map(|i| bm[j * r + i] as f64 * a[i * ic + k] as f64).sum::<f64>()
                })
                .collect();
            let norms: Vec<f64> = w.chunks(ic).map(|row| row.iter().map(|v| v * v).sum::<f64>().sqrt()).collect();
            // c_j = ∂L/∂‖·‖_j · s/‖·‖_j
            let c: Vec<f64> = (0..oc).map(|j| -(m[j] as f64 / norms[j]) * dm[j] as f64 * s / norms[j]).collect();
            let ga = &mut full_grad[at[&name("lora_A.weight")].clone()];
            for i in 0..r {
                for k in 0..ic {
                    ga[i * ic + k] += (0..oc).map(|j| c[j] * bm[j * r + i] as f64 * w[j * ic + k]).sum::<f64>() as f32;
                }
            }
            let gb = &mut full_grad[at[&name("lora_B.weight")].clone()];
            for j in 0..oc {
                for i in 0..r {
                    gb[j * r + i] += (c[j] * (0..ic).map(|k| w[j * ic + k] * a[i * ic + k] as f64).sum::<f64>()) as f32;
                }
            }
        }
    }
    // The correction is not negligible: a model that let gradients flow
    // through the norms would fail below.
    let moved = rel_err(&full_grad, &g);
    assert!(moved > 1e-2, "the norms' path changes the gradient by {moved:e} of its scale");
    fd_check("DoRA adapters", &f, &params, &full_grad, 0);
}

#[test]
fn dora_passes_the_conformance_checks_but_finite_differences() {
    // Finite differences: the test above (DoRA's gradient is not the
    // function's, by design). Biases and checkpointing too.
    let mut f = under_test(dora(2, 4.0, &["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]));
    f.cfg.attention_bias = true;
    for ck in [engine::Checkpointing::None, engine::Checkpointing::Blocks, engine::Checkpointing::Selective] {
        f.checkpointing = ck;
        conformance::check_k_invariance(&f).unwrap();
        conformance::check_several_steps(&f).unwrap();
        conformance::check_frozen(&f).unwrap();
    }
    conformance::check_ranks_and_zero(&f).unwrap();
    conformance::check_resume(&f).unwrap();
}

/// Dropout's masks depend on the step and the sequence, never on where the
/// sequence sits: the suite's K- and rank-invariance hold under dropout;
/// its gradient is that of the dropped-out training loss (the same masks
/// at every evaluation of one step), which evaluation does not apply.
#[test]
fn lora_dropout_is_invariant_to_the_split_and_its_gradient_is_the_dropped_out_loss() {
    let f = under_test(LoraConfig { dropout: 0.3, ..LoraConfig::new(2, 4.0, &["all-linear"]) });
    conformance::check_k_invariance(&f).unwrap();
    conformance::check_ranks_and_zero(&f).unwrap();
    conformance::check_resume(&f).unwrap();
    // (The suite's "several steps" check compares a trainer's later steps
    // with gradients a fresh model computes at step 0: other masks, by design.)
    let mut model = f.model();
    model.set_trainable(&|t| lora::is_adapter(&t.name));
    let params = f.init();
    let b = f.batch(FD_SAMPLES);
    model.begin_step(7);
    let (train_loss, g) = loss_and_grad(&mut model, &params, &b);
    // Evaluation: no dropout (the model without it computes the same loss).
    let mut store = engine::FullStore::read_only_for(&model, &params).unwrap();
    let eval = model.loss(&mut store, &b).unwrap().loss_sum;
    let mut no_drop = UnderTest::new(suite::tiny_gqa(), Some(LoraConfig::new(2, 4.0, &["all-linear"]))).model();
    let mut store = engine::FullStore::read_only_for(&no_drop, &params).unwrap();
    assert_eq!(eval.to_bits(), no_drop.loss(&mut store, &b).unwrap().loss_sum.to_bits());
    assert!((train_loss - eval).abs() > 1e-3 * eval.abs(), "dropout changes the training loss: {train_loss} vs {eval}");
    // Another step draws other masks.
    model.begin_step(8);
    assert_ne!(loss_and_grad(&mut model, &params, &b).0.to_bits(), train_loss.to_bits());
    model.begin_step(7);
    assert_eq!(
        loss_and_grad(&mut model, &params, &b).0.to_bits(),
        train_loss.to_bits(),
        "the same step, the same masks"
    );
    fd_check("adapters under dropout", &f, &params, &g, 7);
}

#[test]
fn unsupported_combinations_are_named_errors() {
    let cfg = LlamaConfig::preset("tiny").unwrap();
    let both = LoraConfig { dropout: 0.1, ..dora(2, 4.0, &["q_proj"]) };
    let e = Llama::with_lora(cfg.clone(), both, Precision::F32).unwrap_err().to_string();
    assert!(e.contains("lora_dropout") && e.contains("use_dora"), "{e}");
    // Split, DoRA on a row-parallel projection is refused (its row norms
    // span the ranks); column DoRA and dropout split (tensor.rs trains them).
    let tp = engine::TpRank::new(0, 2);
    let e = Llama::tensor_parallel(cfg.clone(), Some(dora(2, 4.0, &["o_proj"])), Precision::F32, tp);
    let e = e.unwrap_err().to_string();
    assert!(e.contains("o_proj") && e.contains("dist.tensor_parallel = 1"), "{e}");
    for l in [dora(2, 4.0, &["q_proj"]), LoraConfig { dropout: 0.1, ..LoraConfig::new(2, 4.0, &["o_proj"]) }] {
        assert!(Llama::tensor_parallel(cfg.clone(), Some(l), Precision::F32, tp).is_ok());
    }
}

/// PEFT itself loads rsLoRA and DoRA adapters we save on SmolLM2-135M (the
/// GGUF, dequantised to f32 on both sides) and computes our logits
/// (scripts/peft_variants_check.py; its docstring explains the tolerance).
/// Skipped, with a note, without the file or without python3 with torch,
/// transformers, peft and gguf (CI has both and sets
/// MACROBATCH_REQUIRE_PYTHON=1, where a check that cannot run fails).
#[test]
fn peft_computes_our_rslora_and_dora_logits_on_smollm2() {
    let Some(path) = gguf::testing::smollm2_or_skip("peft_computes_our_rslora_and_dora_logits_on_smollm2") else {
        return;
    };
    let has = std::process::Command::new("python3")
        .args(["-c", "import torch, transformers, peft, gguf, safetensors"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        assert!(
            std::env::var("MACROBATCH_REQUIRE_PYTHON").as_deref() != Ok("1"),
            "MACROBATCH_REQUIRE_PYTHON=1 but python3 cannot import torch, transformers, peft, gguf and safetensors"
        );
        eprintln!("skipped: python3 with torch, transformers, peft and gguf is not available");
        return;
    }
    let (config, tensors) = gguf::llama::load(&path).unwrap();
    let cfg = LlamaConfig::from_hf_json(&config).unwrap();
    let base = hf::from_named_tensors(&cfg, tensors).unwrap();
    let (b, t) = (2, 16);
    let mut rng = SplitMix64::new(21);
    let batch = peft::random_batch(&mut rng, (b, t), cfg.vocab_size);
    let base_logits = Llama::new(cfg.clone()).unwrap().logits(&base, &batch).unwrap();
    let dir = tmpdir("peft-variants");
    let variants = [
        LoraConfig { use_rslora: true, ..LoraConfig::new(8, 16.0, &["all-linear"]) },
        dora(8, 16.0, &["all-linear"]),
        LoraConfig { use_rslora: true, ..dora(4, 8.0, &["q_proj", "v_proj", "down_proj"]) },
    ];
    let mut adapted = Vec::new();
    for (i, l) in variants.into_iter().enumerate() {
        let mut model = Llama::with_lora(cfg.clone(), l, Precision::F32).unwrap();
        let mut params = lora::attach(&model, &base, 3 + i as u64).unwrap();
        // B from zero to N(0, 0.02²); DoRA's magnitudes by up to ±2% of the norms (30 layers compound it).
        let mut rng = SplitMix64::new(40 + i as u64);
        peft::move_adapters(model.layout(), &mut params, &mut rng, (0.02, 0.01));
        let logits = model.logits(&params, &batch).unwrap();
        let change = logits.iter().zip(&base_logits).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("variant {i}: the adapters move the logits by up to {change:.3}");
        assert!(change > 0.2, "variant {i}: a change of {change} could hide a wrong scale inside the tolerance");
        let d = dir.join(format!("adapter{i}"));
        lora::save_adapter(&d, &model, &params, None).unwrap();
        adapted.push((d, logits));
    }
    peft::check_with_peft(&dir, &path, (b, t, cfg.vocab_size), (&batch.inputs, &base_logits), &adapted);
    std::fs::remove_dir_all(&dir).unwrap();
}
