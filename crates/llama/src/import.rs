//! A llama.cpp file as a family on the Llama block: the inverse of
//! [`crate::export`]. The hyperparameters every relative of Llama writes
//! under `{arch}.` give the shape ([`gguf::llama::LlamaGguf::read`]); the
//! options a family fixes (q/k/v biases, q/k norms, Gemma's block) come
//! from its presets, Gemma 2's caps and window from its keys; the tensor
//! names are the ones `export::tensor_names` writes for that shape.
//! The shape is then read back through the family's own `config.json`
//! reader, so a file loads as exactly what the family's folder would.

use crate::export::{gemma_scalar, tensor_names};
use crate::{Dialect, GemmaBlock, Llama, LlamaConfig, LlamaError};
use engine::Model;
use family::Result;
use gguf::llama::LlamaGguf;
use gguf::GgufFile;

/// The shape and the named tensors of `file`, a GGUF file `dialect` loads
/// (its [`Dialect::gguf_arch`]). Errors name the file and what does not fit:
/// another architecture, a missing key, RoPE scaling, a tensor this shape
/// does not have.
pub fn open(dialect: &dyn Dialect, file: GgufFile) -> Result<(LlamaConfig, LlamaGguf)> {
    let arch = dialect.gguf_arch().ok_or_else(|| format!("{} models are not read from GGUF files", dialect.name()))?;
    let path = file.path().to_path_buf();
    let in_file = |e: String| format!("{}: {e}", path.display());
    let gguf_err = |e: gguf::GgufError| LlamaError::from(e);
    let model = LlamaGguf::read(file, arch.name).map_err(gguf_err)?;
    let shape = LlamaConfig::from_hf_json(model.config()).map_err(|e| in_file(e.to_string()))?;
    let fixed = dialect.preset("tiny")?;
    let key = |k: &str| format!("{}.{k}", arch.name);
    let f = model.file();
    let sliding_window = match f.get_u64_opt(&key("attention.sliding_window")).map_err(gguf_err)? {
        Some(w) if arch.sliding_window => Some(w as usize),
        _ => None,
    };
    let gemma = match fixed.gemma {
        None => None,
        Some(_) => Some(GemmaBlock {
            query_pre_attn_scalar: gemma_scalar(&shape) as f64,
            attn_softcap: f.get_f64_opt(&key("attn_logit_softcapping")).map_err(gguf_err)?,
            final_softcap: f.get_f64_opt(&key("final_logit_softcapping")).map_err(gguf_err)?,
        }),
    };
    // llama.cpp's gemma2 windows the even layers; every other family all or none.
    let sliding_layers =
        (gemma.is_some() && sliding_window.is_some()).then(|| (0..shape.n_layer).map(|i| i % 2 == 0).collect());
    let cfg = LlamaConfig {
        attention_bias: fixed.attention_bias,
        qk_norm: fixed.qk_norm,
        sliding_window,
        sliding_layers,
        gemma,
        ..shape
    };
    // Through the family's own reader: its checks, its defaults.
    let cfg = dialect.parse_hf_json(&dialect.hf_json(&cfg)).map_err(|e| in_file(e.to_string()))?;
    let layout = Llama::new(cfg.clone())?.layout().clone();
    let names = tensor_names((arch, dialect.fused()), &cfg, &layout)?.into_iter().map(|(_, t)| t).collect();
    Ok((cfg, model.with_names(names).map_err(gguf_err)?))
}
