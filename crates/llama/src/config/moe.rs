//! The Llama block with a mixture of experts in place of its MLP
//! (Mixtral, Qwen2-MoE, Qwen3-MoE): the router, the experts, an optional
//! shared expert, and the router losses' settings.

use crate::error::LlamaError;
use serde::{Deserialize, Serialize};

/// Which names a family's files give the experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoeNames {
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1|w3|w2`.
    Mixtral,
    /// `mlp.gate`, `mlp.experts.{e}.gate_proj|up_proj|down_proj`,
    /// `mlp.shared_expert.*` and `mlp.shared_expert_gate`.
    Qwen,
}

/// How the load-balancing loss counts `fᵢ`, the share of choices of
/// expert `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadBalancing {
    /// Over the whole global batch (every micro-batch of every
    /// data-parallel rank), counted by a forward-only routing pass over the
    /// step's micro-batches before the first one's backward: the loss one
    /// big batch would have, at any K and W.
    #[default]
    GlobalBatch,
    /// Over each micro-batch on its own rank, what most trainers compute:
    /// its value changes with K and W.
    MicroBatch,
}

impl LoadBalancing {
    /// The spelling in `model.load_balancing`.
    pub fn name(self) -> &'static str {
        match self {
            LoadBalancing::GlobalBatch => "global_batch",
            LoadBalancing::MicroBatch => "micro_batch",
        }
    }
}

/// A mixture of experts in every layer's MLP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeBlock {
    /// Experts E (`num_local_experts`, `num_experts`).
    pub n_experts: usize,
    /// Experts per token k (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's hidden width (Mixtral's `intermediate_size`, Qwen's
    /// `moe_intermediate_size`).
    pub expert_size: usize,
    /// Whether the k chosen probabilities are renormalised (Mixtral:
    /// always; Qwen: `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Qwen2-MoE's shared expert's width (every row passes through it,
    /// scaled by `sigmoid(shared_expert_gate · x)`); `None`: no shared expert.
    #[serde(default)]
    pub shared_expert_size: Option<usize>,
    /// The files' names.
    pub names: MoeNames,
    /// α of the load-balancing loss (`router_aux_loss_coef`); 0: none.
    pub router_aux_loss_coef: f64,
    /// The router z-loss's factor (ST-MoE: mean over tokens and layers of
    /// the router's log-sum-exp squared); 0: none.
    #[serde(default)]
    pub router_z_loss_coef: f64,
    /// How the load-balancing loss counts its shares.
    #[serde(default)]
    pub load_balancing: LoadBalancing,
}

impl MoeBlock {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), LlamaError> {
        if self.n_experts == 0 || self.expert_size == 0 {
            return Err(LlamaError::config("n_experts", "an MoE block needs at least one expert of width ≥ 1"));
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return Err(LlamaError::config(
                "num_experts_per_tok",
                format!("({}) must be between 1 and the number of experts ({})", self.top_k, self.n_experts),
            ));
        }
        if self.shared_expert_size == Some(0) {
            return Err(LlamaError::config("shared_expert_intermediate_size", "must be at least 1 (or absent)"));
        }
        for (key, x) in
            [("router_aux_loss_coef", self.router_aux_loss_coef), ("router_z_loss_coef", self.router_z_loss_coef)]
        {
            if !(x.is_finite() && x >= 0.0) {
                return Err(LlamaError::config(key, format!("must be ≥ 0, got {x}")));
            }
        }
        Ok(())
    }

    /// Parameters of one layer's mixture: the router `[E, C]`, E experts of
    /// `3·F·C`, a shared expert of `3·Fs·C` and its gate `[1, C]`.
    pub fn param_count(&self, c: u128) -> u128 {
        let (e, f) = (self.n_experts as u128, self.expert_size as u128);
        let shared = self.shared_expert_size.map_or(0, |s| 3 * s as u128 * c + c);
        e * c + e * 3 * f * c + shared
    }

    /// Tensors of one layer's mixture.
    pub fn tensor_count(&self) -> u128 {
        1 + 3 * self.n_experts as u128 + if self.shared_expert_size.is_some() { 4 } else { 0 }
    }

    /// The router's tensor inside a layer.
    pub fn router_name(&self) -> &'static str {
        match self.names {
            MoeNames::Mixtral => "block_sparse_moe.gate.weight",
            MoeNames::Qwen => "mlp.gate.weight",
        }
    }

    /// Expert `e`'s gate, up and down tensors inside a layer.
    pub fn expert_names(&self, e: usize) -> [String; 3] {
        match self.names {
            MoeNames::Mixtral => ["w1", "w3", "w2"].map(|w| format!("block_sparse_moe.experts.{e}.{w}.weight")),
            MoeNames::Qwen => ["gate_proj", "up_proj", "down_proj"].map(|w| format!("mlp.experts.{e}.{w}.weight")),
        }
    }

    /// The keys transformers' configs hold for this block (besides Llama's):
    /// `(experts key, expert width key)`.
    fn keys(&self) -> (&'static str, &'static str) {
        match self.names {
            MoeNames::Mixtral => ("num_local_experts", "intermediate_size"),
            MoeNames::Qwen => ("num_experts", "moe_intermediate_size"),
        }
    }

    /// The block's keys as `config.json` writes them.
    pub fn hf_keys(&self) -> serde_json::Map<String, serde_json::Value> {
        let (experts, width) = self.keys();
        let mut m = serde_json::Map::new();
        m.insert(experts.into(), self.n_experts.into());
        m.insert("num_experts_per_tok".into(), self.top_k.into());
        if width != "intermediate_size" {
            m.insert(width.into(), self.expert_size.into());
        }
        if self.names == MoeNames::Qwen {
            m.insert("norm_topk_prob".into(), self.norm_topk_prob.into());
            m.insert("decoder_sparse_step".into(), 1.into());
            m.insert("mlp_only_layers".into(), serde_json::json!([]));
            if let Some(s) = self.shared_expert_size {
                m.insert("shared_expert_intermediate_size".into(), s.into());
            }
        }
        m.insert("router_aux_loss_coef".into(), self.router_aux_loss_coef.into());
        m.insert("router_z_loss_coef".into(), self.router_z_loss_coef.into());
        m.insert("load_balancing".into(), self.load_balancing.name().into());
        m.insert("output_router_logits".into(), (self.router_aux_loss_coef > 0.0).into());
        m.insert("router_jitter_noise".into(), 0.0.into());
        m
    }

    /// The keys [`MoeBlock::hf_keys`] writes, which Llama's reader does not know.
    pub const HF_KEYS: [&'static str; 13] = [
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "shared_expert_intermediate_size",
        "router_aux_loss_coef",
        "router_z_loss_coef",
        "load_balancing",
        "output_router_logits",
        "router_jitter_noise",
    ];

    /// Reads the block from a `config.json` (`v`) of a family naming its
    /// tensors `names`, its expert width `intermediate` when the family has no key of its own.
    pub fn from_hf_json(v: &serde_json::Value, names: MoeNames, intermediate: usize) -> Result<Self, LlamaError> {
        let get = |k: &str| v.get(k).filter(|x| !x.is_null());
        let uint = |k: &str| super::json_uint(v, k);
        let num = |k: &str, default: f64| super::json_number(v.get(k), k, default);
        let probe = MoeBlock {
            n_experts: 0,
            top_k: 0,
            expert_size: 0,
            norm_topk_prob: false,
            shared_expert_size: None,
            names,
            router_aux_loss_coef: 0.0,
            router_z_loss_coef: 0.0,
            load_balancing: LoadBalancing::GlobalBatch,
        };
        let (experts_key, width_key) = probe.keys();
        if let Some(j) = get("router_jitter_noise").and_then(|x| x.as_f64()).filter(|&j| j != 0.0) {
            return Err(LlamaError::unsupported(
                format!("router_jitter_noise = {j}"),
                "jitter on the router's inputs is not implemented; only 0 is supported",
            ));
        }
        if names == MoeNames::Qwen {
            if let Some(s) = uint("decoder_sparse_step")?.filter(|&s| s != 1) {
                return Err(LlamaError::unsupported(
                    format!("decoder_sparse_step = {s}"),
                    "every layer is a mixture here; only 1 is supported",
                ));
            }
            if get("mlp_only_layers").and_then(|x| x.as_array()).is_some_and(|a| !a.is_empty()) {
                return Err(LlamaError::unsupported(
                    "mlp_only_layers",
                    "dense layers among the mixtures are not implemented; only [] is supported",
                ));
            }
        }
        let load_balancing = match get("load_balancing").map(|x| x.as_str()) {
            None | Some(Some("global_batch")) => LoadBalancing::GlobalBatch,
            Some(Some("micro_batch")) => LoadBalancing::MicroBatch,
            Some(_) => return Err(LlamaError::config("load_balancing", "must be \"global_batch\" or \"micro_batch\"")),
        };
        let m = MoeBlock {
            // transformers 5 maps each family's key onto `num_local_experts`
            // and may write that one: either is read.
            n_experts: match uint(experts_key)? {
                Some(e) => e,
                None => uint(if experts_key == "num_experts" { "num_local_experts" } else { "num_experts" })?
                    .ok_or_else(|| LlamaError::config(experts_key, "is missing"))?,
            },
            top_k: uint("num_experts_per_tok")?.unwrap_or(2),
            expert_size: if width_key == "intermediate_size" {
                intermediate
            } else {
                uint(width_key)?.ok_or_else(|| LlamaError::config(width_key, "is missing"))?
            },
            // Mixtral renormalises always; Qwen's default is false.
            norm_topk_prob: match names {
                MoeNames::Mixtral => true,
                MoeNames::Qwen => get("norm_topk_prob").and_then(|x| x.as_bool()).unwrap_or(false),
            },
            shared_expert_size: if names == MoeNames::Qwen {
                uint("shared_expert_intermediate_size")?.filter(|&s| s > 0)
            } else {
                None
            },
            names,
            router_aux_loss_coef: num("router_aux_loss_coef", 0.001)?,
            router_z_loss_coef: num("router_z_loss_coef", 0.0)?,
            load_balancing,
        };
        m.validate()?;
        Ok(m)
    }
}
