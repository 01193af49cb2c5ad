//! Gemma 2's options of the block ([`GemmaBlock`]) and what the kernels
//! take from them.

use super::LlamaConfig;
use crate::error::LlamaError;
use serde::{Deserialize, Serialize};

/// Gemma 2's departures from the Llama block (transformers'
/// `Gemma2DecoderLayer` and `Gemma2ForCausalLM`): a GeGLU MLP
/// (`gelu_pytorch_tanh` gate), RMSNorm gains applied as `1 + w`, a norm
/// after attention and after the MLP besides the two before them
/// (`pre_feedforward_layernorm` is Llama's `post_attention_layernorm`),
/// the embedding times `√hidden_size`, attention scores scaled by
/// `query_pre_attn_scalar^-½` and soft-capped, and the logits soft-capped.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GemmaBlock {
    /// `query_pre_attn_scalar`: the scores are `q·k / √query_pre_attn_scalar`.
    pub query_pre_attn_scalar: f64,
    /// `attn_logit_softcapping`: scores become `c · tanh(s / c)`; `None`: not capped.
    pub attn_softcap: Option<f64>,
    /// `final_logit_softcapping`: logits become `c · tanh(z / c)`; `None`: not capped.
    pub final_softcap: Option<f64>,
}

impl GemmaBlock {
    /// Checks the scale and the caps.
    pub(super) fn validate(&self) -> Result<(), LlamaError> {
        let g = self;
        let ok = |x: f64| x.is_finite() && x > 0.0;
        let caps = [("attn_logit_softcapping", g.attn_softcap), ("final_logit_softcapping", g.final_softcap)];
        for (key, cap) in caps {
            if cap.is_some_and(|c| !ok(c)) {
                return Err(LlamaError::config(key, format!("must be positive or null, got {cap:?}")));
            }
        }
        if !ok(g.query_pre_attn_scalar) {
            return Err(LlamaError::config(
                "query_pre_attn_scalar",
                format!("must be positive, got {}", g.query_pre_attn_scalar),
            ));
        }
        Ok(())
    }
}

impl LlamaConfig {
    /// How the attention scores keys: Gemma 2's scale and cap, else `q·k/√d`.
    pub fn scores(&self) -> nn::flash::Scores {
        match &self.gemma {
            None => nn::flash::Scores::default(),
            Some(g) => nn::flash::Scores {
                scale: Some((1.0 / g.query_pre_attn_scalar.sqrt()) as f32),
                softcap: g.attn_softcap.map(|c| c as f32),
            },
        }
    }

    /// What the embedding's rows are multiplied by: Gemma's `√hidden_size`
    /// (transformers' `hidden_size**0.5` in f64, then as an f32 tensor).
    pub fn embed_scale(&self) -> Option<f32> {
        self.gemma.map(|_| (self.hidden_size as f64).sqrt() as f32)
    }

    /// A norm's gains as the kernels take them: `w`, or Gemma's `1 + w`
    /// (transformers' `output * (1.0 + weight)`: the gradient with respect
    /// to `1 + w` is the one with respect to `w`).
    pub fn gains<'p>(&self, w: &'p [f32]) -> std::borrow::Cow<'p, [f32]> {
        match self.gemma {
            None => std::borrow::Cow::Borrowed(w),
            Some(_) => std::borrow::Cow::Owned(w.iter().map(|x| 1.0 + x).collect()),
        }
    }

    /// The MLP's gate activation: GeGLU for Gemma, SwiGLU otherwise.
    pub fn glu(&self) -> nn::act::Glu {
        if self.gemma.is_some() {
            nn::act::Glu::GeluTanh
        } else {
            nn::act::Glu::Silu
        }
    }
}
