//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v
//! biases) with a mixture of SwiGLU experts in every layer (`mlp.gate`
//! `[E, C]`, `mlp.experts.{e}.{gate,up,down}_proj`), the top k of them per
//! token (their probabilities renormalised only with `norm_topk_prob`),
//! plus a shared expert every token passes through, scaled by
//! `sigmoid(mlp.shared_expert_gate · x)`. `model_type: "qwen2_moe"`,
//! `Qwen2MoeForCausalLM`; registered as [`MOE_FAMILY`].

use family::Result;
use llama::dialect::{read_as_llama, written_as, QwenWindows};
use llama::{Dialect, LlamaConfig, LoadBalancing, MoeBlock, MoeNames, Names, Registered};
use serde_json::Value;

/// Qwen2-MoE's `config.json` dialect and presets.
#[derive(Debug)]
pub struct Qwen2MoeDialect;

/// The dialect.
pub static QWEN2_MOE: Qwen2MoeDialect = Qwen2MoeDialect;

/// Qwen2-MoE's registration: `model.family = "qwen2_moe"`.
pub static MOE_FAMILY: Registered = Registered(&QWEN2_MOE);

/// The presets: `tiny` for tests and the released shapes for planning.
pub const MOE_PRESETS: &[&str] = &["tiny", "qwen1.5-moe-a2.7b", "qwen2-57b-a14b"];

impl Dialect for Qwen2MoeDialect {
    fn names(&self) -> Names {
        Names { family: "qwen2_moe", name: "Qwen2-MoE", presets: MOE_PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        // (vocab, hidden, dense F, layers, heads, kv heads, experts, k, expert F,
        // shared F, context), from the released config.json files
        // (Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen2-57B-A14B): θ = 10⁶, untied,
        // norm_topk_prob false, router_aux_loss_coef 0.001.
        let (vocab_size, hidden_size, intermediate_size, n_layer, n_head, n_kv_head, e, k, f, fs, ctx) = match name {
            "tiny" => (256, 64, 96, 2, 4, 2, 4, 2, 32, 48, 256),
            "qwen1.5-moe-a2.7b" => (151936, 2048, 5632, 24, 16, 16, 60, 4, 1408, 5632, 8192),
            "qwen2-57b-a14b" => (151936, 3584, 18944, 28, 28, 4, 64, 8, 2560, 20480, 32768),
            other => {
                return Err(
                    format!("`{other}` is not a qwen2_moe preset; choose one of {}", MOE_PRESETS.join(", ")).into()
                )
            }
        };
        let special = (name != "tiny").then_some(151643);
        let moe = MoeBlock {
            n_experts: e,
            top_k: k,
            expert_size: f,
            norm_topk_prob: false,
            shared_expert_size: Some(fs),
            names: MoeNames::Qwen,
            router_aux_loss_coef: 0.001,
            router_z_loss_coef: 0.0,
            load_balancing: LoadBalancing::GlobalBatch,
        };
        let cfg = LlamaConfig {
            head_dim: hidden_size / n_head,
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
            bos_token_id: special,
            eos_token_id: special.into_iter().collect(),
            attention_bias: true,
            moe: Some(moe),
            ..LlamaConfig::preset("tiny")?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads transformers' `Qwen2MoeConfig`: Qwen2's keys (its windows,
    /// `qkv_bias`, default true) and the mixture's; dense layers among
    /// the mixtures (`mlp_only_layers`, `decoder_sparse_step` ≠ 1) refused.
    fn parse_hf_json(&self, v: &Value) -> Result<LlamaConfig> {
        let what = "Qwen2-MoE config.json (read as the Llama block with q/k/v biases and a mixture of experts)";
        let own: Vec<&str> = MoeBlock::HF_KEYS.iter().chain(&QwenWindows::KEYS).copied().chain(["qkv_bias"]).collect();
        let base = read_as_llama(v, "qwen2_moe", &own, what)?;
        let bias = match v.get("qkv_bias") {
            None | Some(Value::Null) => true,
            Some(b) => b.as_bool().ok_or_else(|| format!("qkv_bias = {b}: must be true or false"))?,
        };
        let moe =
            MoeBlock::from_hf_json(v, MoeNames::Qwen, base.intermediate_size).map_err(|e| format!("{what}: {e}"))?;
        let (sliding_window, sliding_layers) = QwenWindows::read(v, base.n_layer)?;
        let cfg = LlamaConfig { attention_bias: bias, sliding_window, sliding_layers, moe: Some(moe), ..base };
        cfg.validate()?;
        Ok(cfg)
    }

    /// transformers' `Qwen2MoeConfig` for `Qwen2MoeForCausalLM`.
    fn hf_json(&self, cfg: &LlamaConfig) -> Value {
        let mut own = QwenWindows::written(cfg);
        own.extend(cfg.moe.as_ref().map(MoeBlock::hf_keys).unwrap_or_default());
        own.insert("qkv_bias".into(), cfg.attention_bias.into());
        let drop = ["attention_bias", "mlp_bias", "pretraining_tp", "head_dim"];
        written_as(cfg, ("Qwen2MoeForCausalLM", "qwen2_moe"), &drop, own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_released_parameter_counts() {
        // transformers 5.25, `Qwen2MoeForCausalLM(Qwen2MoeConfig(**shape))` on
        // the meta device, sum(p.numel()): 14,315,784,192 and 57,408,658,944
        // (the model cards' 14.3B and 57B).
        for (name, want) in [("qwen1.5-moe-a2.7b", 14_315_784_192u64), ("qwen2-57b-a14b", 57_408_658_944)] {
            let cfg = QWEN2_MOE.preset(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.param_count(), want as u128, "{name}");
        }
    }

    #[test]
    fn config_json_round_trips_and_refuses_dense_layers() {
        for name in MOE_PRESETS {
            let cfg = QWEN2_MOE.preset(name).unwrap_or_else(|e| panic!("{e}"));
            let json = QWEN2_MOE.hf_json(&cfg);
            assert_eq!(json["model_type"].as_str(), Some("qwen2_moe"));
            assert_eq!(QWEN2_MOE.parse_hf_json(&json).unwrap_or_else(|e| panic!("{e}")), cfg, "{name}");
        }
        let json = QWEN2_MOE.hf_json(&QWEN2_MOE.preset("tiny").unwrap_or_else(|e| panic!("{e}")));
        let refused = |key: &str, val: Value| {
            let mut j = json.clone();
            j[key] = val;
            QWEN2_MOE.parse_hf_json(&j).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(refused("mlp_only_layers", serde_json::json!([0])).contains("mlp_only_layers"));
        assert!(refused("decoder_sparse_step", Value::from(2)).contains("decoder_sparse_step"));
    }
}
