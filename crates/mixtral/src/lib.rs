//! Mixtral (8×7B, 8×22B and their fine-tunes): the Llama block — RMSNorm,
//! rotary embeddings, grouped-query attention — whose MLP is a mixture of
//! SwiGLU experts (`block_sparse_moe`: a router `gate` `[E, C]`, experts
//! `w1` (gate), `w3` (up), `w2` (down)), each token sent to its top 2 of 8
//! with the two probabilities renormalised. transformers' `MixtralModel`
//! is Llama's with that block, and so is this crate: it declares the
//! presets and the `config.json` dialect (`model_type: "mixtral"`,
//! `MixtralForCausalLM`) and registers as [`FAMILY`]; the mixture is the
//! `llama` crate's block with `LlamaConfig::moe` set, on `nn::moe`.

use family::Result;
use llama::dialect::{read_as_llama, read_window, written_as};
use llama::{Dialect, LlamaConfig, LoadBalancing, MoeBlock, MoeNames, Names, Registered};
use serde_json::{Map, Value};

/// Mixtral's `config.json` dialect and presets.
#[derive(Debug)]
pub struct MixtralDialect;

/// The dialect.
pub static MIXTRAL: MixtralDialect = MixtralDialect;

/// Mixtral's registration: `model.family = "mixtral"`, `model_type: "mixtral"`.
pub static FAMILY: Registered = Registered(&MIXTRAL);

/// The presets: `tiny` for tests and the released shapes for planning.
pub const PRESETS: &[&str] = &["tiny", "mixtral-8x7b", "mixtral-8x22b"];

/// The mixture of `experts` experts of width `f`, top-`k`, as Mixtral's.
fn mixture(experts: usize, k: usize, f: usize) -> MoeBlock {
    MoeBlock {
        n_experts: experts,
        top_k: k,
        expert_size: f,
        norm_topk_prob: true,
        shared_expert_size: None,
        names: MoeNames::Mixtral,
        router_aux_loss_coef: 0.02,
        router_z_loss_coef: 0.0,
        load_balancing: LoadBalancing::GlobalBatch,
    }
}

impl Dialect for MixtralDialect {
    fn names(&self) -> Names {
        Names { family: "mixtral", name: "Mixtral", presets: PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        // (vocab, hidden, expert width, layers, heads, kv heads, experts, context),
        // from the released models' config.json files (mistralai/Mixtral-*-v0.1):
        // top-2, θ = 10⁶, untied, router_aux_loss_coef 0.02, no window.
        let (vocab_size, hidden_size, f, n_layer, n_head, n_kv_head, experts, ctx) = match name {
            "tiny" => (256, 64, 96, 2, 4, 2, 4, 256),
            "mixtral-8x7b" => (32000, 4096, 14336, 32, 32, 8, 8, 32768),
            "mixtral-8x22b" => (32768, 6144, 16384, 56, 48, 8, 8, 65536),
            other => {
                return Err(format!("`{other}` is not a mixtral preset; choose one of {}", PRESETS.join(", ")).into())
            }
        };
        let (bos, eos) = if name == "tiny" { (None, Vec::new()) } else { (Some(1), vec![2]) };
        let cfg = LlamaConfig {
            head_dim: hidden_size / n_head,
            vocab_size,
            hidden_size,
            intermediate_size: f,
            n_layer,
            n_head,
            n_kv_head,
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            max_position_embeddings: ctx,
            tie_word_embeddings: false,
            bos_token_id: bos,
            eos_token_id: eos,
            moe: Some(mixture(experts, 2, f)),
            ..LlamaConfig::preset("tiny")?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads transformers' `MixtralConfig`: the Llama keys, a window
    /// (`sliding_window`, null in the released files) and the mixture's
    /// (`num_local_experts`, `num_experts_per_tok`, the expert width being
    /// `intermediate_size`, `router_aux_loss_coef`); router jitter refused.
    fn parse_hf_json(&self, v: &Value) -> Result<LlamaConfig> {
        let what = "Mixtral config.json (read as the Llama block with a mixture of experts)";
        let own: Vec<&str> = MoeBlock::HF_KEYS.iter().copied().chain(["sliding_window"]).collect();
        let base = read_as_llama(v, "mixtral", &own, what)?;
        let moe =
            MoeBlock::from_hf_json(v, MoeNames::Mixtral, base.intermediate_size).map_err(|e| format!("{what}: {e}"))?;
        let cfg = LlamaConfig { sliding_window: read_window(v)?, moe: Some(moe), ..base };
        cfg.validate()?;
        Ok(cfg)
    }

    /// transformers' `MixtralConfig` for `MixtralForCausalLM`.
    fn hf_json(&self, cfg: &LlamaConfig) -> Value {
        let mut own = cfg.moe.as_ref().map_or_else(Map::new, MoeBlock::hf_keys);
        own.insert("sliding_window".into(), cfg.sliding_window.map_or(Value::Null, Value::from));
        let drop = ["attention_bias", "mlp_bias", "pretraining_tp"];
        written_as(cfg, ("MixtralForCausalLM", "mixtral"), &drop, own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_released_parameter_counts() {
        // transformers 5.25, `MixtralForCausalLM(MixtralConfig(**shape))` on
        // the meta device, sum(p.numel()): 46,702,792,704 and
        // 140,630,071,296 — the model cards' 46.7B and 141B.
        for (name, want) in [("mixtral-8x7b", 46_702_792_704u64), ("mixtral-8x22b", 140_630_071_296)] {
            let cfg = MIXTRAL.preset(name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.param_count(), want as u128, "{name}");
        }
    }

    #[test]
    fn config_json_round_trips_and_refuses_what_is_not_implemented() {
        for name in PRESETS {
            let cfg = MIXTRAL.preset(name).unwrap_or_else(|e| panic!("{e}"));
            let json = MIXTRAL.hf_json(&cfg);
            assert_eq!(
                (json["model_type"].as_str(), json["num_local_experts"].as_u64()),
                (Some("mixtral"), cfg.moe.as_ref().map(|m| m.n_experts as u64))
            );
            assert_eq!(MIXTRAL.parse_hf_json(&json).unwrap_or_else(|e| panic!("{e}")), cfg, "{name}");
        }
        let json = MIXTRAL.hf_json(&MIXTRAL.preset("mixtral-8x7b").unwrap_or_else(|e| panic!("{e}")));
        let refused = |key: &str, val: Value| {
            let mut j = json.clone();
            j[key] = val;
            MIXTRAL.parse_hf_json(&j).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(refused("router_jitter_noise", Value::from(0.01)).contains("router_jitter_noise"));
        assert!(refused("num_experts_per_tok", Value::from(9)).contains("num_experts_per_tok"));
        assert!(refused("model_type", Value::from("llama")).contains("llama"));
    }
}
