//! Gemma 2 runs the engine's Model conformance suite (engine::conformance):
//! the Llama block with Gemma's pieces — GeGLU, `1 + w` norms and post
//! norms, the √C embedding scale, a window of 3 keys over sequences of 8
//! on layer 0 and none on layer 1, scores scaled by 24^-½ and soft-capped
//! at 1, logits soft-capped at 1.5 (both tight enough to bite), tied head
//! — finite differences, K/W/ZeRO invariance with an empty micro-batch,
//! several steps, frozen tensors and bit-exact resume — plain, and with
//! LoRA adapters on a frozen base.

#[path = "../../llama/tests/common/mod.rs"]
mod common;
#[path = "../../llama/tests/common/peft.rs"]
mod peft;

use common::suite::{tiny_gqa, UnderTest, T};
use engine::conformance;
use llama::{Dialect, GemmaBlock, Llama, LlamaConfig, LoraConfig};

/// The suite's tiny GQA shape with Gemma 2's pieces and tight caps.
pub fn cfg() -> LlamaConfig {
    let tiny = gemma2::GEMMA2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    const { assert!(3 < T, "the window is shorter than the suite's sequences") };
    let gemma = GemmaBlock { query_pre_attn_scalar: 24.0, attn_softcap: Some(1.0), final_softcap: Some(1.5) };
    LlamaConfig {
        sliding_window: Some(3),
        sliding_layers: tiny.sliding_layers.clone(),
        gemma: Some(gemma),
        tie_word_embeddings: true,
        rms_norm_eps: tiny.rms_norm_eps,
        rope_theta: tiny.rope_theta,
        ..tiny_gqa()
    }
}

#[test]
fn gemma2_passes_the_conformance_suite() {
    conformance::run_all(&UnderTest::new(cfg(), None)).unwrap_or_else(|e| panic!("{e}"));
}

/// The soft-capped loss over chunks of at most 7 rows: each chunk's
/// logits capped and its gradient taken through the cap.
#[test]
fn gemma2_with_a_chunked_loss_passes_the_conformance_suite() {
    let f = UnderTest { loss_chunk: Some(7), ..UnderTest::new(cfg(), None) };
    conformance::run_all(&f).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn gemma2_with_lora_on_a_frozen_base_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&UnderTest::new(cfg(), Some(lora))).unwrap_or_else(|e| panic!("{e}"));
}

/// Each of Gemma's pieces is seen: turning one off (the window of layer 0,
/// a cap, the scale) moves the last position's logits by O(1e-2) or more,
/// against rounding of ~1e-6; and the capped logits stay inside the cap.
#[test]
fn each_piece_changes_the_logits() {
    let ids: Vec<u32> = (0..T as u32).map(|i| i * 5 % 32).collect();
    let logits = |cfg: LlamaConfig| {
        let mut m = Llama::new(cfg).unwrap_or_else(|e| panic!("{e}"));
        let p: Vec<f32> = m.init_params(3).into_iter().map(|x| x * 4.0).collect();
        m.next_token_logits(&p, &ids).unwrap_or_else(|e| panic!("{e}"))
    };
    let base = logits(cfg());
    assert!(base.iter().all(|x| x.abs() <= 1.5), "logits past the final cap");
    let g = cfg().gemma.unwrap_or_else(|| panic!("gemma"));
    let variants = [
        ("no window", LlamaConfig { sliding_window: None, ..cfg() }),
        ("window on layer 1 too", LlamaConfig { sliding_layers: None, ..cfg() }),
        ("no attention cap", LlamaConfig { gemma: Some(GemmaBlock { attn_softcap: None, ..g }), ..cfg() }),
        ("no final cap", LlamaConfig { gemma: Some(GemmaBlock { final_softcap: None, ..g }), ..cfg() }),
        ("scale 1", LlamaConfig { gemma: Some(GemmaBlock { query_pre_attn_scalar: 1.0, ..g }), ..cfg() }),
    ];
    for (what, c) in variants {
        let other = logits(c);
        let gap = base.iter().zip(&other).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        println!("{what}: {gap:.2e}");
        assert!(gap > 1e-2, "{what}: the last logits move by only {gap}");
    }
}

/// DoRA on every projection, o_proj and down_proj included: their output
/// is normed before it joins the residual (the post norms), so DoRA scales
/// the projection's own output and the post norm reads it, as PEFT wraps
/// the module. The suite's checks but finite differences (DoRA's gradient
/// holds the row norms constant by design; llama's lora_variants.rs checks
/// that gradient), with and without recomputation.
#[test]
fn gemma2_with_dora_before_the_post_norms_passes_the_conformance_checks_but_finite_differences() {
    let dora = LoraConfig { use_dora: true, ..LoraConfig::new(2, 4.0, &["all-linear"]) };
    for ck in [engine::Checkpointing::None, engine::Checkpointing::Selective] {
        let f = UnderTest { checkpointing: ck, ..UnderTest::new(cfg(), Some(dora.clone())) };
        conformance::check_k_invariance(&f).unwrap_or_else(|e| panic!("{ck}: {e}"));
        conformance::check_several_steps(&f).unwrap_or_else(|e| panic!("{ck}: {e}"));
        conformance::check_frozen(&f).unwrap_or_else(|e| panic!("{ck}: {e}"));
    }
    let f = UnderTest::new(cfg(), Some(dora));
    conformance::check_ranks_and_zero(&f).unwrap_or_else(|e| panic!("{e}"));
    conformance::check_resume(&f).unwrap_or_else(|e| panic!("{e}"));
}

/// PEFT itself loads a DoRA adapter we save on this Gemma 2 (the base
/// saved by us as a `Gemma2ForCausalLM` folder, loaded by transformers
/// with eager attention) and computes our logits: DoRA on o_proj and
/// down_proj before the post norms (scripts/peft_variants_check.py; its
/// docstring explains the tolerance). Skipped, with a note, without
/// python3 with torch, transformers and peft (not under
/// `MACROBATCH_REQUIRE_PYTHON=1`, as in CI).
#[test]
fn peft_computes_our_dora_logits_before_the_post_norms() {
    use engine::rng::SplitMix64;
    use engine::Model;
    use family::Family;
    if !family::reference::python_with("torch, transformers, peft, safetensors").unwrap_or_else(|e| panic!("{e}")) {
        eprintln!("skipped: python3 with torch, transformers and peft is not available");
        return;
    }
    // The caps loosened (the test is about the adapters, not about tanh's flat ends).
    let gemma = GemmaBlock { query_pre_attn_scalar: 24.0, attn_softcap: Some(20.0), final_softcap: Some(30.0) };
    let cfg = LlamaConfig { gemma: Some(gemma), ..cfg() };
    let plain = Llama::new(cfg.clone()).unwrap_or_else(|e| panic!("{e}"));
    let mut base = plain.init_params(5);
    let mut rng = SplitMix64::new(8);
    base.iter_mut().for_each(|x| *x += (rng.normal() * 0.05) as f32);
    let dir = common::tmpdir("gemma2-dora-peft");
    let base_dir = dir.join("base");
    std::fs::create_dir_all(&base_dir).unwrap();
    let fam = llama::LlamaFamily::new(&gemma2::GEMMA2, cfg.clone(), None).unwrap_or_else(|e| panic!("{e}"));
    fam.save_hf(&base_dir, plain.layout(), &base).unwrap_or_else(|e| panic!("{e}"));
    let dora = LoraConfig { use_dora: true, ..LoraConfig::new(4, 8.0, &["all-linear"]) };
    let mut model = Llama::with_lora(cfg.clone(), dora, engine::Precision::F32).unwrap_or_else(|e| panic!("{e}"));
    let mut params = llama::lora::attach(&model, &base, 3).unwrap_or_else(|e| panic!("{e}"));
    peft::move_adapters(model.layout(), &mut params, &mut rng, (0.1, 0.1));
    let (b, t) = (2, T);
    let batch = peft::random_batch(&mut rng, (b, t), cfg.vocab_size);
    let base_logits = Llama::new(cfg.clone()).unwrap().logits(&base, &batch).unwrap();
    let logits = model.logits(&params, &batch).unwrap();
    let change = logits.iter().zip(&base_logits).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(change > 0.2, "a change of {change} could hide a wrong scale inside the tolerance");
    let adapter = dir.join("adapter");
    llama::lora::save_adapter(&adapter, &model, &params, None).unwrap_or_else(|e| panic!("{e}"));
    let shape = (b, t, cfg.vocab_size);
    peft::check_with_peft(&dir, &base_dir, shape, (&batch.inputs, &base_logits), &[(adapter, logits)]);
    std::fs::remove_dir_all(&dir).unwrap();
}
