//! The engine's conformance suite for a model on the Llama block: the
//! harness shared by Llama's and Qwen2's conformance tests.

use engine::conformance::{ModelUnderTest, TokenSamples};
use engine::rng::SplitMix64;
use engine::TensorSpec;
use llama::{lora, Llama, LlamaConfig, LoraConfig, TokenBatch};

/// Positions per sequence.
pub const T: usize = 8;
/// Vocabulary size.
pub const V: usize = 32;

/// 2 layers, 4 query heads sharing 2 key/value heads (GQA), head width 4,
/// untied head.
pub fn tiny_gqa() -> LlamaConfig {
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
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_id: Vec::new(),
        attention_bias: false,
        rope_scaling: None,
        qk_norm: false,
        sliding_window: None,
        sliding_layers: None,
        gemma: None,
        fused_modules: false,
        moe: None,
    }
}

/// A model on the Llama block (any config, optionally LoRA) under the suite.
pub struct UnderTest {
    /// The shape.
    pub cfg: LlamaConfig,
    /// Adapters on a frozen base.
    pub lora: Option<LoraConfig>,
    /// 12 sequences; sequence i ignores its first i mod 5 targets, so
    /// samples hold different numbers of targets.
    pub seqs: TokenSamples,
    /// Activation checkpointing of the model under test.
    pub checkpointing: engine::Checkpointing,
    /// The most rows of logits the loss holds at once (`None`: the
    /// default, which at the suite's sizes is every row).
    pub loss_chunk: Option<usize>,
}

impl UnderTest {
    /// `cfg` (with `lora`) on 12 sequences of `T` tokens below `V`.
    pub fn new(cfg: LlamaConfig, lora: Option<LoraConfig>) -> Self {
        let seqs = TokenSamples::new(12, T, V as u64, 9);
        Self { cfg, lora, seqs, checkpointing: engine::Checkpointing::None, loss_chunk: None }
    }
}

impl ModelUnderTest for UnderTest {
    type M = Llama;

    fn model(&self) -> Llama {
        match &self.lora {
            Some(l) => Llama::with_lora(self.cfg.clone(), l.clone(), engine::Precision::F32),
            None => Llama::new(self.cfg.clone()),
        }
        .expect("valid config")
        .with_checkpointing(self.checkpointing)
        .with_loss_chunk(self.loss_chunk)
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

    /// A mixture's top-k routing jumps where two experts' probabilities
    /// cross: measured, a step of 3e-3 in one embedding value moved a row
    /// across such a boundary (the central difference −8.5 against the
    /// model's −1.417, which steps of 1e-3 to 1e-4 reproduce to 1e-3).
    fn fd_piecewise(&self) -> bool {
        self.cfg.moe.is_some()
    }

    /// Summation orders differ (micro-batch splits, rank order, shards):
    /// gradients agree to ~1e-7 of their largest value; parameters after
    /// AdamW steps to ~1e-6, well inside 1e-5 of the largest value.
    fn rtol(&self) -> f32 {
        1e-5
    }
}
