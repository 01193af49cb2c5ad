//! Tensor parallelism for the Llama block (Megatron-LM's split): rank `t`
//! of `T` holds `n_head / T` query heads, their key/value heads, `F / T`
//! columns of the MLP, and the whole of the embedding, the norms and the
//! head. q, k, v, gate and up are column-parallel (their output features
//! split), o and down row-parallel (their input features split): the layer
//! all-reduces after o and down in forward and before the input gradient of
//! q|k|v and gate|up in backward ([`crate::block`]).
//!
//! Key/value heads are split when `T` divides `n_kv_head`; when `n_kv_head`
//! divides `T` (fewer key/value heads than ranks, e.g. multi-query
//! attention) each rank holds the one key/value head its query heads read,
//! shared by `T / n_kv_head` consecutive ranks (their gradients summed by
//! the engine). Other combinations are refused.
//!
//! The per-head q/k norms' gains (Qwen3) are whole on every rank; each
//! rank's gradient is the part its heads give, summed by the engine.
//!
//! LoRA adapters follow their base layer: beside a column-parallel weight
//! `B` is split with it and `A` is whole (each rank's `A` gradient is the
//! part its columns feed: summed over the group); beside a row-parallel one
//! `A` is split and `B` whole: the ranks' parts of `x·Aᵀ` (`n × r`, small)
//! are all-reduced before `B`, so `B`'s input and gradient are whole on
//! every rank (and, under 16-bit storage, `x·Aᵀ` is rounded once, as uncut).
//!
//! With `dist.vocab_parallel` the token embedding and the head are cut by
//! vocabulary rows too (rank `t` holds rows `t·V/T .. (t+1)·V/T`; T must
//! divide V): the rank's shape has `vocab_size = V / T`.

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::layout::Proj;
use engine::{Shard, TpRank};

impl LlamaConfig {
    /// The shape rank `tp.rank` of a tensor-parallel group holds: `n_head
    /// / T` query heads, `n_kv_head / T` key/value heads (or one, when
    /// `n_kv_head` divides `T`), `F / T` MLP columns; the residual width
    /// and head width unchanged. Errors name the dimension and the fix.
    pub fn for_rank(&self, tp: TpRank) -> Result<LlamaConfig, LlamaError> {
        let t = tp.size;
        if t == 0 || tp.rank >= t {
            return Err(LlamaError::config("tensor_parallel", format!("rank {} of a group of {t}", tp.rank)));
        }
        if !self.n_head.is_multiple_of(t) {
            return Err(LlamaError::config(
                "n_head",
                format!(
                    "({}) must be divisible by dist.tensor_parallel ({t}): each rank holds n_head / T query heads; choose a T that divides {}",
                    self.n_head, self.n_head
                ),
            ));
        }
        if !self.intermediate_size.is_multiple_of(t) {
            return Err(LlamaError::config(
                "intermediate_size",
                format!(
                    "({}) must be divisible by dist.tensor_parallel ({t}): each rank holds F / T MLP columns",
                    self.intermediate_size
                ),
            ));
        }
        let n_kv_head = if self.n_kv_head.is_multiple_of(t) {
            self.n_kv_head / t
        } else if t.is_multiple_of(self.n_kv_head) {
            1
        } else {
            return Err(LlamaError::config(
                "n_kv_head",
                format!(
                    "({}) must be divisible by dist.tensor_parallel ({t}) (each rank holds n_kv_head / T key/value heads) or divide it (each key/value head is replicated on T / n_kv_head ranks)",
                    self.n_kv_head
                ),
            ));
        };
        if let Some(problem) = tp.vocab_problem(self.vocab_size) {
            return Err(LlamaError::config("vocab_size", problem));
        }
        Ok(LlamaConfig {
            vocab_size: tp.vocab_rows(self.vocab_size).len(),
            n_head: self.n_head / t,
            n_kv_head,
            intermediate_size: self.intermediate_size / t,
            ..self.clone()
        })
    }

    /// Pieces the key/value heads are cut into at `T` ranks: `T` when they
    /// are split, `n_kv_head` when ranks share them.
    fn kv_parts(&self, t: usize) -> usize {
        if self.n_kv_head.is_multiple_of(t) {
            t
        } else {
            self.n_kv_head
        }
    }

    /// How tensor `name` of the whole model (this shape) is cut at `T`
    /// ranks (`vocab`: by vocabulary rows too), with LoRA rank `r`.
    pub(crate) fn shard_of(&self, name: &str, (t, vocab, seq): (usize, bool, bool), r: usize) -> Shard {
        let (c, f, hd) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (nh, nkv, kvp) = (self.n_head, self.n_kv_head, self.kv_parts(t));
        let split = |outer: usize, dim: usize, inner: usize, parts: usize| Shard::Split { outer, dim, inner, parts };
        // The per-head q/k norms' gains serve every head: whole on every
        // rank, each rank's gradient the part its heads give (summed).
        if name.ends_with(".q_norm.weight") || name.ends_with(".k_norm.weight") {
            return Shard::Partial;
        }
        // Sequence parallelism: the residual stream's norms see this
        // rank's rows only, their gradients a part each.
        if seq && (name.ends_with("layernorm.weight") || name == "model.norm.weight") {
            return Shard::Partial;
        }
        if vocab && (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
            return split(1, self.vocab_size, c, t);
        }
        let parts: Vec<&str> = name.split('.').collect();
        let Some(pr) = parts.iter().find_map(|p| Proj::from_name(p)) else { return Shard::Replicated };
        let column = !matches!(pr, Proj::O | Proj::Down);
        // The split axis of the projection's output (column-parallel) or input (row-parallel).
        let (dim, unit, pieces) = match pr {
            Proj::Q | Proj::O => (nh, hd, t),
            Proj::K | Proj::V => (nkv, hd, kvp),
            Proj::Gate | Proj::Up | Proj::Down => (f, 1, t),
        };
        let kind = if parts.contains(&"lora_A") {
            "A"
        } else if parts.contains(&"lora_B") {
            "B"
        } else {
            parts.last().copied().unwrap_or("")
        };
        match (kind, column) {
            // [out, in]: output features split / input features split.
            ("weight", true) => split(1, dim, unit * c, pieces),
            ("weight", false) => split(c, dim, unit, pieces),
            ("bias", _) => split(1, dim, unit, pieces),
            // DoRA's magnitude [out], beside a column-parallel projection only.
            (nn::lora::MAGNITUDE, true) => split(1, dim, unit, pieces),
            // lora_A [r, in], lora_B [out, r].
            ("A", true) => Shard::Partial,
            ("A", false) => split(r, dim, unit, pieces),
            ("B", true) => split(1, dim, unit * r, pieces),
            _ => Shard::Replicated,
        }
    }
}
