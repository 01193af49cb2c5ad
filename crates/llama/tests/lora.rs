//! LoRA: adapters attach to a base without changing what it computes,
//! save → load in PEFT's format is bit-exact, merging reproduces the
//! adapted model, PEFT itself loads what we save, and unsupported settings
//! are named errors.

mod common;
use common::{batch, fixture, rel_err, tmpdir};
use engine::rng::SplitMix64;
use engine::{Model, Precision};
use llama::lora::{self, LoraConfig};
use llama::{hf, Llama, LlamaError};

/// The untied fixture's base, the fixture's PEFT adapter on it.
fn fixture_lora() -> (Llama, Vec<f32>, Vec<f32>) {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let adapter = lora::load_adapter(&fixture("lora")).unwrap();
    let model = Llama::with_lora(cfg, adapter.config.clone(), Precision::F32).unwrap();
    let mut params = lora::attach(&model, &base, 0).unwrap();
    adapter.apply(&model, &mut params).unwrap();
    (model, base, params)
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn attached_adapters_start_as_peft_does_and_change_nothing() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let mut model = Llama::with_lora(cfg.clone(), LoraConfig::new(8, 16.0, &["all-linear"]), Precision::F32).unwrap();
    let params = lora::attach(&model, &base, 7).unwrap();
    let mut a_values = Vec::new();
    for t in model.layout().tensors() {
        let v = &params[t.range()];
        if t.name.contains("lora_B") {
            assert!(v.iter().all(|&x| x == 0.0), "{}: B starts at zero", t.name);
        } else if t.name.contains("lora_A") {
            // Kaiming-uniform with a = √5: U(−1/√in, 1/√in).
            let bound = 1.0 / (t.shape[1] as f32).sqrt();
            assert!(v.iter().all(|x| x.abs() <= bound), "{}", t.name);
            a_values.extend(v.iter().map(|x| x / bound));
        } else {
            let b = Llama::new(cfg.clone()).unwrap();
            assert_eq!(v, &base[b.layout().get(&t.name).unwrap().range()], "{}: base copied", t.name);
        }
    }
    // U(−1, 1) after scaling: variance 1/3; with n ≈ 7000 values its standard error is ≈ 0.003.
    let var = a_values.iter().map(|x| x * x).sum::<f32>() / a_values.len() as f32;
    assert!((var - 1.0 / 3.0).abs() < 0.015, "variance {var} of A/bound");
    // The base tensors' initial values do not depend on adapters: a LoRA
    // model's init is the plain model's init with adapters attached.
    let plain_init = Llama::new(cfg.clone()).unwrap().init_params(11);
    assert!(bits_equal(&lora::attach(&model, &plain_init, 11).unwrap(), &model.init_params(11)));
    // With B = 0 the adapted model computes exactly the base model's logits.
    let b = batch("untied");
    let lora_logits = model.logits(&params, &b).unwrap();
    assert!(bits_equal(&lora_logits, &Llama::new(cfg).unwrap().logits(&base, &b).unwrap()));
}

#[test]
fn adapters_save_in_peft_format_and_load_back_bit_exact() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let model =
        Llama::with_lora(cfg, LoraConfig::new(2, 5.0, &["q_proj", "v_proj", "down_proj"]), Precision::F32).unwrap();
    let mut params = lora::attach(&model, &base, 1).unwrap();
    let mut rng = SplitMix64::new(4);
    for t in model.layout().tensors().iter().filter(|t| lora::is_adapter(&t.name)) {
        params[t.range()].iter_mut().for_each(|x| *x = rng.normal() as f32);
    }
    let dir = tmpdir("adapter-rt");
    lora::save_adapter(&dir, &model, &params, Some("HuggingFaceTB/SmolLM2-135M")).unwrap();
    // PEFT's names and config.
    let names: Vec<String> =
        hf::read_tensors(&dir.join(lora::ADAPTER_WEIGHTS_FILE)).unwrap().into_iter().map(|t| t.0).collect();
    assert_eq!(names.len(), 2 * 3 * 2, "A and B of 3 projections in 2 layers");
    assert!(names.contains(&"base_model.model.model.layers.1.mlp.down_proj.lora_B.weight".to_string()));
    let text = std::fs::read_to_string(dir.join(lora::ADAPTER_CONFIG_FILE)).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["peft_type"], "LORA");
    assert_eq!(v["task_type"], "CAUSAL_LM");
    assert_eq!(
        (v["r"].as_u64(), v["lora_alpha"].as_f64(), v["lora_dropout"].as_f64()),
        (Some(2), Some(5.0), Some(0.0))
    );
    assert_eq!(v["target_modules"], serde_json::json!(["q_proj", "v_proj", "down_proj"]));
    assert_eq!((v["bias"].as_str(), v["fan_in_fan_out"].as_bool()), (Some("none"), Some(false)));
    assert_eq!(v["base_model_name_or_path"], "HuggingFaceTB/SmolLM2-135M");
    // Back: same config, same bits.
    let adapter = lora::load_adapter(&dir).unwrap();
    assert_eq!(adapter.config, model.lora().unwrap().clone());
    assert_eq!(adapter.base_model_name_or_path.as_deref(), Some("HuggingFaceTB/SmolLM2-135M"));
    let mut back = lora::attach(&model, &base, 99).unwrap();
    adapter.apply(&model, &mut back).unwrap();
    assert!(bits_equal(&back, &params));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_peft_adapter_saved_again_by_us_is_the_same_file_content() {
    let (model, _, params) = fixture_lora();
    let dir = tmpdir("adapter-resave");
    lora::save_adapter(&dir, &model, &params, None).unwrap();
    let ours = hf::read_tensors(&dir.join(lora::ADAPTER_WEIGHTS_FILE)).unwrap();
    let peft = hf::read_tensors(&fixture("lora").join(lora::ADAPTER_WEIGHTS_FILE)).unwrap();
    assert_eq!(ours.len(), peft.len());
    for ((n1, s1, d1), (n2, s2, d2)) in ours.iter().zip(&peft) {
        assert_eq!((n1, s1), (n2, s2));
        assert!(bits_equal(d1, d2), "{n1}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_merged_base_computes_the_adapted_logits() {
    let (mut model, base, params) = fixture_lora();
    let b = batch("lora");
    let adapted = model.logits(&params, &b).unwrap();
    let merged = lora::merge(&model, &params).unwrap();
    let mut plain = Llama::new(model.config().clone()).unwrap();
    let got = plain.logits(&merged, &b).unwrap();
    // W + s·B·A rounds once to f32 where the adapted model rounds x·Wᵀ and
    // s·(x·Aᵀ)·Bᵀ separately: ~1e-7 relative per value, ~1e-6 after two
    // layers (measured below); 1e-5 of the logits' scale.
    let e = rel_err(&got, &adapted);
    println!("merged vs adapted logits: {e:.1e} of scale");
    assert!(e <= 1e-5, "{e:e}");
    // And the merge really changed the weights (the fixture's B is non-zero).
    assert!(rel_err(&plain.logits(&base, &b).unwrap(), &adapted) > 1e-2);
    // Merging a model without adapters is an error.
    assert!(lora::merge(&plain, &base).is_err());
}

#[test]
fn unsupported_lora_settings_are_named_errors() {
    let (cfg, _) = hf::load(&fixture("untied")).unwrap();
    let with = |l: LoraConfig| Llama::with_lora(cfg.clone(), l, Precision::F32).unwrap_err();
    let e = with(LoraConfig { dropout: 1.0, ..LoraConfig::new(4, 8.0, &["q_proj"]) });
    assert!(e.to_string().contains("lora_dropout") && e.to_string().contains("[0, 1)"), "{e}");
    let e = with(LoraConfig::new(0, 8.0, &["q_proj"]));
    assert!(e.to_string().contains("`r`"), "{e}");
    let e = with(LoraConfig::new(4, 8.0, &["lm_head"]));
    assert!(e.to_string().contains("lm_head") && e.to_string().contains("all-linear"), "{e}");
    let e = with(LoraConfig::new(4, 8.0, &[]));
    assert!(e.to_string().contains("target_modules"), "{e}");
    // PEFT configurations we do not implement.
    let peft = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = lora::adapter_config_json(&LoraConfig::new(4, 8.0, &["all-linear"]), false, None).unwrap();
        edit(&mut v);
        lora::lora_config_from_peft(&v).map(|c| c.0)
    };
    assert_eq!(peft(&|_| ()).map(|c| lora::target_names(&c, false).unwrap().len()).unwrap(), 7);
    for (key, val) in [
        ("use_rslora", serde_json::json!("yes")),
        ("use_dora", serde_json::json!(1)),
        ("bias", serde_json::json!("all")),
        ("rank_pattern", serde_json::json!({"q_proj": 8})),
        ("layers_to_transform", serde_json::json!([0])),
        ("target_modules", serde_json::json!(".*proj")),
        ("peft_type", serde_json::json!("IA3")),
    ] {
        let e = peft(&|v| v[key] = val.clone()).unwrap_err().to_string();
        assert!(e.contains(key), "{key}: {e}");
    }
    // An adapter of another rank does not fit the model.
    let (model, base, _) = fixture_lora();
    let other = Llama::with_lora(cfg, LoraConfig::new(2, 8.0, &["all-linear"]), Precision::F32).unwrap();
    let adapter = lora::load_adapter(&fixture("lora")).unwrap();
    let mut p = lora::attach(&other, &base, 0).unwrap();
    assert!(adapter.apply(&other, &mut p).unwrap_err().to_string().contains("r = 2"));
    let other_alpha =
        Llama::with_lora(model.config().clone(), LoraConfig { alpha: 16.0, ..adapter.config.clone() }, Precision::F32)
            .unwrap();
    let e = adapter.apply(&other_alpha, &mut lora::attach(&other_alpha, &base, 0).unwrap()).unwrap_err();
    assert!(e.to_string().contains("lora_alpha = 16"), "{e}");
    let mut short = adapter.clone();
    short.tensors.remove("model.layers.1.mlp.up_proj.lora_A.weight");
    let mut p = lora::attach(&model, &base, 0).unwrap();
    let e = short.apply(&model, &mut p).unwrap_err();
    assert!(matches!(&e, LlamaError::MissingTensor { name } if name.contains("up_proj.lora_A")), "{e}");
}

/// PEFT itself loads the base and adapter we write and computes our logits
/// (scripts/peft_check.py). Skipped, with a note, where python3 with torch,
/// transformers and peft is not installed.
#[test]
fn peft_loads_our_base_and_adapter_and_computes_our_logits() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let mut model = Llama::with_lora(cfg.clone(), LoraConfig::new(3, 6.0, &["all-linear"]), Precision::F32).unwrap();
    let mut params = lora::attach(&model, &base, 5).unwrap();
    let mut rng = SplitMix64::new(8);
    for t in model.layout().tensors().iter().filter(|t| t.name.contains("lora_B")) {
        params[t.range()].iter_mut().for_each(|x| *x = 0.1 * rng.normal() as f32);
    }
    let dir = tmpdir("peft-check");
    let (base_dir, adapter_dir) = (dir.join("base"), dir.join("adapter"));
    hf::save(&base_dir, &cfg, &base).unwrap();
    lora::save_adapter(&adapter_dir, &model, &params, base_dir.to_str()).unwrap();
    let b = batch("untied");
    let ids: Vec<&[u32]> = b.inputs.chunks(b.seq_len).collect();
    let expected = serde_json::json!({
        "input_ids": ids,
        "logits": model.logits(&params, &b).unwrap(),
        "base_logits": Llama::new(cfg).unwrap().logits(&base, &b).unwrap(),
    });
    let check = family::reference::peft_check(&base_dir, &adapter_dir, &expected);
    let Some(stdout) = check.unwrap_or_else(|e| panic!("{e}")) else { return };
    println!("{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run folder (base + PEFT adapter beside it) loads through the family
/// with its base placed straight into the adapted layout (one copy of the
/// model, not the base and then the whole): the parameters are those of
/// `attach` + `apply`, bit for bit; a base tensor missing from the folder
/// is still named, while the adapters, which the base file never holds,
/// are not asked of it.
#[test]
fn a_lora_folder_loads_in_place_as_attach_and_apply() {
    use family::Registration;
    let (_, _, want) = fixture_lora();
    let dir = tmpdir("lora-folder");
    for (from, name) in [("untied", hf::CONFIG_FILE), ("untied", hf::WEIGHTS_FILE)]
        .into_iter()
        .chain([("lora", lora::ADAPTER_CONFIG_FILE), ("lora", lora::ADAPTER_WEIGHTS_FILE)])
    {
        std::fs::copy(fixture(from).join(name), dir.join(name)).unwrap();
    }
    let load = |dir: &std::path::Path| {
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(hf::CONFIG_FILE)).unwrap()).unwrap();
        let f = llama::FAMILY.for_hf_dir(dir, &json).unwrap();
        let layout = f.build(family::Build::default()).unwrap().layout().clone();
        f.load_weights(dir, &layout)
    };
    assert!(bits_equal(&load(&dir).unwrap(), &want));
    // The same folder without the final norm in its base file.
    let kept: Vec<_> = hf::read_tensors(&dir.join(hf::WEIGHTS_FILE))
        .unwrap()
        .into_iter()
        .filter(|t| t.0 != "model.norm.weight")
        .collect();
    let bytes: Vec<Vec<u8>> = kept.iter().map(|t| t.2.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views = kept.iter().zip(&bytes).map(|(t, b)| {
        (t.0.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.1.clone(), b).unwrap())
    });
    std::fs::write(dir.join(hf::WEIGHTS_FILE), safetensors::serialize(views, None).unwrap()).unwrap();
    let e = load(&dir).err().map(|e| {
        let mut text = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            text = format!("{text}: {c}");
            cause = c.source();
        }
        text
    });
    let e = e.unwrap_or_default();
    assert!(e.contains("model.norm.weight") && e.contains("missing"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
