//! Tensor parallelism for GPT-2's block (Megatron-LM's split): rank `t` of
//! `T` holds `n_head / T` heads — their q, k and v columns of `c_attn`
//! (column-parallel) and their rows of the attention's `c_proj`
//! (row-parallel) — and `4C / T` columns of the MLP (`c_fc`
//! column-parallel, its `c_proj` row-parallel); the embeddings, the
//! LayerNorms and the two `c_proj` biases are whole on every rank (a
//! row-parallel layer's bias is added once, after the all-reduce, so its
//! gradient is the same on every rank). The block's projections
//! all-reduce after each row-parallel product in forward and before each
//! column-parallel input gradient in backward ([`nn::proj`]); LoRA
//! adapters are cut with their layers (`shard_of`).
//!
//! Weights are HF `Conv1D` `[in, out]`: `c_attn` `[C, 3C]` is viewed as
//! `[C·3, n_head, head_dim]` (q | k | v, each head's columns), so a rank's
//! heads are one slice of the middle axis.
//!
//! With `dist.vocab_parallel` the token embedding (which is the head) is
//! cut by vocabulary rows too: rank `t` holds rows `t·V/T .. (t+1)·V/T`
//! (T must divide V; GPT-2's 50,257 does not: pad it to 50,304).

use crate::config::GptConfig;
use crate::error::GptError;
use crate::layout::{build_layout, Adapters, Widths};
use engine::{ParamLayout, Shard, TensorShards, TpRank};

/// Errors unless `cfg` splits over `tp.size` ranks: T must divide n_head.
pub(crate) fn check(cfg: &GptConfig, tp: TpRank) -> Result<(), GptError> {
    if tp.size == 0 || tp.rank >= tp.size {
        return Err(GptError::InvalidConfig(format!("tensor-parallel rank {} of a group of {}", tp.rank, tp.size)));
    }
    if !cfg.n_head.is_multiple_of(tp.size) {
        return Err(GptError::InvalidConfig(format!(
            "model.n_head ({}) must be divisible by dist.tensor_parallel ({}): each rank holds n_head / T heads; choose a T that divides {}",
            cfg.n_head, tp.size, cfg.n_head
        )));
    }
    if let Some(problem) = tp.vocab_problem(cfg.vocab_size) {
        return Err(GptError::InvalidConfig(format!("model.vocab_size: {problem}")));
    }
    Ok(())
}

/// How tensor `name` of the whole model is cut at `t` ranks, with LoRA
/// rank `r`: an adapter is cut with its layer's split axis — `lora_B`
/// `[out, r]` (and DoRA's magnitude `[out]`) beside a column-parallel
/// layer, `lora_A` `[r, in]` beside a row-parallel one; the other factor
/// is whole: beside a column-parallel layer each rank's `lora_A`
/// gradient is a part ([`Shard::Partial`]: its `x·Aᵀ` gradient comes from
/// its own output columns), beside a row-parallel one `lora_B`'s is whole
/// (the ranks' `x·Aᵀ` are summed in forward). With `vocab` the token
/// embedding (the tied head) is cut by vocabulary rows. With `seq`
/// (sequence parallelism) each LayerNorm sees this rank's rows only: its
/// gradient is a part.
fn shard_of(cfg: &GptConfig, name: &str, (t, vocab, seq): (usize, bool, bool), r: usize) -> Shard {
    let (c, nh, hd) = (cfg.n_embd, cfg.n_head, cfg.head_dim());
    let split = |outer: usize, dim: usize, inner: usize| Shard::Split { outer, dim, inner, parts: t };
    let ends = |s: &str| name.ends_with(s);
    let adapter = |layer: &str, part: &str| name.ends_with(&format!("{layer}.{part}"));
    let (a, b, m) = ("lora_A.weight", "lora_B.weight", nn::lora::MAGNITUDE);
    if (seq && name.contains(".ln_")) || adapter("attn.c_attn", a) || adapter("mlp.c_fc", a) {
        Shard::Partial
    } else if adapter("attn.c_attn", b) {
        split(3, nh, hd * r)
    } else if adapter("attn.c_attn", m) {
        split(3, nh, hd)
    } else if adapter("mlp.c_fc", b) {
        split(1, 4 * c, r)
    } else if adapter("mlp.c_fc", m) {
        split(1, 4 * c, 1)
    } else if adapter("attn.c_proj", a) {
        split(r, nh, hd)
    } else if adapter("mlp.c_proj", a) {
        split(r, 4 * c, 1)
    } else if ends("attn.c_attn.weight") {
        split(3 * c, nh, hd)
    } else if ends("attn.c_attn.bias") {
        split(3, nh, hd)
    } else if ends("attn.c_proj.weight") {
        split(1, nh, hd * c)
    } else if ends("mlp.c_fc.weight") {
        split(c, 4 * c, 1)
    } else if ends("mlp.c_fc.bias") {
        split(1, 4 * c, 1)
    } else if ends("mlp.c_proj.weight") {
        split(1, 4 * c, c)
    } else if vocab && ends("wte.weight") {
        split(1, cfg.vocab_size, c)
    } else {
        Shard::Replicated
    }
}

/// The map of rank `tp`'s layout (`local`, with `adapters`) onto the whole model's.
pub(crate) fn shards(
    cfg: &GptConfig,
    tp: TpRank,
    local: &ParamLayout,
    adapters: Option<Adapters>,
) -> Result<TensorShards, GptError> {
    if !tp.is_split() {
        return Err(GptError::InvalidConfig("the whole model has no shards".into()));
    }
    let (whole, _) = build_layout(cfg, Widths::of(cfg, TpRank::WHOLE), adapters, false);
    let r = adapters.map_or(0, |a| a.r);
    let shards = whole.tensors().iter().map(|t| shard_of(cfg, &t.name, (tp.size, tp.vocab, tp.seq), r)).collect();
    TensorShards::new(tp, whole, local.clone(), shards).map_err(|e| GptError::InvalidConfig(e.to_string()))
}
