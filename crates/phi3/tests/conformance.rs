//! Phi-3 runs the engine's Model conformance suite (engine::conformance):
//! the Llama block with as many key/value heads as query heads (as
//! Phi-3-mini has) and a sliding window of 3 keys over sequences of 8,
//! untied head — finite differences, K/W/ZeRO invariance with an empty
//! micro-batch, several steps, frozen tensors and bit-exact resume — and
//! with LoRA and DoRA on the fused modules PEFT targets (`qkv_proj`,
//! `gate_up_proj`: one adapter over q|k|v, one over gate|up), which merge
//! into the same model and which PEFT loads, computing our logits.

#[path = "../../llama/tests/common/mod.rs"]
mod common;
#[path = "../../llama/tests/common/peft.rs"]
mod peft;

use common::suite::{tiny_gqa, UnderTest, T};
use engine::conformance;
use engine::Model;
use llama::{Dialect, Llama, LlamaConfig, LlamaFamily, LoraConfig};

/// The suite's tiny shape with Phi-3's attention (4 query heads, 4
/// key/value heads), norm ε and RoPE θ, and a window of 3 keys (Phi-3's
/// tiny preset has one shorter than its context too).
pub fn cfg() -> LlamaConfig {
    let tiny = phi3::PHI3.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.sliding_window.is_some_and(|w| w < tiny.max_position_embeddings), "a window in the preset");
    assert_eq!(tiny.n_kv_head, tiny.n_head, "Phi-3-mini's attention: a key/value head per query head");
    const { assert!(3 < T, "the window is shorter than the suite's sequences") };
    let base = tiny_gqa();
    LlamaConfig {
        n_kv_head: base.n_head,
        sliding_window: Some(3),
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        fused_modules: tiny.fused_modules,
        ..base
    }
}

#[test]
fn phi3_passes_the_conformance_suite() {
    conformance::run_all(&UnderTest::new(cfg(), None)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn phi3_with_lora_on_the_fused_modules_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&UnderTest::new(cfg(), Some(lora))).unwrap_or_else(|e| panic!("{e}"));
}

/// DoRA on the fused modules: the suite's checks but finite differences
/// (DoRA's gradient holds the row norms constant by design, as PEFT's).
#[test]
fn phi3_with_dora_on_the_fused_modules_passes_the_conformance_checks_but_finite_differences() {
    let dora = LoraConfig { use_dora: true, ..LoraConfig::new(2, 4.0, &["all-linear"]) };
    let f = UnderTest::new(cfg(), Some(dora));
    conformance::check_k_invariance(&f).unwrap_or_else(|e| panic!("{e}"));
    conformance::check_ranks_and_zero(&f).unwrap_or_else(|e| panic!("{e}"));
    conformance::check_resume(&f).unwrap_or_else(|e| panic!("{e}"));
}

/// The adapters have PEFT's names and shapes for Phi-3 (one `lora_A`
/// `[r, C]` and `lora_B` `[q + 2·kv, r]` on `qkv_proj`, `[2F, r]` on
/// `gate_up_proj`); Llama's per-projection names are refused (Phi-3 has
/// no `q_proj` module), as is tensor parallelism over a fused module.
#[test]
fn adapters_sit_on_the_fused_modules_with_peft_names() {
    let cfg = cfg();
    let model = Llama::with_lora(cfg.clone(), LoraConfig::new(2, 4.0, &["all-linear"]), engine::Precision::F32)
        .unwrap_or_else(|e| panic!("{e}"));
    let shape = |name: &str| model.layout().get(name).map(|t| t.shape.clone());
    let (c, f, qkv) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim() + 2 * cfg.kv_dim());
    assert_eq!(shape("model.layers.1.self_attn.qkv_proj.lora_A.weight"), Some(vec![2, c]));
    assert_eq!(shape("model.layers.1.self_attn.qkv_proj.lora_B.weight"), Some(vec![qkv, 2]));
    assert_eq!(shape("model.layers.1.mlp.gate_up_proj.lora_B.weight"), Some(vec![2 * f, 2]));
    assert_eq!(shape("model.layers.1.self_attn.o_proj.lora_B.weight"), Some(vec![c, 2]));
    let adapters = model.layout().tensors().iter().filter(|t| llama::lora::is_adapter(&t.name)).count();
    assert_eq!(adapters, 2 * 4 * cfg.n_layer, "A and B on qkv, o, gate_up and down");
    let e = LlamaFamily::new(&phi3::PHI3, cfg.clone(), Some(LoraConfig::new(2, 4.0, &["q_proj"])));
    let e = e.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("q_proj") && e.contains("qkv_proj"), "{e}");
    let tp = engine::TpRank::new(0, 2);
    let lora = Some(LoraConfig::new(2, 4.0, &["qkv_proj"]));
    let e = Llama::tensor_parallel(cfg.clone(), lora, engine::Precision::F32, tp).err().map(|e| e.to_string());
    assert!(e.as_deref().is_some_and(|e| e.contains("fused") && e.contains("tensor_parallel = 1")), "{e:?}");
    // o_proj and down_proj are plain modules: they split as the Llama block's.
    let plain = Some(LoraConfig::new(2, 4.0, &["o_proj", "down_proj"]));
    assert!(Llama::tensor_parallel(cfg, plain, engine::Precision::F32, tp).is_ok());
}

/// Adapted logits equal the merged model's (`llama::lora::merge`: one
/// `B·A` added over the q|k|v rows and one over gate|up, DoRA's rows then
/// rescaled), LoRA and DoRA, with B and the magnitudes moved off their
/// initial values so every adapter acts. Tolerance 1e-5 of the largest
/// logit: the same sums in another order (the merged weight rounds
/// `W + s·B·A` once; the adapted model adds `s·(x·Aᵀ)·Bᵀ` to `x·Wᵀ`).
#[test]
fn fused_adapters_compute_their_merged_model() {
    use engine::rng::SplitMix64;
    let cfg = cfg();
    let base = Llama::new(cfg.clone()).unwrap_or_else(|e| panic!("{e}")).init_params(5);
    for dora in [false, true] {
        let lora = LoraConfig { use_dora: dora, ..LoraConfig::new(2, 4.0, &["all-linear"]) };
        let model = Llama::with_lora(cfg.clone(), lora, engine::Precision::F32).unwrap_or_else(|e| panic!("{e}"));
        let mut params = llama::lora::attach(&model, &base, 3).unwrap_or_else(|e| panic!("{e}"));
        let mut rng = SplitMix64::new(8);
        peft::move_adapters(model.layout(), &mut params, &mut rng, (0.1, 0.1));
        let merged = llama::lora::merge(&model, &params).unwrap_or_else(|e| panic!("{e}"));
        let inputs: Vec<u32> = (0..2 * T).map(|i| (i * 7 % cfg.vocab_size) as u32).collect();
        let batch =
            engine::TokenBatch { n_seqs: 2, seq_len: T, inputs, targets: vec![-100; 2 * T], positions: Vec::new() };
        let (mut m, mut p) = (model, Llama::new(cfg.clone()).unwrap_or_else(|e| panic!("{e}")));
        let ours = m.logits(&params, &batch).unwrap_or_else(|e| panic!("{e}"));
        let want = p.logits(&merged, &batch).unwrap_or_else(|e| panic!("{e}"));
        let base_logits = p.logits(&base, &batch).unwrap_or_else(|e| panic!("{e}"));
        let largest = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let gap = ours.iter().zip(&want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        let moved = base_logits.iter().zip(&want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(moved > 1e-2, "dora = {dora}: the adapters move the logits by {moved} only");
        assert!(gap <= 1e-5 * largest, "dora = {dora}: adapted vs merged {gap}, largest logit {largest}");
    }
}

/// PEFT itself loads LoRA and DoRA adapters we save on this Phi-3 (the
/// base saved by us as a `Phi3ForCausalLM` folder, its q|k|v and gate|up
/// fused) and computes our logits: one adapter over `qkv_proj` and one
/// over `gate_up_proj`, as PEFT targets them (scripts/peft_variants_check.py;
/// its docstring explains the tolerance). Skipped, with a note, without
/// python3 with torch, transformers and peft (not under
/// `MACROBATCH_REQUIRE_PYTHON=1`, as in CI).
#[test]
fn peft_computes_our_logits_with_adapters_on_the_fused_modules() {
    use engine::rng::SplitMix64;
    use family::Family;
    if !family::reference::python_with("torch, transformers, peft, safetensors").unwrap_or_else(|e| panic!("{e}")) {
        eprintln!("skipped: python3 with torch, transformers and peft is not available");
        return;
    }
    let cfg = cfg();
    let plain = Llama::new(cfg.clone()).unwrap_or_else(|e| panic!("{e}"));
    let mut base = plain.init_params(5);
    let mut rng = SplitMix64::new(8);
    base.iter_mut().for_each(|x| *x += (rng.normal() * 0.05) as f32);
    let dir = common::tmpdir("phi3-fused-peft");
    let base_dir = dir.join("base");
    std::fs::create_dir_all(&base_dir).unwrap();
    let fam = LlamaFamily::new(&phi3::PHI3, cfg.clone(), None).unwrap_or_else(|e| panic!("{e}"));
    fam.save_hf(&base_dir, plain.layout(), &base).unwrap_or_else(|e| panic!("{e}"));
    let (b, t) = (2, T);
    let batch = peft::random_batch(&mut rng, (b, t), cfg.vocab_size);
    let base_logits = Llama::new(cfg.clone()).unwrap().logits(&base, &batch).unwrap();
    let mut adapted = Vec::new();
    for (i, dora) in [false, true].into_iter().enumerate() {
        let lora = LoraConfig { use_dora: dora, ..LoraConfig::new(4, 8.0, &["all-linear"]) };
        let mut model = Llama::with_lora(cfg.clone(), lora, engine::Precision::F32).unwrap_or_else(|e| panic!("{e}"));
        let mut params = llama::lora::attach(&model, &base, 3).unwrap_or_else(|e| panic!("{e}"));
        peft::move_adapters(model.layout(), &mut params, &mut rng, (0.1, 0.1));
        let l = model.logits(&params, &batch).unwrap();
        let change = l.iter().zip(&base_logits).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(change > 0.2, "a change of {change} could hide a wrong scale inside the tolerance");
        let adapter = dir.join(format!("adapter-{i}"));
        llama::lora::save_adapter(&adapter, &model, &params, None).unwrap_or_else(|e| panic!("{e}"));
        adapted.push((adapter, l));
    }
    let shape = (b, t, cfg.vocab_size);
    peft::check_with_peft(&dir, &base_dir, shape, (&batch.inputs, &base_logits), &adapted);
    std::fs::remove_dir_all(&dir).unwrap();
}
