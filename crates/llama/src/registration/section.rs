//! The `[model]` section of a family on the Llama block: single
//! dimensions and options over a preset's, read into a [`LlamaConfig`]
//! and pinned back from one (a run folder rebuilds its model from it).

use super::{Dialect, LlamaFamily};
use crate::{LlamaConfig, LoraConfig};
use config::ModelConfig;
use family::Result;
use serde::{Deserialize, Serialize};

/// The `[model]` keys of a family on the Llama block: single dimensions
/// over the preset's.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Section {
    n_layer: Option<usize>,
    n_head: Option<usize>,
    n_embd: Option<usize>,
    block_size: Option<usize>,
    vocab_size: Option<usize>,
    n_kv_head: Option<usize>,
    intermediate_size: Option<usize>,
    rope_theta: Option<f64>,
    tie_word_embeddings: Option<bool>,
    rms_norm_eps: Option<f64>,
    /// Width of one head (default: n_embd / n_head, or the preset's own
    /// when neither is overridden and the preset sets another).
    head_dim: Option<usize>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<Vec<u32>>,
    /// Llama 3's RoPE scaling (an inline table: factor, low_freq_factor,
    /// high_freq_factor, original_max_position_embeddings).
    rope_scaling: Option<crate::config::RopeScaling>,
    /// Sliding-window attention over the latest `w` keys; 0: none.
    sliding_window: Option<usize>,
    /// Which layers the window applies to, as transformers'
    /// `layer_types` (`"sliding_attention"` / `"full_attention"`);
    /// default: the preset's pattern repeated over the layers.
    layer_types: Option<Vec<String>>,
    /// Gemma 2's score scale `query_pre_attn_scalar^-½`.
    query_pre_attn_scalar: Option<f64>,
    /// Gemma 2's attention soft cap; 0: none.
    attn_logit_softcapping: Option<f64>,
    /// Gemma 2's logit soft cap; 0: none.
    final_logit_softcapping: Option<f64>,
    /// A mixture of experts' experts E (MoE families only).
    n_experts: Option<usize>,
    /// Experts per token k.
    num_experts_per_tok: Option<usize>,
    /// Each expert's hidden width.
    moe_intermediate_size: Option<usize>,
    /// The shared expert's width; 0: none (Qwen2-MoE's).
    shared_expert_intermediate_size: Option<usize>,
    /// Whether the k chosen probabilities are renormalised.
    norm_topk_prob: Option<bool>,
    /// α of the load-balancing loss; 0: none.
    router_aux_loss_coef: Option<f64>,
    /// The router z-loss's factor; 0: none.
    router_z_loss_coef: Option<f64>,
    /// `"global_batch"` (default) or `"micro_batch"`.
    load_balancing: Option<crate::LoadBalancing>,
}

const KEYS: &[&str] = &[
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "vocab_size",
    "n_kv_head",
    "intermediate_size",
    "rope_theta",
    "tie_word_embeddings",
    "rms_norm_eps",
    "head_dim",
    "bos_token_id",
    "eos_token_id",
    "rope_scaling",
    "sliding_window",
    "layer_types",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "n_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "router_aux_loss_coef",
    "router_z_loss_coef",
    "load_balancing",
];

impl Section {
    /// `c` as a section: every dimension, and the options that differ
    /// from Llama's (a window: 0 where the preset, `preset_window`, has
    /// one and `c` has none).
    pub(super) fn pinned(c: &LlamaConfig, preset_window: Option<usize>) -> Self {
        Section {
            n_layer: Some(c.n_layer),
            n_head: Some(c.n_head),
            n_embd: Some(c.hidden_size),
            block_size: Some(c.max_position_embeddings),
            vocab_size: Some(c.vocab_size),
            n_kv_head: Some(c.n_kv_head),
            intermediate_size: Some(c.intermediate_size),
            rope_theta: Some(c.rope_theta),
            tie_word_embeddings: Some(c.tie_word_embeddings),
            rms_norm_eps: Some(c.rms_norm_eps),
            // Pinned only where it is not n_embd / n_head (which it defaults to).
            head_dim: (c.head_dim * c.n_head != c.hidden_size).then_some(c.head_dim),
            bos_token_id: c.bos_token_id,
            eos_token_id: Some(c.eos_token_id.clone()),
            rope_scaling: c.rope_scaling,
            // 0 (none) pinned only where the preset has a window.
            sliding_window: match (c.sliding_window, preset_window) {
                (Some(w), _) => Some(w),
                (None, Some(_)) => Some(0),
                (None, None) => None,
            },
            layer_types: c.sliding_layers.as_ref().map(|l| {
                l.iter().map(|&w| if w { "sliding_attention" } else { "full_attention" }.to_string()).collect()
            }),
            query_pre_attn_scalar: c.gemma.map(|g| g.query_pre_attn_scalar),
            // 0 (none) pinned where the cap is off.
            attn_logit_softcapping: c.gemma.map(|g| g.attn_softcap.unwrap_or(0.0)),
            final_logit_softcapping: c.gemma.map(|g| g.final_softcap.unwrap_or(0.0)),
            n_experts: c.moe.as_ref().map(|m| m.n_experts),
            num_experts_per_tok: c.moe.as_ref().map(|m| m.top_k),
            moe_intermediate_size: c.moe.as_ref().map(|m| m.expert_size),
            shared_expert_intermediate_size: c.moe.as_ref().map(|m| m.shared_expert_size.unwrap_or(0)),
            norm_topk_prob: c.moe.as_ref().map(|m| m.norm_topk_prob),
            router_aux_loss_coef: c.moe.as_ref().map(|m| m.router_aux_loss_coef),
            router_z_loss_coef: c.moe.as_ref().map(|m| m.router_z_loss_coef),
            load_balancing: c.moe.as_ref().map(|m| m.load_balancing),
        }
    }
}

impl LlamaFamily {
    /// The preset with single dimensions overridden.
    pub(super) fn from_config(
        dialect: &'static dyn Dialect,
        m: &ModelConfig,
        lora: Option<LoraConfig>,
    ) -> Result<Self> {
        let base = dialect.preset(m.base_preset()).map_err(|e| format!("model.preset: {e}"))?;
        let s: Section = family::parse_section(dialect.family(), KEYS, &m.shape)?;
        let hidden = s.n_embd.unwrap_or(base.hidden_size);
        let n_head = s.n_head.unwrap_or(base.n_head);
        let n_layer = s.n_layer.unwrap_or(base.n_layer);
        let sliding_layers = match &s.layer_types {
            Some(types) => {
                let json = serde_json::json!({ "layer_types": types });
                crate::dialect::read_layer_types(&json, n_layer).map_err(|e| format!("model.{e}"))?
            }
            // The preset's pattern of windowed layers (Gemma 2's: every
            // other one) repeated over the layers asked for.
            None => base
                .sliding_layers
                .as_ref()
                .filter(|l| !l.is_empty())
                .map(|l| (0..n_layer).map(|i| l[i % l.len()]).collect()),
        };
        let gemma = match base.gemma {
            Some(g) => Some(crate::GemmaBlock {
                query_pre_attn_scalar: s.query_pre_attn_scalar.unwrap_or(g.query_pre_attn_scalar),
                attn_softcap: s.attn_logit_softcapping.map_or(g.attn_softcap, |c| (c > 0.0).then_some(c)),
                final_softcap: s.final_logit_softcapping.map_or(g.final_softcap, |c| (c > 0.0).then_some(c)),
            }),
            None => {
                let keys = [
                    ("query_pre_attn_scalar", s.query_pre_attn_scalar),
                    ("attn_logit_softcapping", s.attn_logit_softcapping),
                    ("final_logit_softcapping", s.final_logit_softcapping),
                ];
                if let Some((key, _)) = keys.iter().find(|(_, v)| v.is_some()) {
                    return Err(format!(
                        "model.{key} is Gemma 2's; the {} family has no such setting (use model.family = \"gemma2\")",
                        dialect.family()
                    )
                    .into());
                }
                None
            }
        };
        let moe = match base.moe.clone() {
            Some(m) => Some(crate::MoeBlock {
                n_experts: s.n_experts.unwrap_or(m.n_experts),
                top_k: s.num_experts_per_tok.unwrap_or(m.top_k),
                expert_size: s.moe_intermediate_size.unwrap_or(m.expert_size),
                shared_expert_size: s
                    .shared_expert_intermediate_size
                    .map_or(m.shared_expert_size, |w| (w > 0).then_some(w)),
                norm_topk_prob: s.norm_topk_prob.unwrap_or(m.norm_topk_prob),
                router_aux_loss_coef: s.router_aux_loss_coef.unwrap_or(m.router_aux_loss_coef),
                router_z_loss_coef: s.router_z_loss_coef.unwrap_or(m.router_z_loss_coef),
                load_balancing: s.load_balancing.unwrap_or(m.load_balancing),
                names: m.names,
            }),
            None => {
                let keys = [
                    ("n_experts", s.n_experts.is_some()),
                    ("num_experts_per_tok", s.num_experts_per_tok.is_some()),
                    ("moe_intermediate_size", s.moe_intermediate_size.is_some()),
                    ("shared_expert_intermediate_size", s.shared_expert_intermediate_size.is_some()),
                    ("norm_topk_prob", s.norm_topk_prob.is_some()),
                    ("router_aux_loss_coef", s.router_aux_loss_coef.is_some()),
                    ("router_z_loss_coef", s.router_z_loss_coef.is_some()),
                    ("load_balancing", s.load_balancing.is_some()),
                ];
                if let Some((key, _)) = keys.iter().find(|(_, set)| *set) {
                    return Err(format!(
                        "model.{key} sets a mixture of experts; the {} family has none (use model.family = \"mixtral\", \"qwen2_moe\" or \"qwen3_moe\")",
                        dialect.family()
                    )
                    .into());
                }
                None
            }
        };
        let cfg = LlamaConfig {
            moe,
            vocab_size: s.vocab_size.unwrap_or(base.vocab_size),
            hidden_size: hidden,
            intermediate_size: s.intermediate_size.unwrap_or(base.intermediate_size),
            n_layer,
            n_head,
            n_kv_head: s.n_kv_head.unwrap_or(base.n_kv_head),
            head_dim: s.head_dim.unwrap_or(match (s.n_embd, s.n_head) {
                (None, None) => base.head_dim,
                _ => hidden.checked_div(n_head).unwrap_or(0),
            }),
            rms_norm_eps: s.rms_norm_eps.unwrap_or(base.rms_norm_eps),
            rope_theta: s.rope_theta.unwrap_or(base.rope_theta),
            max_position_embeddings: s.block_size.unwrap_or(base.max_position_embeddings),
            tie_word_embeddings: s.tie_word_embeddings.unwrap_or(base.tie_word_embeddings),
            bos_token_id: s.bos_token_id.or(base.bos_token_id),
            eos_token_id: s.eos_token_id.unwrap_or(base.eos_token_id),
            rope_scaling: s.rope_scaling.or(base.rope_scaling),
            sliding_window: s.sliding_window.map_or(base.sliding_window, |w| (w > 0).then_some(w)),
            sliding_layers,
            gemma,
            ..base
        };
        cfg.validate()?;
        Self::new(dialect, cfg, lora)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registration::{parse_lora, LLAMA};
    use family::Family;

    #[test]
    fn lora_section_parses_with_peft_s_alpha_and_names_bad_keys() {
        let t: toml::Table = toml::from_str("r = 4\ntarget_modules = [\"q_proj\"]").unwrap_or_default();
        assert_eq!(parse_lora(&t).map(|l| l.alpha).ok(), Some(8.0), "PEFT's lora_alpha default");
        let t: toml::Table = toml::from_str("r = 4\nrank = 2\ntarget_modules = [\"q_proj\"]").unwrap_or_default();
        let e = parse_lora(&t).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[lora]") && e.contains("rank"), "{e}");
    }

    #[test]
    fn shape_round_trips_through_the_model_section() {
        let mut m = ModelConfig { family: "llama".into(), preset: Some("tiny".into()), ..ModelConfig::default() };
        m.shape.insert("n_layer".into(), toml::Value::Integer(3));
        m.shape.insert("rope_theta".into(), toml::Value::Integer(500000));
        let scaling: toml::Table = toml::from_str(
            "factor = 8\nlow_freq_factor = 1\nhigh_freq_factor = 4\noriginal_max_position_embeddings = 64",
        )
        .unwrap_or_default();
        m.shape.insert("rope_scaling".into(), toml::Value::Table(scaling));
        let f = LlamaFamily::from_config(&LLAMA, &m, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((f.cfg.n_layer, f.cfg.rope_theta), (3, 500000.0));
        assert_eq!(f.cfg.rope_scaling.map(|s| (s.factor, s.original_max_position_embeddings)), Some((8.0, 64)));
        // (Pinned onto the same preset: a preset's bos_token_id shows through
        // a pinned shape without one, as `[model]` cannot write "none".)
        let mut pinned = ModelConfig { preset: Some("tiny".into()), ..ModelConfig::default() };
        f.pin_shape(&mut pinned);
        assert_eq!(pinned.family, "llama");
        let g = LlamaFamily::from_config(&LLAMA, &pinned, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.hf_config(), g.hf_config());
    }

    #[test]
    fn per_layer_windows_pin_and_gemma_keys_are_gemma_s_alone() {
        let mut m = ModelConfig { family: "llama".into(), preset: Some("tiny".into()), ..ModelConfig::default() };
        let set = |m: &mut ModelConfig, k: &str, v: toml::Value| m.shape.insert(k.into(), v);
        set(&mut m, "n_layer", toml::Value::Integer(2));
        set(&mut m, "sliding_window", toml::Value::Integer(4));
        let types = |t: &[&str]| toml::Value::Array(t.iter().map(|s| toml::Value::String(s.to_string())).collect());
        set(&mut m, "layer_types", types(&["full_attention", "sliding_attention"]));
        let f = LlamaFamily::from_config(&LLAMA, &m, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((f.cfg.window_of(0), f.cfg.window_of(1)), (None, Some(4)));
        let mut pinned = ModelConfig::default();
        f.pin_shape(&mut pinned);
        let g = LlamaFamily::from_config(&LLAMA, &pinned, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.cfg, g.cfg);
        let err = |m: &ModelConfig| LlamaFamily::from_config(&LLAMA, m, None).err().map(|e| e.to_string());
        set(&mut m, "layer_types", types(&["full_attention"]));
        assert!(err(&m).is_some_and(|e| e.contains("layer_types") && e.contains("2 layers")), "{:?}", err(&m));
        m.shape.remove("layer_types");
        set(&mut m, "attn_logit_softcapping", toml::Value::Float(50.0));
        assert!(err(&m).is_some_and(|e| e.contains("attn_logit_softcapping") && e.contains("gemma2")), "{:?}", err(&m));
    }
}
