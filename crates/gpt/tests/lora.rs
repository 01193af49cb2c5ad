//! LoRA on GPT-2: adapters attach to a base without changing what it
//! computes, the adapted model is its merge (logits and gradients: the
//! adapters' gradients are the chain rule through the merged weight's),
//! save → load in PEFT's format is bit-exact with PEFT's names, PEFT itself
//! loads what we save and computes our logits and loss, and what GPT-2
//! does not support is a named error.

mod common;

use engine::rng::SplitMix64;
use engine::{Model, Precision, TpRank};
use gpt::{lora, Batch, Gpt, GptConfig};
use nn::lora::LoraConfig;

fn cfg() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 32 }
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// max |a − b| over max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Three sequences of 8 random tokens, the first two targets of the
/// second ignored.
fn batch() -> Batch {
    let mut rng = SplitMix64::new(21);
    let (b, t) = (3, 8);
    let inputs: Vec<u32> = (0..b * t).map(|_| rng.below(32) as u32).collect();
    let mut targets: Vec<i32> = (0..b * t).map(|_| rng.below(32) as i32).collect();
    targets[t..t + 2].fill(gpt::IGNORE_INDEX);
    Batch { n_seqs: b, seq_len: t, inputs, targets, positions: Vec::new() }
}

/// A noisy base (so biases and gains matter) with adapters on `targets`,
/// B random (not PEFT's zero start) so every adapter acts.
fn adapted(targets: &[&str], seed: u64) -> (Gpt, Vec<f32>, Vec<f32>) {
    adapted_with(LoraConfig::new(3, 6.0, targets), seed)
}

/// [`adapted`] with `lora`; DoRA's magnitudes moved by up to ±10% from
/// the base's norms.
fn adapted_with(lora: LoraConfig, seed: u64) -> (Gpt, Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix64::new(seed);
    let mut base = gpt::init_params(&cfg(), seed);
    base.iter_mut().for_each(|x| *x += (0.3 * rng.normal()) as f32);
    let model = Gpt::with_lora(cfg(), lora, Precision::F32).unwrap();
    let mut params = lora::attach(&model, &base, seed).unwrap();
    for t in model.layout().tensors().iter().filter(|t| t.name.contains("lora_B")) {
        params[t.range()].iter_mut().for_each(|x| *x = (0.2 * rng.normal()) as f32);
    }
    for t in model.layout().tensors().iter().filter(|t| t.name.ends_with(nn::lora::MAGNITUDE)) {
        params[t.range()].iter_mut().for_each(|x| *x *= 1.0 + (0.1 * (2.0 * rng.next_f64() - 1.0)) as f32);
    }
    (model, base, params)
}

/// The loss sum and gradient of one micro-step at `params`.
fn step(model: &mut Gpt, params: &[f32]) -> (f64, Vec<f32>) {
    common::step(model, params, &batch())
}

#[test]
fn attached_adapters_start_as_peft_does_and_change_nothing() {
    let base = gpt::init_params(&cfg(), 7);
    let mut model = Gpt::with_lora(cfg(), LoraConfig::new(4, 8.0, &["all-linear"]), Precision::F32).unwrap();
    let params = lora::attach(&model, &base, 7).unwrap();
    // The base's values do not depend on adapters: a LoRA model's
    // initialisation is the plain model's with adapters attached.
    assert!(bits_equal(&params, &model.init_params(7)));
    let plain = Gpt::new(cfg()).unwrap();
    for t in model.layout().tensors() {
        let v = &params[t.range()];
        if t.name.contains("lora_B") {
            assert!(v.iter().all(|&x| x == 0.0), "{}: B starts at zero", t.name);
        } else if t.name.contains("lora_A") {
            // Kaiming-uniform with a = √5: U(−1/√in, 1/√in), `in` = A's columns.
            let bound = 1.0 / (t.shape[1] as f32).sqrt();
            assert!(v.iter().all(|x| x.abs() <= bound) && v.iter().any(|x| x.abs() > bound / 2.0), "{}", t.name);
        } else {
            assert_eq!(v, &base[plain.layout().get(&t.name).unwrap().range()], "{}: base copied", t.name);
        }
    }
    // Four adapters a block, each A [r, in] and B [out, r] in Conv1D's in/out.
    let shape = |n: &str| model.layout().get(&format!("transformer.h.1.{n}.weight")).unwrap().shape.clone();
    assert_eq!(shape("attn.c_attn.lora_A"), [4, 16]);
    assert_eq!(shape("attn.c_attn.lora_B"), [48, 4]);
    assert_eq!(shape("mlp.c_fc.lora_B"), [64, 4]);
    assert_eq!(shape("mlp.c_proj.lora_A"), [4, 64]);
    // With B = 0 the adapted model computes exactly the base's logits.
    let mut plain = plain;
    assert!(bits_equal(&model.logits(&params, &batch()).unwrap(), &plain.logits(&base, &batch()).unwrap()));
}

/// The adapted model is its merge `W + s·(B·A)ᵀ`: the same logits, and
/// the chain rule through the merged weight's gradient G = dL/dW_eff
/// (computed by the plain model) gives the adapters' — dA = s·(G·B)ᵀ,
/// dB = s·(A·G)ᵀ — and the base weight's own (G itself). Every layer
/// alone, then all four. Both sides compute the same function in f32 with
/// other groupings (x·W + s·(x·Aᵀ)·Bᵀ against x·(W + s·AᵀBᵀ)): ~1e-6 of
/// the values, measured up to 4e-6; 1e-4 bounds that, while a transposed
/// or unscaled adapter is off by O(1).
#[test]
fn the_adapted_model_is_its_merge_in_logits_and_gradients() {
    for targets in [&["c_attn"][..], &["attn.c_proj"], &["c_fc"], &["mlp.c_proj"], &["all-linear"]] {
        let (mut model, _, params) = adapted(targets, 5);
        let merged = lora::merge(&model, &params).unwrap();
        let mut plain = Gpt::new(cfg()).unwrap();
        let (b, what) = (batch(), targets.join(","));
        let e = rel_err(&model.logits(&params, &b).unwrap(), &plain.logits(&merged, &b).unwrap());
        assert!(e < 1e-4, "{what}: logits differ by {e:.1e}");
        let (loss, grads) = step(&mut model, &params);
        let (loss_merged, g_merged) = step(&mut plain, &merged);
        assert!((loss - loss_merged).abs() < 1e-5 * loss.abs(), "{what}: loss {loss} vs {loss_merged}");
        let s = 6.0f32 / 3.0;
        let mut adapters = 0;
        for i in 0..cfg().n_layer {
            for conv in gpt::layout::CONVS {
                let name = |t: &str| format!("transformer.h.{i}.{conv}.{t}");
                let (Some(ta), Some(tb)) =
                    (model.layout().get(&name("lora_A.weight")), model.layout().get(&name("lora_B.weight")))
                else {
                    continue;
                };
                adapters += 1;
                let tw = plain.layout().get(&name("weight")).unwrap();
                let (r, inp, out) = (ta.shape[0], ta.shape[1], tb.shape[0]);
                let g = &g_merged[tw.range()]; // [in, out]
                let (a, bm) = (&params[ta.range()], &params[tb.range()]);
                // dA[k, i] = s Σ_o B[o, k] G[i, o];  dB[o, k] = s Σ_i A[k, i] G[i, o]
                let da: Vec<f32> = (0..r * inp)
                    .map(|ki| {
                        let (k, ii) = (ki / inp, ki % inp);
                        s * (0..out).map(|o| bm[o * r + k] as f64 * g[ii * out + o] as f64).sum::<f64>() as f32
                    })
                    .collect();
                let db: Vec<f32> = (0..out * r)
                    .map(|ok| {
                        let (o, k) = (ok / r, ok % r);
                        s * (0..inp).map(|ii| a[k * inp + ii] as f64 * g[ii * out + o] as f64).sum::<f64>() as f32
                    })
                    .collect();
                let e = rel_err(&grads[ta.range()], &da);
                assert!(e < 1e-4, "{what}: {}: dA off by {e:.1e}", ta.name);
                let e = rel_err(&grads[tb.range()], &db);
                assert!(e < 1e-4, "{what}: {}: dB off by {e:.1e}", tb.name);
                let e = rel_err(&grads[model.layout().get(&tw.name).unwrap().range()], g);
                assert!(e < 1e-4, "{what}: {}: dW off by {e:.1e}", tw.name);
            }
        }
        let per_block = if targets == ["all-linear"] { 4 } else { 1 };
        assert_eq!(adapters, per_block * cfg().n_layer, "{what}");
    }
}

/// DoRA on GPT-2 as PEFT's `DoraLinearLayer` computes it on a `Conv1D`
/// (`fan_in_fan_out`: a column of `W [in, out]` is an output feature's
/// weight). It starts as the base — each magnitude is its column's norm —
/// and the adapted model is its merge `W' = (W + s·(B·A)ᵀ)·diag(f)`,
/// `f_j = m_j/‖W + s·(B·A)ᵀ‖_j`: the same logits, and, the norms held
/// constant (PEFT's `weight_norm.detach()`), the chain rule through `W'`
/// from the plain model's gradient `G = dL/dW'` gives every gradient:
/// `dW = G·diag(f)`, `dA = s·(G·diag(f)·B)ᵀ`, `dB = s·(A·G·diag(f))ᵀ`,
/// `dm_j = Σ_i G_ij·(W + s·(B·A)ᵀ)_ij / ‖·‖_j` — computed here in f64.
/// Tolerances as the LoRA merge test's (other f32 groupings, ~1e-6).
#[test]
fn dora_starts_as_the_base_and_is_its_merge_in_logits_and_gradients() {
    let dora = LoraConfig { use_dora: true, ..LoraConfig::new(3, 6.0, &["all-linear"]) };
    // The start: magnitudes are the base's column norms, the logits the base's.
    let base = gpt::init_params(&cfg(), 4);
    let mut model0 = Gpt::with_lora(cfg(), dora.clone(), Precision::F32).unwrap();
    let start = lora::attach(&model0, &base, 4).unwrap();
    let mut plain = Gpt::new(cfg()).unwrap();
    let e = rel_err(&model0.logits(&start, &batch()).unwrap(), &plain.logits(&base, &batch()).unwrap());
    assert!(e < 1e-6, "DoRA at its start vs the base: {e:.1e}");

    let (mut model, _, params) = adapted_with(dora, 6);
    let merged = lora::merge(&model, &params).unwrap();
    let e = rel_err(&model.logits(&params, &batch()).unwrap(), &plain.logits(&merged, &batch()).unwrap());
    assert!(e < 1e-4, "logits differ by {e:.1e}");
    let (loss, grads) = step(&mut model, &params);
    let (loss_merged, g_merged) = step(&mut plain, &merged);
    assert!((loss - loss_merged).abs() < 1e-5 * loss.abs(), "loss {loss} vs {loss_merged}");
    let s = 6.0f64 / 3.0;
    for i in 0..cfg().n_layer {
        for conv in gpt::layout::CONVS {
            let name = |t: &str| format!("transformer.h.{i}.{conv}.{t}");
            let get = |t: &str| model.layout().get(&name(t)).unwrap().range();
            let (ta, tb, tm, tw) =
                (get("lora_A.weight"), get("lora_B.weight"), get(nn::lora::MAGNITUDE), get("weight"));
            let (a, bm, m, w) = (&params[ta.clone()], &params[tb.clone()], &params[tm.clone()], &params[tw.clone()]);
            let (r, out) = (3, m.len());
            let inp = a.len() / r;
            // V = W + s·(B·A)ᵀ [in, out] and its column norms, in f64.
            let v: Vec<f64> = (0..inp * out)
                .map(|e| {
                    let (k, j) = (e / out, e % out);
                    w[e] as f64 + s * (0..r).map(|q| bm[j * r + q] as f64 * a[q * inp + k] as f64).sum::<f64>()
                })
                .collect();
            let norm: Vec<f64> =
                (0..out).map(|j| (0..inp).map(|k| v[k * out + j].powi(2)).sum::<f64>().sqrt()).collect();
            let f: Vec<f64> = (0..out).map(|j| m[j] as f64 / norm[j]).collect();
            let g = &g_merged[plain.layout().get(&name("weight")).unwrap().range()];
            let gf = |k: usize, j: usize| g[k * out + j] as f64 * f[j];
            let dw: Vec<f32> = (0..inp * out).map(|e| gf(e / out, e % out) as f32).collect();
            let da: Vec<f32> = (0..r * inp)
                .map(|e| {
                    let (q, k) = (e / inp, e % inp);
                    (s * (0..out).map(|j| bm[j * r + q] as f64 * gf(k, j)).sum::<f64>()) as f32
                })
                .collect();
            let db: Vec<f32> = (0..out * r)
                .map(|e| {
                    let (j, q) = (e / r, e % r);
                    (s * (0..inp).map(|k| a[q * inp + k] as f64 * gf(k, j)).sum::<f64>()) as f32
                })
                .collect();
            let dm: Vec<f32> = (0..out)
                .map(|j| ((0..inp).map(|k| g[k * out + j] as f64 * v[k * out + j]).sum::<f64>() / norm[j]) as f32)
                .collect();
            for (what, range, want) in [("W", tw, dw), ("A", ta, da), ("B", tb, db), ("m", tm, dm)] {
                let e = rel_err(&grads[range], &want);
                assert!(e < 1e-4, "{}: d{what} off by {e:.1e}", name(""));
            }
        }
    }
}

#[test]
fn peft_names_and_files_round_trip() {
    let t = &gpt::layout::TARGETS;
    let names = |m: &[&str]| LoraConfig::new(2, 4.0, m).target_names(t).unwrap();
    // PEFT matches `c_proj` against both output projections.
    assert_eq!(names(&["all-linear"]), ["c_attn", "c_proj", "c_fc"]);
    assert_eq!(names(&["c_proj"]), ["c_proj"]);
    assert_eq!(names(&["attn.c_proj", "mlp.c_proj"]), ["c_proj"]);
    assert_eq!(names(&["mlp.c_proj"]), ["mlp.c_proj"]);
    assert_eq!(LoraConfig::new(2, 4.0, &["c_proj"]).targets(t).unwrap(), [false, true, false, true]);

    let (model, _, params) = adapted(&["c_attn", "c_proj"], 9);
    let dir = std::env::temp_dir().join(format!("macrobatch-gpt-lora-{}", std::process::id()));
    lora::save_adapter(&dir, &model, &params, Some("gpt2")).unwrap();
    let cfg_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(nn::lora::ADAPTER_CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(cfg_json["fan_in_fan_out"], true, "Conv1D weights: PEFT's fan_in_fan_out");
    assert_eq!(cfg_json["target_modules"], serde_json::json!(["c_attn", "c_proj"]));
    let (file, _) = nn::io::read_safetensors(&dir.join(nn::lora::ADAPTER_WEIGHTS_FILE)).unwrap();
    assert!(file.contains_key("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"), "{:?}", file.keys());
    assert_eq!(file.len(), 2 * 3 * cfg().n_layer);
    let adapter = lora::load_adapter(&dir).unwrap();
    assert_eq!(
        adapter.config,
        LoraConfig { target_modules: vec!["c_attn".into(), "c_proj".into()], ..adapter.config.clone() }
    );
    let mut back = lora::attach(&model, &gpt::init_params(&cfg(), 9), 1).unwrap();
    let base_of = |p: &[f32]| -> Vec<f32> {
        model
            .layout()
            .tensors()
            .iter()
            .filter(|t| !lora::is_adapter(&t.name))
            .flat_map(|t| p[t.range()].to_vec())
            .collect()
    };
    let mut want = params.clone();
    // The base comes from elsewhere; the adapters from the file, bit for bit.
    for t in model.layout().tensors().iter().filter(|t| !lora::is_adapter(&t.name)) {
        want[t.range()].copy_from_slice(&back[t.range()]);
    }
    lora::apply(&adapter, &model, &mut back).unwrap();
    assert!(bits_equal(&back, &want));
    assert_eq!(base_of(&back), base_of(&want));
    // Another rank or targets: named, with the fix.
    let other = Gpt::with_lora(cfg(), LoraConfig::new(2, 6.0, &["c_attn", "c_proj"]), Precision::F32).unwrap();
    let e = lora::apply(&adapter, &other, &mut other.init_params(0)).unwrap_err().to_string();
    assert!(e.contains("r = 2") && e.contains("adapter's config"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unsupported_settings_are_named_errors() {
    let err = |l: LoraConfig| Gpt::with_lora(cfg(), l, Precision::F32).unwrap_err().to_string();
    let l = || LoraConfig::new(2, 4.0, &["c_attn"]);
    // DoRA under dropout: PEFT multiplies the base a second time (named, as for every family).
    let e = err(LoraConfig { use_dora: true, dropout: 0.1, ..l() });
    assert!(e.contains("lora_dropout") && e.contains("use_dora"), "{e}");
    let e = err(LoraConfig::new(2, 4.0, &["q_proj"]));
    assert!(e.contains("q_proj") && e.contains("c_attn, c_proj, c_fc"), "{e}");
    let e = err(LoraConfig::new(0, 4.0, &["c_fc"]));
    assert!(e.contains("`r`"), "{e}");
    // Tensor parallelism: a rank's family (tensor.rs trains it); what a
    // rank cannot compute as uncut is refused before any model is built.
    use family::Family;
    let fam = gpt::registration::Gpt2Lora::new(cfg(), l()).unwrap();
    let rank = fam.tensor_parallel(TpRank::new(1, 2)).unwrap_or_else(|e| panic!("{e}"));
    assert!(rank.describe().contains("tensor-parallel rank 1 of 2"), "{}", rank.describe());
    assert!(rank.n_params() < fam.n_params());
    let drop = gpt::registration::Gpt2Lora::new(cfg(), LoraConfig { dropout: 0.1, ..l() }).unwrap();
    assert!(drop.tensor_parallel(TpRank::new(0, 2)).is_ok(), "dropout splits (tensor.rs trains it)");
    let row_dora = LoraConfig { use_dora: true, ..LoraConfig::new(2, 4.0, &["c_proj"]) };
    let dora = gpt::registration::Gpt2Lora::new(cfg(), row_dora).unwrap();
    let e = dora.tensor_parallel(TpRank::new(0, 2)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("use_dora") && e.contains("c_proj") && e.contains("tensor_parallel = 1"), "{e}");
}

/// PEFT itself loads the base and adapter we write and computes our
/// logits and loss ([`common::peft_computes`]).
#[test]
fn peft_loads_our_gpt2_adapter_and_computes_our_logits_and_loss() {
    peft_computes_ours("lora", adapted(&["all-linear"], 11));
}

/// [`peft_loads_our_gpt2_adapter_and_computes_our_logits_and_loss`] with
/// DoRA and rsLoRA (PEFT's `DoraLinearLayer` on `Conv1D`, its
/// magnitudes moved from the base's norms) on c_attn and the MLP.
#[test]
fn peft_loads_our_gpt2_dora_adapter_and_computes_our_logits_and_loss() {
    let dora =
        LoraConfig { use_dora: true, use_rslora: true, ..LoraConfig::new(3, 6.0, &["c_attn", "c_fc", "mlp.c_proj"]) };
    peft_computes_ours("dora", adapted_with(dora, 12));
}

fn peft_computes_ours(tag: &str, (mut model, base, params): (Gpt, Vec<f32>, Vec<f32>)) {
    let dir = std::env::temp_dir().join(format!("macrobatch-gpt-peft-{tag}-{}", std::process::id()));
    gpt::hf::save(&dir.join("base"), &cfg(), Gpt::new(cfg()).unwrap().layout(), &base).unwrap();
    lora::save_adapter(&dir.join("adapter"), &model, &params, dir.join("base").to_str()).unwrap();
    let base_logits = Gpt::new(cfg()).unwrap().logits(&base, &batch()).unwrap();
    common::peft_computes(&dir, (&mut model, &params), base_logits, &batch());
}
