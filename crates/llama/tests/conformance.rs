//! Llama runs the engine's Model conformance suite (engine::conformance)
//! with a tiny grouped-query configuration: untied head, tied head, and
//! LoRA on every projection with the base frozen, and q/k/v biases with
//! Llama 3 RoPE scaling (Qwen2's attention).

use engine::conformance::{self, ModelUnderTest, TokenSamples};
use engine::rng::SplitMix64;
use engine::{Model, TensorSpec};
use llama::{lora, Llama, LlamaConfig, LoraConfig, TokenBatch};

const T: usize = 8;
const V: usize = 32;

/// 2 layers, 4 query heads sharing 2 key/value heads (GQA), head width 4.
fn cfg(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: V,
        hidden_size: 16,
        intermediate_size: 24,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        head_dim: 4,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position_embeddings: T,
        tie_word_embeddings: tied,
        bos_token_id: None,
        eos_token_id: Vec::new(),
        attention_bias: false,
        rope_scaling: None,
    }
}

struct LlamaFamily {
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    /// 12 sequences; sequence i ignores its first i mod 5 targets, so
    /// samples hold different numbers of targets.
    seqs: TokenSamples,
    /// Activation checkpointing of the model under test.
    checkpointing: engine::Checkpointing,
}

impl LlamaFamily {
    fn new(tied: bool, lora: Option<LoraConfig>) -> Self {
        let seqs = TokenSamples::new(12, T, V as u64, 9);
        Self { cfg: cfg(tied), lora, seqs, checkpointing: engine::Checkpointing::None }
    }
}

impl ModelUnderTest for LlamaFamily {
    type M = Llama;

    fn model(&self) -> Llama {
        match &self.lora {
            Some(l) => Llama::with_lora(self.cfg.clone(), l.clone(), engine::Precision::F32),
            None => Llama::new(self.cfg.clone()),
        }
        .expect("valid config")
        .with_checkpointing(self.checkpointing)
    }

    /// The model's initialisation plus N(0, σ) noise, so that every path
    /// (RMSNorm gains, LoRA's B, which starts at zero) carries a visible
    /// gradient. σ = 0.3 for the base model; 0.2 with LoRA, whose scaled
    /// branch (α/r = 2) on top of the noisy base gave attention scores so
    /// large that the loss's third derivative along one lora_B element
    /// reached ~2e4: the central difference at h = 3e-3 was 8% off, and
    /// converged to the model's gradient as h shrank (error ∝ h²).
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

    /// With LoRA: the base model (everything but the adapters), as a LoRA
    /// run freezes it. Without: all but the last layer (the embedding, its
    /// head when tied, layer 0, the final norm and an untied head).
    fn frozen(&self, t: &TensorSpec) -> bool {
        match self.lora {
            Some(_) => !lora::is_adapter(&t.name),
            None => !t.name.starts_with("model.layers.1."),
        }
    }

    /// The forward runs in f32 over ~25 targets (loss sum ≈ 90): rounding
    /// makes a central difference with h = 3e-3 uncertain by about
    /// ε_f32 · 90 / h ≈ 4e-3 · 0.5 (errors partly cancel) — hence atol
    /// 2e-3, the floor for small gradients; truncation (h², smooth SiLU,
    /// RMSNorm and softmax) stays far below 1% of larger gradients — hence
    /// rtol 1e-2. (The kernel tests check every element of each backward.)
    fn fd_tolerance(&self) -> (f64, f64, f64) {
        (3e-3, 1e-2, 2e-3)
    }

    /// Summation orders differ (micro-batch splits, rank order, shards):
    /// gradients agree to ~1e-7 of their largest value; parameters after
    /// AdamW steps to ~1e-6, well inside 1e-5 of the largest value.
    fn rtol(&self) -> f32 {
        1e-5
    }
}

#[test]
fn untied_llama_passes_the_conformance_suite() {
    conformance::run_all(&LlamaFamily::new(false, None)).unwrap();
}

#[test]
fn tied_llama_passes_the_conformance_suite() {
    conformance::run_all(&LlamaFamily::new(true, None)).unwrap();
}

#[test]
fn lora_llama_with_a_frozen_base_passes_the_conformance_suite() {
    let lora = LoraConfig::new(2, 4.0, &["all-linear"]);
    conformance::run_all(&LlamaFamily::new(false, Some(lora))).unwrap();
}

/// q/k/v biases (their gradients through the store like every tensor's;
/// the layer-1 biases are trainable, layer 0's frozen) and Llama 3 RoPE
/// scaling whose original context (4 positions, wavelengths 4..16 between
/// high and low) puts frequencies in all three bands; also under LoRA
/// (which targets the weights, not the biases) and checkpointing.
#[test]
fn biased_llama_with_llama3_rope_passes_the_conformance_suite() {
    let biased = |lora: Option<LoraConfig>| {
        let mut f = LlamaFamily::new(false, lora);
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
/// layer again for its recomputation; frozen LoRA bases are recomputed too).
#[test]
fn llama_with_activation_checkpointing_passes_the_conformance_suite() {
    for ck in [engine::Checkpointing::Blocks, engine::Checkpointing::EveryK(2)] {
        let mut f = LlamaFamily::new(true, None);
        f.checkpointing = ck;
        conformance::run_all(&f).unwrap();
    }
    let mut f = LlamaFamily::new(false, Some(LoraConfig::new(2, 4.0, &["all-linear"])));
    f.checkpointing = engine::Checkpointing::Blocks;
    conformance::run_all(&f).unwrap();
}
