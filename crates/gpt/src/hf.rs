//! Hugging Face GPT-2 checkpoints: `model.safetensors` + `config.json`, with
//! `GPT2LMHeadModel`'s tensor names and `Conv1D` layouts, so `transformers`
//! loads our files as they are and we load theirs.

use crate::config::GptConfig;
use crate::error::GptError;
use engine::ParamLayout;
use safetensors::tensor::{SafeTensors, TensorView};
use std::path::Path;

/// File name of the weights.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> GptError + '_ {
    move |source| nn::io::io_err(path)(source).into()
}

fn bad(path: &Path, problem: impl Into<String>) -> GptError {
    nn::io::bad(path, problem).into()
}

/// `config.json` in the format of `transformers`' `GPT2Config`.
pub fn config_json(cfg: &GptConfig) -> serde_json::Value {
    // GPT-2's <|endoftext|> is token 50256; a byte-level vocabulary has none.
    let eot = (cfg.vocab_size > 50256).then_some(50256);
    serde_json::json!({
        "bos_token_id": eot,
        "eos_token_id": eot,
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    })
}

/// Saves `params` (laid out by `layout`) and the config into `dir`: every
/// tensor but LoRA adapters (a LoRA model's base; its adapters go
/// beside it in PEFT's files, `crate::lora::save_adapter`).
pub fn save(dir: &Path, cfg: &GptConfig, layout: &ParamLayout, params: &[f32]) -> Result<(), GptError> {
    save_with_base(dir, cfg, (layout, params), None)
}

/// [`save`] of a layout that may leave the `Conv1D` weights out: those
/// are written from the packed `base`, dequantised one at a time.
pub fn save_with_base(
    dir: &Path,
    cfg: &GptConfig,
    (layout, params): (&ParamLayout, &[f32]),
    base: Option<&crate::FrozenBase>,
) -> Result<(), GptError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let plain = crate::Gpt::new(*cfg)?;
    let mut heads = Vec::new();
    let mut sources = Vec::new();
    for t in engine::Model::layout(&plain).tensors() {
        let src = match (layout.get(&t.name), crate::frozen::conv_of(&t.name)) {
            (Some(s), _) => Ok(s.range()),
            (None, Some(at)) if base.is_some() => Err(at),
            _ => return Err(bad(dir, format!("no values for tensor `{}`", t.name))),
        };
        heads.push((t.name.clone(), t.shape.clone()));
        sources.push(src);
    }
    let mut data = |i: usize| match &sources[i] {
        Ok(r) => std::borrow::Cow::Borrowed(&params[r.clone()]),
        Err((b, j)) => std::borrow::Cow::Owned(base.map_or(Vec::new(), |f| f.dequantize(*b, *j))),
    };
    nn::io::write_safetensors_with(&dir.join(WEIGHTS_FILE), &heads, &[], &mut data)?;
    let cfg_path = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(&config_json(cfg)).map_err(|e| bad(&cfg_path, e.to_string()))?;
    Ok(nn::io::write_atomic(&cfg_path, text.as_bytes())?)
}

/// Reads a `GPT2Config`-style `config.json`.
pub fn load_config(path: &Path) -> Result<GptConfig, GptError> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
    let field =
        |names: &[&str]| -> Result<usize, GptError> {
            names.iter().find_map(|n| v.get(*n).and_then(|x| x.as_u64())).map(|x| x as usize).ok_or_else(|| {
                bad(path, format!("missing integer field `{}` (is this a GPT-2 config.json?)", names[0]))
            })
        };
    if let Some(act) = v.get("activation_function").and_then(|a| a.as_str()) {
        if !matches!(act, "gelu_new" | "gelu_pytorch_tanh") {
            return Err(bad(
                path,
                format!("activation_function `{act}` is not supported; GPT-2 uses gelu_new (tanh GELU)"),
            ));
        }
    }
    let cfg = GptConfig {
        n_layer: field(&["n_layer"])?,
        n_head: field(&["n_head"])?,
        n_embd: field(&["n_embd"])?,
        block_size: field(&["n_positions", "n_ctx"])?,
        vocab_size: field(&["vocab_size"])?,
    };
    if let Some(inner) = v.get("n_inner").and_then(|x| x.as_u64()) {
        if inner as usize != 4 * cfg.n_embd {
            return Err(bad(
                path,
                format!(
                    "n_inner = {inner} is not 4 × n_embd = {}; only the standard MLP width is supported",
                    4 * cfg.n_embd
                ),
            ));
        }
    }
    cfg.validate().map_err(|e| bad(path, e.to_string()))?;
    Ok(cfg)
}

/// Tensors a Hugging Face file may hold that are not parameters of ours.
fn is_known_extra(name: &str) -> bool {
    name == "lm_head.weight"
        || name.ends_with(".attn.bias") && !name.contains("c_attn")
        || name.ends_with(".attn.masked_bias")
}

/// Loads weights from a safetensors file into a fresh flat buffer laid out by
/// `layout`. Names may carry the `transformer.` prefix or not (the Hub's
/// `gpt2` file does not). LoRA adapters of the layout are not in the base's
/// file: they are left zero (`crate::lora::init_in_place` starts them).
pub fn load_weights(path: &Path, layout: &ParamLayout) -> Result<Vec<f32>, GptError> {
    load_weights_with(path, layout, &mut |_, _| Ok(false))
}

/// A tensor of the file that is not in the layout: whether it was taken
/// (read or deliberately skipped), by its name in the file.
pub type Other<'a> = &'a mut dyn FnMut(&str, &TensorView<'_>) -> Result<bool, GptError>;

/// [`load_weights`], every tensor of the file outside `layout` handed to
/// `other` first: one it does not take (and that is no known extra) is
/// an error.
pub fn load_weights_with(path: &Path, layout: &ParamLayout, other: Other<'_>) -> Result<Vec<f32>, GptError> {
    let bytes = nn::io::map_file(path)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(path, format!("not a valid safetensors file ({e}); it may be truncated or corrupt")))?;
    // Fallible: a config.json that claims a huge model is an error, not an abort.
    let mut params = Vec::new();
    params.try_reserve_exact(layout.n_params()).map_err(|_| {
        bad(path, format!("cannot allocate {} bytes for the parameters", 4 * layout.n_params() as u128))
    })?;
    params.resize(layout.n_params(), 0.0f32);
    let mut used = std::collections::HashSet::new();
    for spec in layout.tensors().iter().filter(|t| !nn::lora::is_adapter(&t.name)) {
        let short = spec.name.strip_prefix("transformer.").unwrap_or(&spec.name);
        let (name, view) = [spec.name.as_str(), short]
            .iter()
            .find_map(|n| st.tensor(n).ok().map(|v| (n.to_string(), v)))
            .ok_or_else(|| bad(path, format!("tensor `{}` is missing", spec.name)))?;
        if view.shape() != spec.shape.as_slice() {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}` has shape {:?} but the model needs {:?} (is config.json from the same model?)",
                    view.shape(),
                    spec.shape
                ),
            ));
        }
        nn::io::decode_into(view.dtype(), view.data(), &mut params[spec.range()])
            .map_err(|e| bad(path, format!("tensor `{name}` {e}")))?;
        nn::io::release_pages(&bytes, view.data());
        used.insert(name);
    }
    let mut unexpected = Vec::new();
    for (name, view) in st.iter().filter(|(n, _)| !used.contains(*n)) {
        if !other(name, &view)? && !is_known_extra(name) {
            unexpected.push(name.to_string());
        }
        nn::io::release_pages(&bytes, view.data());
    }
    if !unexpected.is_empty() {
        unexpected.sort();
        unexpected.truncate(5);
        return Err(bad(
            path,
            format!("unexpected tensors {unexpected:?}: the file does not hold a GPT-2 of this shape"),
        ));
    }
    Ok(params)
}

/// Loads `config.json` and `model.safetensors` from `dir`.
pub fn load(dir: &Path) -> Result<(GptConfig, Vec<f32>), GptError> {
    let cfg = load_config(&dir.join(CONFIG_FILE))?;
    let model = crate::Gpt::new(cfg)?;
    let params = load_weights(&dir.join(WEIGHTS_FILE), engine::Model::layout(&model))?;
    Ok((cfg, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{init_params, Gpt};
    use engine::Model;
    use std::path::PathBuf;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("macrobatch-hf-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn round_trips_by_name_and_shape() {
        let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 8, block_size: 6, vocab_size: 11 };
        let params = init_params(&cfg, 1);
        let model = Gpt::new(cfg).unwrap();
        let dir = tmpdir("rt");
        save(&dir, &cfg, model.layout(), &params).unwrap();
        let (cfg2, params2) = load(&dir).unwrap();
        assert_eq!(cfg2, cfg);
        assert_eq!(params2, params, "bit-identical");
        // Every tensor is stored under its Hugging Face name with its shape.
        let bytes = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("transformer.h.1.attn.c_attn.weight").unwrap().shape(), &[8, 24]);
        assert_eq!(st.tensor("transformer.h.0.mlp.c_proj.weight").unwrap().shape(), &[32, 8]);
        assert_eq!(st.len(), model.layout().tensors().len());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mismatched_or_truncated_files_are_named_errors() {
        let cfg = GptConfig { n_layer: 1, n_head: 2, n_embd: 8, block_size: 6, vocab_size: 11 };
        let model = Gpt::new(cfg).unwrap();
        let dir = tmpdir("bad");
        save(&dir, &cfg, model.layout(), &init_params(&cfg, 1)).unwrap();
        let other = Gpt::new(GptConfig { n_embd: 4, ..cfg }).unwrap();
        let e = load_weights(&dir.join(WEIGHTS_FILE), other.layout()).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("shape"), "{e}");
        let deeper = Gpt::new(GptConfig { n_layer: 2, ..cfg }).unwrap();
        let e = load_weights(&dir.join(WEIGHTS_FILE), deeper.layout()).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
        let w = dir.join(WEIGHTS_FILE);
        let bytes = std::fs::read(&w).unwrap();
        std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
        let e = load(&dir).unwrap_err().to_string();
        assert!(e.contains("truncated or corrupt"), "{e}");
        std::fs::write(dir.join(CONFIG_FILE), "{\"n_layer\": 1}").unwrap();
        assert!(load(&dir).unwrap_err().to_string().contains("n_head"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
