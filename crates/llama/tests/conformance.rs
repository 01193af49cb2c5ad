//! Llama runs the engine's Model conformance suite (engine::conformance)
//! with a tiny grouped-query configuration: untied head, tied head, and
//! LoRA on every projection with the base frozen, and q/k/v biases with
//! Llama 3 RoPE scaling (Qwen2's attention).

mod common;

use common::suite;
use engine::conformance::{self, ModelUnderTest};
use engine::Model;
use llama::{LlamaConfig, LoraConfig};

/// The tiny GQA Llama (2 layers, 4 query heads sharing 2 key/value heads,
/// head width 4), tied or not, optionally with LoRA.
fn under_test(tied: bool, lora: Option<LoraConfig>) -> suite::UnderTest {
    suite::UnderTest::new(LlamaConfig { tie_word_embeddings: tied, ..suite::tiny_gqa() }, lora)
}

#[test]
fn untied_llama_passes_the_conformance_suite() {
    conformance::run_all(&under_test(false, None)).unwrap();
}

#[test]
fn tied_llama_passes_the_conformance_suite() {
    conformance::run_all(&under_test(true, None)).unwrap();
}

/// The loss over chunks of at most 5 rows (the suite's batches hold 0 to
/// 96 rows: one chunk, several, a last one shorter), its head untied and
/// tied (whose gradient the embedding's then adds to), with and without
/// LoRA (a frozen head): the head's gradient sums the chunks' shares, in
/// another order than one GEMM over all rows, which the suite's rtol
/// covers as it covers micro-batch splits.
#[test]
fn llama_with_a_chunked_loss_passes_the_conformance_suite() {
    for (tied, lora) in [(false, None), (true, None), (true, Some(LoraConfig::new(2, 4.0, &["all-linear"])))] {
        let f = suite::UnderTest { loss_chunk: Some(5), ..under_test(tied, lora) };
        conformance::run_all(&f).unwrap_or_else(|e| panic!("tied {tied}: {e}"));
    }
}

#[test]
fn lora_llama_with_a_frozen_base_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&under_test(false, Some(lora))).unwrap();
}

/// q/k/v biases (their gradients through the store like every tensor's;
/// the layer-1 biases are trainable, layer 0's frozen) and Llama 3 RoPE
/// scaling whose original context (4 positions, wavelengths 4..16 between
/// high and low) puts frequencies in all three bands; also under LoRA
/// (which targets the weights, not the biases) and checkpointing.
#[test]
fn biased_llama_with_llama3_rope_passes_the_conformance_suite() {
    let biased = |lora: Option<LoraConfig>| {
        let mut f = under_test(false, lora);
        f.cfg.attention_bias = true;
        f.cfg.rope_scaling = Some(llama::RopeScaling {
            factor: 4.0,
            low_freq_factor: 0.5,
            high_freq_factor: 2.0,
            original_max_position_embeddings: 4,
        });
        f
    };
    let model = biased(None).model();
    let names: Vec<&str> = model.layout().tensors().iter().map(|t| t.name.as_str()).collect();
    for p in ["q_proj", "k_proj", "v_proj"] {
        assert!(names.contains(&format!("model.layers.1.self_attn.{p}.bias").as_str()), "{p} bias");
    }
    assert!(!names.iter().any(|n| n.contains("o_proj.bias")));
    conformance::run_all(&biased(None)).unwrap();
    conformance::run_all(&biased(Some(LoraConfig::new(2, 4.0, &["all-linear"])))).unwrap();
    let mut f = biased(None);
    f.checkpointing = engine::Checkpointing::Blocks;
    conformance::run_all(&f).unwrap();
}

/// Recomputing layers in backward keeps every property (ZeRO-3 gathers a
/// layer again for its recomputation; frozen LoRA bases are recomputed
/// too), and so does selective recomputation.
#[test]
fn llama_with_activation_checkpointing_passes_the_conformance_suite() {
    for ck in [engine::Checkpointing::Blocks, engine::Checkpointing::EveryK(2), engine::Checkpointing::Selective] {
        let mut f = under_test(true, None);
        f.checkpointing = ck;
        conformance::run_all(&f).unwrap();
    }
    let mut f = under_test(false, Some(LoraConfig::new(2, 4.0, &["all-linear"])));
    f.checkpointing = engine::Checkpointing::Blocks;
    conformance::run_all(&f).unwrap();
}

/// Documents packed into one row with their positions (RoPE angles restart
/// with each document; attention never crosses into the previous one)
/// give the loss and gradient of the same documents one per row — grouped
/// query heads, LoRA on a frozen base, checkpointing. 1e-5: as for GPT-2,
/// the same f32 sums grouped differently (~1e-7); a document seeing its
/// neighbour moves the loss by percents.
#[test]
fn llama_packed_documents_are_kept_apart() {
    for (lora, ck) in [
        (None, engine::Checkpointing::None),
        (Some(LoraConfig::new(2, 4.0, &["all-linear"])), engine::Checkpointing::Blocks),
        (None, engine::Checkpointing::Attention),
    ] {
        let mut f = under_test(false, lora);
        f.cfg.max_position_embeddings = 128;
        f.checkpointing = ck;
        let (mut model, params) = (f.model(), f.init());
        conformance::check_packed_documents(&mut model, &params, (&[40, 70, 18], 32), 1e-5).unwrap();
    }
}
