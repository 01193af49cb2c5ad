//! A model on the Llama block as llama.cpp's converter (`convert_hf_to_gguf.py`)
//! writes it: tensor names `token_embd`, `blk.N.attn_q`, … (the inverse of
//! [`gguf::llama::hf_name`]; q/k/v biases `blk.N.attn_{q,k,v}.bias`),
//! dimensions fastest first (the bytes of a row-major `[out, in]` weight
//! need no transposing), and for the `llama` architecture the rows of Q
//! and K permuted so that llama.cpp's RoPE rotates adjacent pairs
//! ([`gguf::llama::permute_rows`]; `qwen2` keeps Hugging Face's order, as
//! llama.cpp's converter does). The metadata is the architecture's
//! (`{arch}.block_count`, …); the tokenizer's keys are added by the caller.

use crate::layout::{fused_weight, in_layer, stored_as, Fused, StoredTensor};
use crate::{LlamaConfig, LlamaError};
use engine::ParamLayout;
use family::{GgufLayout, GgufModel, GgufTensor};
use gguf::llama::TensorName;
use gguf::Value;

/// How a family on the Llama block is written as GGUF: llama.cpp's
/// architecture name, whether its converter permutes the rows of Q and K,
/// and whether it reads a sliding window. The weights written fused are
/// the ones the family's files fuse ([`crate::LlamaConfig::fused_weights`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgufArch {
    /// `general.architecture` (`llama`, `qwen2`, `qwen3`, `phi3`).
    pub name: &'static str,
    /// Whether Q and K rows are permuted for llama.cpp's RoPE.
    pub permute_qk: bool,
    /// Whether the architecture has `{arch}.attention.sliding_window`
    /// (without it, a model with a window shorter than its context is refused).
    pub sliding_window: bool,
}

impl GgufArch {
    /// An architecture without a window key.
    pub const fn plain(name: &'static str, permute_qk: bool) -> Self {
        GgufArch { name, permute_qk, sliding_window: false }
    }
}

fn unsupported(what: String) -> LlamaError {
    LlamaError::Unsupported { what, hint: "export the model as a Hugging Face folder instead".into() }
}

fn u32_of(key: &str, v: usize) -> Result<Value, LlamaError> {
    u32::try_from(v).map(Value::U32).map_err(|_| unsupported(format!("{key} = {v} does not fit GGUF's u32")))
}

/// The architecture metadata llama.cpp's converter writes for `arch`.
fn metadata(arch: GgufArch, name: &str, cfg: &LlamaConfig) -> Result<Vec<(String, Value)>, LlamaError> {
    let a = arch.name;
    let mut m = vec![
        ("general.architecture".to_string(), Value::String(a.into())),
        ("general.name".to_string(), Value::String(name.into())),
    ];
    for (key, v) in [
        ("block_count", cfg.n_layer),
        ("context_length", cfg.max_position_embeddings),
        ("embedding_length", cfg.hidden_size),
        ("feed_forward_length", cfg.intermediate_size),
        ("attention.head_count", cfg.n_head),
        ("attention.head_count_kv", cfg.n_kv_head),
        ("rope.dimension_count", cfg.head_dim),
        ("vocab_size", cfg.vocab_size),
    ] {
        let key = format!("{a}.{key}");
        m.push((key.clone(), u32_of(&key, v)?));
    }
    if cfg.q_dim() != cfg.hidden_size {
        // Heads wider (or narrower) than hidden / heads: llama.cpp reads their width here.
        for key in ["attention.key_length", "attention.value_length"] {
            let key = format!("{a}.{key}");
            m.push((key.clone(), u32_of(&key, cfg.head_dim)?));
        }
    }
    if let Some(r) = &cfg.rope_scaling {
        // llama.cpp reads it only for YaRN; our reader takes the scaling's
        // one free scale from it ([`crate::import::rope_scaling_from_freqs`]).
        let key = format!("{a}.rope.scaling.original_context_length");
        m.push((key.clone(), u32_of(&key, r.original_max_position_embeddings)?));
    }
    if let Some(w) = cfg.sliding_window.filter(|_| arch.sliding_window) {
        let key = format!("{a}.attention.sliding_window");
        m.push((key.clone(), u32_of(&key, w)?));
    }
    if let Some(g) = &cfg.gemma {
        // Gemma 2's converter always writes the head width and the caps
        // (`gemma_check` refuses a model without them).
        if cfg.q_dim() == cfg.hidden_size {
            for key in ["attention.key_length", "attention.value_length"] {
                let key = format!("{a}.{key}");
                m.push((key.clone(), u32_of(&key, cfg.head_dim)?));
            }
        }
        for (key, cap) in [("attn_logit_softcapping", g.attn_softcap), ("final_logit_softcapping", g.final_softcap)] {
            m.extend(cap.map(|c| (format!("{a}.{key}"), Value::F32(c as f32))));
        }
    }
    m.push((format!("{a}.rope.freq_base"), Value::F32(cfg.rope_theta as f32)));
    m.push((format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_norm_eps as f32)));
    Ok(m)
}

/// What llama.cpp's `gemma2` assumes and cannot be told: scores scaled by
/// `1/√head_dim` (by `1/√(hidden / heads)` in its 46-layer 27B), windows on
/// the even layers, both soft caps.
fn gemma_check(cfg: &LlamaConfig) -> Result<(), LlamaError> {
    let Some(g) = &cfg.gemma else { return Ok(()) };
    let its_scalar = gemma_scalar(cfg);
    if g.query_pre_attn_scalar != its_scalar as f64 {
        return Err(unsupported(format!(
            "query_pre_attn_scalar = {}: llama.cpp's gemma2 scales scores by 1/√{its_scalar} for this shape",
            g.query_pre_attn_scalar
        )));
    }
    if let Some(i) =
        (0..cfg.n_layer).find(|&i| cfg.window_of(i).is_some() != (i % 2 == 0 && cfg.sliding_window.is_some()))
    {
        return Err(unsupported(format!("layer {i}'s window: llama.cpp's gemma2 windows the even layers only")));
    }
    if cfg.sliding_window.is_none() || g.attn_softcap.is_none() || g.final_softcap.is_none() {
        return Err(unsupported("a Gemma 2 without its window or a soft cap: llama.cpp's gemma2 assumes them".into()));
    }
    Ok(())
}

/// The `query_pre_attn_scalar` llama.cpp's `gemma2` uses for the shape
/// `cfg`: the head width, `hidden / heads` with 46 layers (Gemma 2 27B).
pub(crate) fn gemma_scalar(cfg: &LlamaConfig) -> usize {
    if cfg.n_layer == 46 {
        cfg.hidden_size / cfg.n_head
    } else {
        cfg.head_dim
    }
}

/// Whether llama.cpp stores the layout tensor `name` as `1 + w` (Gemma's
/// norm gains, as its converter writes them).
pub(crate) fn stores_one_plus(cfg: &LlamaConfig, name: &str) -> bool {
    cfg.gemma.is_some() && name.ends_with("norm.weight")
}

/// llama.cpp's `gemma2` name of a norm's gain (`post_attention_layernorm`
/// is the attention's post norm there, `pre_feedforward_layernorm` the
/// MLP's `ffn_norm`).
fn gemma_norm_name(hf: &str) -> Option<String> {
    let (layer, rest) = in_layer(hf)?;
    let g = match rest {
        "input_layernorm.weight" => "attn_norm",
        "post_attention_layernorm.weight" => "post_attention_norm",
        "pre_feedforward_layernorm.weight" => "ffn_norm",
        "post_feedforward_layernorm.weight" => "post_ffw_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.weight"))
}

/// llama.cpp's name of the layout tensor `hf` (a weight, or a q/k/v bias).
fn gguf_name(hf: &str) -> Option<String> {
    match hf.strip_suffix(".bias") {
        Some(stem) if stem.contains(".self_attn.") => {
            let weight = gguf::llama::gguf_name(&format!("{stem}.weight"))?;
            Some(format!("{}.bias", weight.strip_suffix(".weight")?))
        }
        Some(_) => None,
        None => gguf::llama::gguf_name(hf),
    }
}

/// The model `cfg` with parameters `params` (in `layout`'s order, no LoRA
/// adapters) as `arch` in a GGUF file, named `name` (`general.name`).
/// Errors on adapters in the layout (merge them first), a parameter count
/// that is not the layout's, and RoPE scaling where the architecture has no
/// `rope_freqs` tensor (llama.cpp's `llama` has: Llama 3's scaling is
/// written there, as its converter writes it — [`rope_freqs`]).
pub fn gguf_model<'a>(
    (arch, fused): (GgufArch, &[Fused]),
    name: &str,
    cfg: &LlamaConfig,
    layout: &ParamLayout,
    params: &'a [f32],
) -> Result<GgufModel<'a>, LlamaError> {
    LlamaError::check_count("model", layout.n_params(), params.len())?;
    let rope_freqs = match &cfg.rope_scaling {
        None => None,
        Some(_) if arch.name == "llama" => Some(rope_freqs(cfg)),
        Some(s) => {
            return Err(unsupported(format!(
                "RoPE scaling ({s:?}): llama.cpp's `{}` architecture has no rope_freqs tensor to hold it",
                arch.name
            )))
        }
    };
    if let Some(w) = cfg.sliding_window.filter(|&w| w < cfg.max_position_embeddings && !arch.sliding_window) {
        return Err(unsupported(format!(
            "a sliding window of {w} keys: llama.cpp's `{}` architecture attends to every earlier key, so the file would compute something else past {w} tokens",
            arch.name
        )));
    }
    gemma_check(cfg)?;
    if let Some(t) = layout.tensors().iter().find(|t| t.name.contains(".lora_")) {
        return Err(unsupported(format!(
            "`{}` is a LoRA adapter: merge the adapters into the base before writing a GGUF file",
            t.name
        )));
    }
    let named = tensor_names((arch, fused), cfg, layout)?;
    let mut tensors = Vec::with_capacity(named.len());
    for ((name, shape, range), t) in named {
        let how = match t.permuted_heads {
            Some(heads) => GgufLayout::PermuteRows { heads },
            None => GgufLayout::Same,
        };
        if stores_one_plus(cfg, &name) {
            let gains = cfg.gains(&params[range]).into_owned();
            tensors.push(GgufTensor::new(t.gguf, &shape, gains, how));
        } else {
            tensors.push(GgufTensor::new(t.gguf, &shape, &params[range], how));
        }
    }
    if let Some(f) = rope_freqs {
        tensors.push(GgufTensor::new("rope_freqs.weight", &[f.len()], f, GgufLayout::Same));
    }
    Ok(GgufModel { metadata: metadata(arch, name, cfg)?, tensors })
}

/// Every tensor of `layout` as `arch` stores it (the weights `fused` fused):
/// the layout's name, shape and range, and the llama.cpp name with the heads
/// whose rows are permuted (a bias moves with its rows). What
/// [`gguf_model`] writes and [`crate::import`] reads, named once.
pub(crate) fn tensor_names(
    (arch, fused): (GgufArch, &[Fused]),
    cfg: &LlamaConfig,
    layout: &ParamLayout,
) -> Result<Vec<(StoredTensor, TensorName)>, LlamaError> {
    let stored = layout.tensors().iter().map(|t| (t.name.clone(), t.shape.clone(), t.range())).collect();
    let stored = stored_as(stored, fused).map_err(|p| unsupported(format!("`{p}` is not beside its fused weight")))?;
    let mut out = Vec::with_capacity(stored.len());
    for (name, shape, range) in stored {
        let g = match fused_weight(&name, fused) {
            Some((layer, f)) => Some(format!("blk.{layer}.{}.weight", f.gguf)),
            None if cfg.gemma.is_some() => gemma_norm_name(&name).or_else(|| gguf_name(&name)),
            None => gguf_name(&name),
        };
        let g = g.ok_or_else(|| unsupported(format!("`{name}` has no llama.cpp name")))?;
        let heads = match g.rsplit_once('.').map(|(stem, _)| stem.rsplit('.').next()) {
            Some(Some("attn_q")) => cfg.n_head,
            Some(Some("attn_k")) => cfg.n_kv_head,
            _ => 0,
        };
        let permuted_heads = (arch.permute_qk && heads > 0).then_some(heads);
        if permuted_heads.is_some() && !shape[0].is_multiple_of(2 * heads) {
            return Err(unsupported(format!("`{name}` has {} rows, not a multiple of 2 × {heads} heads", shape[0])));
        }
        let t = TensorName { gguf: g, hf: name.clone(), permuted_heads };
        out.push(((name, shape, range), t));
    }
    Ok(out)
}

/// Llama 3's RoPE scaling as llama.cpp holds it: one factor per rotated
/// pair that its RoPE divides the plain frequency `θ^(−2i/d)` by (the
/// `rope_freqs` tensor `convert_hf_to_gguf.py` writes), so llama.cpp
/// rotates by the frequencies this model's RoPE uses
/// ([`nn::rope::inv_freq`] with the scaling).
pub fn rope_freqs(cfg: &LlamaConfig) -> Vec<f32> {
    match cfg.llama3_scaling() {
        Some(s) => nn::rope::divisors(cfg.head_dim, cfg.rope_theta, &s),
        None => vec![1.0; cfg.head_dim / 2],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against transformers 5.25's Llama 3 frequencies (head width 16,
    /// θ 10⁴, factor 8, low/high frequency factors 1 and 4, original
    /// context 32: one pair in each band and the rest in the low one):
    ///
    /// ```text
    /// cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={"rope_type": "llama3",
    ///     "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    ///     "original_max_position_embeddings": 32})
    /// inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    /// base = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16))
    /// (base / inv).tolist()  # [1.0, 3.29953932762146, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    /// ```
    ///
    /// Both are ratios of f32 frequencies: within 1e-6 relative (a band
    /// edge one pair off moves a factor by ×2.4 or more). The tensor is
    /// written for `llama`, and refused where the architecture has none.
    #[test]
    fn llama3_rope_scaling_is_written_as_rope_freqs() {
        use engine::Model;
        let scaling = crate::RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        };
        let cfg = LlamaConfig {
            hidden_size: 64,
            n_head: 4,
            n_kv_head: 4,
            head_dim: 16,
            rope_theta: 1e4,
            rope_scaling: Some(scaling),
            ..LlamaConfig::preset("tiny").unwrap()
        };
        let want = [1.0, 3.299_539_3, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0];
        let got = rope_freqs(&cfg);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-6 * w, "rope_freqs {got:?}, transformers {want:?}");
        }
        let model = crate::Llama::new(cfg.clone()).unwrap();
        let params = model.init_params(1);
        let file = gguf_model((GgufArch::plain("llama", true), &[]), "t", &cfg, model.layout(), &params).unwrap();
        let t = file.tensors.iter().find(|t| t.name == "rope_freqs.weight").unwrap();
        assert_eq!((t.ne.clone(), t.values().to_vec()), (vec![8], got));
        let qwen2 = gguf_model((GgufArch::plain("qwen2", false), &[]), "t", &cfg, model.layout(), &params);
        assert!(qwen2.err().is_some_and(|e| e.to_string().contains("rope_freqs")));
    }

    #[test]
    fn names_cover_weights_and_qkv_biases() {
        assert_eq!(gguf_name("model.layers.3.self_attn.k_proj.bias").as_deref(), Some("blk.3.attn_k.bias"));
        assert_eq!(gguf_name("model.layers.3.mlp.up_proj.weight").as_deref(), Some("blk.3.ffn_up.weight"));
        assert_eq!(gguf_name("lm_head.weight").as_deref(), Some("output.weight"));
        assert_eq!(gguf_name("model.norm.bias"), None);
        assert_eq!(gguf_name("model.layers.0.self_attn.q_proj.lora_A.weight"), None);
    }
}
