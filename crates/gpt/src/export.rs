//! GPT-2 as llama.cpp's converter (`convert_hf_to_gguf.py`) writes it, the
//! `gpt2` architecture: names `token_embd`, `position_embd`,
//! `blk.N.attn_norm`, `attn_qkv`, `attn_output`, `ffn_norm`, `ffn_up`,
//! `ffn_down` (weights and biases), `output_norm`, and `output.weight` — the
//! converter writes the tied head as a copy of the embedding. Hugging Face
//! keeps GPT-2's projections as `Conv1D` weights `[in, out]`; the converter
//! transposes them to `[out, in]` row-major (GGUF `ne = [in, out]`), as
//! every other architecture's linear weights are, and transformers' GGUF
//! reader transposes them back. (That reader maps `gpt2.context_length` to
//! `n_ctx`, not `n_positions`, so it reads only models of 1024 positions,
//! as every released GPT-2 has; llama.cpp reads any.)

use crate::GptConfig;
use engine::ParamLayout;
use family::{GgufLayout, GgufModel, GgufTensor};
use gguf::Value;

/// GPT-2's LayerNorm epsilon (transformers' `layer_norm_epsilon`).
const LAYER_NORM_EPS: f32 = 1e-5;

/// llama.cpp's name of a GPT-2 layout tensor, and whether it is a `Conv1D`
/// weight (stored transposed).
fn gguf_name(hf: &str) -> Option<(String, bool)> {
    let top = match hf {
        "transformer.wte.weight" => Some("token_embd.weight"),
        "transformer.wpe.weight" => Some("position_embd.weight"),
        "transformer.ln_f.weight" => Some("output_norm.weight"),
        "transformer.ln_f.bias" => Some("output_norm.bias"),
        _ => None,
    };
    if let Some(t) = top {
        return Some((t.into(), false));
    }
    let (layer, part) = hf.strip_prefix("transformer.h.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = part.rsplit_once('.')?;
    let g = match module {
        "ln_1" => "attn_norm",
        "attn.c_attn" => "attn_qkv",
        "attn.c_proj" => "attn_output",
        "ln_2" => "ffn_norm",
        "mlp.c_fc" => "ffn_up",
        "mlp.c_proj" => "ffn_down",
        _ => return None,
    };
    let conv1d = kind == "weight" && !module.starts_with("ln_");
    Some((format!("blk.{layer}.{g}.{kind}"), conv1d))
}

fn u32_of(key: &str, v: usize) -> Result<Value, String> {
    u32::try_from(v).map(Value::U32).map_err(|_| format!("{key} = {v} does not fit GGUF's u32"))
}

/// GPT-2 `cfg` with parameters `params` (in `layout`'s order) as a GGUF
/// model of llama.cpp's `gpt2` architecture, named `name`.
pub fn gguf_model<'a>(
    name: &str,
    cfg: &GptConfig,
    layout: &ParamLayout,
    params: &'a [f32],
) -> Result<GgufModel<'a>, String> {
    if layout.n_params() != params.len() {
        return Err(format!("{} parameters to write, the model has {}", params.len(), layout.n_params()));
    }
    let mut tensors = Vec::with_capacity(layout.tensors().len() + 1);
    let mut head = None;
    for t in layout.tensors() {
        let (g, conv1d) = gguf_name(&t.name).ok_or_else(|| format!("`{}` has no llama.cpp gpt2 name", t.name))?;
        let tensor = match (conv1d, &t.shape[..]) {
            // [in, out] → [out, in].
            (true, &[rows, cols]) => GgufTensor::new(g, &[cols, rows], &params[t.range()], GgufLayout::Transpose),
            _ => GgufTensor::new(g, &t.shape, &params[t.range()], GgufLayout::Same),
        };
        if tensor.name == "token_embd.weight" {
            head = Some(GgufTensor { name: "output.weight".into(), ..tensor.clone() });
        }
        tensors.push(tensor);
    }
    // The head after the final norm, where the converter puts it.
    tensors.extend(head);
    let mut metadata = vec![
        ("general.architecture".to_string(), Value::String("gpt2".into())),
        ("general.name".to_string(), Value::String(name.into())),
    ];
    for (key, v) in [
        ("block_count", cfg.n_layer),
        ("context_length", cfg.block_size),
        ("embedding_length", cfg.n_embd),
        ("feed_forward_length", 4 * cfg.n_embd),
        ("attention.head_count", cfg.n_head),
    ] {
        let key = format!("gpt2.{key}");
        metadata.push((key.clone(), u32_of(&key, v)?));
    }
    metadata.push(("gpt2.attention.layer_norm_epsilon".into(), Value::F32(LAYER_NORM_EPS)));
    Ok(GgufModel { metadata, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_transposes_follow_llama_cpp() {
        let g = gguf_name;
        assert_eq!(g("transformer.h.2.attn.c_attn.weight"), Some(("blk.2.attn_qkv.weight".into(), true)));
        assert_eq!(g("transformer.h.2.attn.c_attn.bias"), Some(("blk.2.attn_qkv.bias".into(), false)));
        assert_eq!(g("transformer.h.0.ln_2.weight"), Some(("blk.0.ffn_norm.weight".into(), false)));
        assert_eq!(g("transformer.h.0.mlp.c_proj.weight"), Some(("blk.0.ffn_down.weight".into(), true)));
        assert_eq!(g("transformer.wpe.weight"), Some(("position_embd.weight".into(), false)));
        assert_eq!(g("transformer.h.0.attn.bias"), None);
    }

    #[test]
    fn conv1d_weights_are_transposed() {
        let cfg = GptConfig { n_layer: 1, n_head: 2, n_embd: 4, block_size: 8, vocab_size: 16 };
        let model = crate::Gpt::new(cfg).unwrap();
        let layout = engine::Model::layout(&model);
        let params: Vec<f32> = (0..layout.n_params()).map(|i| i as f32).collect();
        let m = gguf_model("t", &cfg, layout, &params).unwrap();
        let hf = layout.get("transformer.h.0.attn.c_attn.weight").unwrap();
        let qkv = m.tensors.iter().find(|t| t.name == "blk.0.attn_qkv.weight").unwrap();
        // HF [in = 4, out = 12]; GGUF ne [4, 12]: row o (an output) holds column o of HF's.
        assert_eq!(qkv.ne, [4, 12]);
        assert_eq!(qkv.values()[4 * 5 + 3], params[hf.range()][3 * 12 + 5]);
        let last = m.tensors.last().unwrap();
        assert_eq!((last.name.as_str(), last.values()), ("output.weight", m.tensors[0].values()));
        assert_eq!(m.tensors.len(), layout.tensors().len() + 1);
    }
}
