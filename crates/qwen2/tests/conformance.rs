//! Qwen2 runs the engine's Model conformance suite (engine::conformance):
//! the Llama block with q/k/v biases, grouped-query attention, untied head
//! — finite differences (the biases' gradients included), K/W/ZeRO
//! invariance with an empty micro-batch, several steps, frozen tensors and
//! bit-exact resume — plain, and with LoRA adapters on a frozen base.

use engine::conformance::{self, ModelUnderTest, TokenSamples};
use engine::rng::SplitMix64;
use engine::{Model, TensorSpec};
use llama::{lora, Dialect, Llama, LlamaConfig, LoraConfig, TokenBatch};

const T: usize = 8;
const V: usize = 32;

/// Qwen2's tiny preset cut down: 2 layers, 4 query heads sharing 2
/// key/value heads, head width 4, untied head.
fn cfg() -> LlamaConfig {
    let tiny = qwen2::QWEN2.preset("tiny").unwrap_or_else(|e| panic!("{e}"));
    assert!(tiny.attention_bias, "Qwen2's block has q/k/v biases");
    LlamaConfig {
        vocab_size: V,
        hidden_size: 16,
        intermediate_size: 24,
        n_head: 4,
        n_kv_head: 2,
        head_dim: 4,
        max_position_embeddings: T,
        tie_word_embeddings: false,
        ..tiny
    }
}

struct Qwen2 {
    seqs: TokenSamples,
    lora: Option<LoraConfig>,
}

impl ModelUnderTest for Qwen2 {
    type M = Llama;

    fn model(&self) -> Llama {
        match &self.lora {
            Some(l) => Llama::with_lora(cfg(), l.clone(), engine::Precision::F32),
            None => Llama::new(cfg()),
        }
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The initialisation plus N(0, σ) noise, so the biases (initialised
    /// to zero), the RMSNorm gains and LoRA's B (zero) carry visible
    /// gradients; σ = 0.2 with LoRA, as for Llama (its scaled branch on a
    /// noisy base makes attention scores large enough that h = 3e-3 is too
    /// coarse a step at σ = 0.3).
    fn init(&self) -> Vec<f32> {
        let mut p = self.model().init_params(3);
        let mut rng = SplitMix64::new(15);
        let sigma = if self.lora.is_some() { 0.2 } else { 0.3 };
        p.iter_mut().for_each(|x| *x += (rng.normal() * sigma) as f32);
        p
    }

    fn batch(&self, samples: &[usize]) -> TokenBatch {
        self.seqs.batch(samples)
    }

    fn n_samples(&self) -> usize {
        self.seqs.len()
    }

    /// With LoRA: the base (biases included), as a LoRA run freezes it.
    /// Without: all but the last layer (its biases included).
    fn frozen(&self, t: &TensorSpec) -> bool {
        match self.lora {
            Some(_) => !lora::is_adapter(&t.name),
            None => !t.name.starts_with("model.layers.1."),
        }
    }

    /// As for Llama (same block, same data, same f32 forward): h = 3e-3
    /// leaves rounding of ~2e-3 in a central difference (atol) and
    /// truncation far below 1% of larger gradients (rtol).
    fn fd_tolerance(&self) -> (f64, f64, f64) {
        (3e-3, 1e-2, 2e-3)
    }

    /// Different summation orders agree to ~1e-7 of the largest gradient,
    /// ~1e-6 after AdamW steps: inside 1e-5.
    fn rtol(&self) -> f32 {
        1e-5
    }
}

#[test]
fn qwen2_passes_the_conformance_suite() {
    let f = Qwen2 { seqs: TokenSamples::new(12, T, V as u64, 9), lora: None };
    let model = f.model();
    let biases = model.layout().tensors().iter().filter(|t| t.name.ends_with("_proj.bias")).count();
    assert_eq!(biases, 3 * 2, "q, k and v biases in each of 2 layers");
    conformance::run_all(&f).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn qwen2_with_lora_on_a_frozen_base_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&Qwen2 { seqs: TokenSamples::new(12, T, V as u64, 9), lora: Some(lora) })
        .unwrap_or_else(|e| panic!("{e}"));
}
