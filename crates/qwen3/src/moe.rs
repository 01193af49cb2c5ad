//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head
//! q/k norms, heads of 128) with a mixture of SwiGLU experts in every
//! layer (`mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`), the top 8 of
//! 128 per token, renormalised (`norm_topk_prob`), no shared expert.
//! `model_type: "qwen3_moe"`, `Qwen3MoeForCausalLM`; registered as [`MOE_FAMILY`].

use family::Result;
use llama::dialect::{read_as_llama, written_as, QwenWindows};
use llama::{Dialect, LlamaConfig, LoadBalancing, MoeBlock, MoeNames, Names, Registered};
use serde_json::Value;

/// Qwen3-MoE's `config.json` dialect and presets.
#[derive(Debug)]
pub struct Qwen3MoeDialect;

/// The dialect.
pub static QWEN3_MOE: Qwen3MoeDialect = Qwen3MoeDialect;

/// Qwen3-MoE's registration: `model.family = "qwen3_moe"`.
pub static MOE_FAMILY: Registered = Registered(&QWEN3_MOE);

/// The presets: `tiny` for tests and the released shapes for planning.
pub const MOE_PRESETS: &[&str] = &["tiny", "qwen3-30b-a3b", "qwen3-235b-a22b"];

impl Dialect for Qwen3MoeDialect {
    fn names(&self) -> Names {
        Names { family: "qwen3_moe", name: "Qwen3-MoE", presets: MOE_PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        // (vocab, hidden, dense F, layers, heads, kv heads, head width, experts, k,
        // expert F, context), from the released config.json files
        // (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): θ = 10⁶, untied,
        // norm_topk_prob true, router_aux_loss_coef 0.001.
        let (vocab_size, hidden_size, intermediate_size, n_layer, n_head, n_kv_head, head_dim, e, k, f, ctx) =
            match name {
                "tiny" => (256, 64, 96, 2, 4, 2, 32, 4, 2, 32, 256),
                "qwen3-30b-a3b" => (151936, 2048, 6144, 48, 32, 4, 128, 128, 8, 768, 40960),
                "qwen3-235b-a22b" => (151936, 4096, 12288, 94, 64, 4, 128, 128, 8, 1536, 40960),
                other => {
                    return Err(format!(
                        "`{other}` is not a qwen3_moe preset; choose one of {}",
                        MOE_PRESETS.join(", ")
                    )
                    .into())
                }
            };
        let (bos, eos) = if name == "tiny" { (None, Vec::new()) } else { (Some(151643), vec![151645]) };
        let moe = MoeBlock {
            n_experts: e,
            top_k: k,
            expert_size: f,
            norm_topk_prob: true,
            shared_expert_size: None,
            names: MoeNames::Qwen,
            router_aux_loss_coef: 0.001,
            router_z_loss_coef: 0.0,
            load_balancing: LoadBalancing::GlobalBatch,
        };
        let cfg = LlamaConfig {
            head_dim,
            vocab_size,
            hidden_size,
            intermediate_size,
            n_layer,
            n_head,
            n_kv_head,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            max_position_embeddings: ctx,
            tie_word_embeddings: false,
            bos_token_id: bos,
            eos_token_id: eos,
            qk_norm: true,
            moe: Some(moe),
            ..LlamaConfig::preset("tiny")?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads transformers' `Qwen3MoeConfig`: Qwen3's keys and the
    /// mixture's; `attention_bias` (o_proj's too), a shared expert and
    /// dense layers among the mixtures refused.
    fn parse_hf_json(&self, v: &Value) -> Result<LlamaConfig> {
        let what = "Qwen3-MoE config.json (read as the Llama block with per-head q/k norms and a mixture of experts)";
        let own: Vec<&str> = MoeBlock::HF_KEYS.iter().chain(&QwenWindows::KEYS).copied().collect();
        let base = LlamaConfig { qk_norm: true, ..read_as_llama(v, "qwen3_moe", &own, what)? };
        let moe =
            MoeBlock::from_hf_json(v, MoeNames::Qwen, base.intermediate_size).map_err(|e| format!("{what}: {e}"))?;
        if moe.shared_expert_size.is_some() {
            return Err(format!(
                "{what}: shared_expert_intermediate_size is Qwen2-MoE's; Qwen3-MoE has no shared expert"
            )
            .into());
        }
        let (sliding_window, sliding_layers) = QwenWindows::read(v, base.n_layer)?;
        let cfg = LlamaConfig { sliding_window, sliding_layers, moe: Some(moe), ..base };
        cfg.validate()?;
        Ok(cfg)
    }

    /// transformers' `Qwen3MoeConfig` for `Qwen3MoeForCausalLM`.
    fn hf_json(&self, cfg: &LlamaConfig) -> Value {
        let mut own = QwenWindows::written(cfg);
        own.extend(cfg.moe.as_ref().map(MoeBlock::hf_keys).unwrap_or_default());
        written_as(cfg, ("Qwen3MoeForCausalLM", "qwen3_moe"), &["mlp_bias", "pretraining_tp"], own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_released_parameter_counts() {
        // transformers 5.25, `Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))` on
        // the meta device, sum(p.numel()): 30,532,122,624 and 235,093,634,560
        // (the model cards' 30.5B and 235B).
        for (name, want) in [("qwen3-30b-a3b", 30_532_122_624u64), ("qwen3-235b-a22b", 235_093_634_560)] {
            let cfg = QWEN3_MOE.preset(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.param_count(), want as u128, "{name}");
        }
    }

    #[test]
    fn config_json_round_trips() {
        for name in MOE_PRESETS {
            let cfg = QWEN3_MOE.preset(name).unwrap_or_else(|e| panic!("{e}"));
            let json = QWEN3_MOE.hf_json(&cfg);
            assert_eq!(
                (json["model_type"].as_str(), json["num_experts"].as_u64()),
                (Some("qwen3_moe"), cfg.moe.as_ref().map(|m| m.n_experts as u64))
            );
            assert_eq!(QWEN3_MOE.parse_hf_json(&json).unwrap_or_else(|e| panic!("{e}")), cfg, "{name}");
        }
    }
}
