//! Hugging Face Llama checkpoints: `config.json` + `model.safetensors` (or
//! shards listed by `model.safetensors.index.json`), F32/F16/BF16 read as
//! f32, written as F32 with `LlamaForCausalLM`'s names, so transformers
//! loads our files as they are and we load theirs. Any other source of
//! named tensors (a GGUF reader, say) goes through [`from_named_tensors`],
//! the same checks.

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::layout::{fused_weight, part_names, stored_as, Fused};
use crate::model::Llama;
use engine::{Model, ParamLayout};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// File name of the weights (one file).
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the shard index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";
/// The untied head's name, also found (and checked) in tied checkpoints.
const HEAD: &str = "lm_head.weight";
const EMBED: &str = "model.embed_tokens.weight";

/// One named tensor: `(name, shape, values)`.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LlamaError + '_ {
    move |source| LlamaError::Read(nn::io::io_err(path)(source))
}

pub(crate) fn bad(path: &Path, problem: impl Into<String>) -> LlamaError {
    LlamaError::Read(nn::io::bad(path, problem))
}

/// Decodes one stored tensor into `dst` (exactly its length) as f32.
fn decode(name: &str, view: &TensorView<'_>, dst: &mut [f32]) -> Result<(), LlamaError> {
    nn::io::decode_into(view.dtype(), view.data(), dst).map_err(|_| match view.dtype() {
        Dtype::F32 | Dtype::F16 | Dtype::BF16 => LlamaError::ShapeMismatch {
            name: name.to_string(),
            got: vec![view.data().len() / if view.dtype() == Dtype::F32 { 4 } else { 2 }],
            expected: vec![dst.len()],
        },
        other => LlamaError::UnsupportedDtype { name: name.to_string(), dtype: format!("{other:?}") },
    })
}

/// Runs `f(name, view)` on every tensor of a safetensors file, in name order.
fn for_each_tensor(
    path: &Path,
    mut f: impl FnMut(&str, &TensorView<'_>) -> Result<(), LlamaError>,
) -> Result<(), LlamaError> {
    let bytes = nn::io::map_file(path).map_err(LlamaError::Read)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(path, format!("not a valid safetensors file ({e}); it may be truncated or corrupt")))?;
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in &tensors {
        f(name, view).map_err(|e| e.in_file(path))?;
        nn::io::release_pages(&bytes, view.data());
    }
    Ok(())
}

/// Every tensor of a safetensors file as f32 (F32, F16 and BF16 are read),
/// in name order.
pub fn read_tensors(path: &Path) -> Result<Vec<NamedTensor>, LlamaError> {
    let mut out = Vec::new();
    for_each_tensor(path, |name, view| {
        let mut data = vec![0.0; view.shape().iter().product()];
        decode(name, view, &mut data)?;
        out.push((name.to_string(), view.shape().to_vec(), data));
        Ok(())
    })?;
    Ok(out)
}

/// Puts named tensors into a flat buffer laid out like the base model of a
/// configuration, checking each against the layout.
struct Placer {
    layout: ParamLayout,
    index: HashMap<String, usize>,
    params: Vec<f32>,
    seen: Vec<bool>,
    /// `lm_head.weight` of a tied checkpoint: must equal the embedding.
    tied_head: Option<Vec<f32>>,
    tied: bool,
    unexpected: Vec<String>,
    /// Layout tensors a file need not hold (adapters beside a base).
    may_be_absent: fn(&str) -> bool,
    /// Weights the file stores fused (each placed over its parts' ranges).
    fused: &'static [Fused],
}

impl Placer {
    /// A placer into `layout` (of a model of `cfg`).
    fn for_layout(layout: ParamLayout, cfg: &LlamaConfig) -> Result<Self, LlamaError> {
        let index = layout.tensors().iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        // Fallible: a config that claims a huge model is an error, not an abort.
        let mut params = Vec::new();
        params.try_reserve_exact(layout.n_params()).map_err(|_| {
            LlamaError::config("config", format!("{} parameters do not fit in memory", layout.n_params()))
        })?;
        params.resize(layout.n_params(), 0.0f32);
        let seen = vec![false; layout.tensors().len()];
        Ok(Self {
            layout,
            index,
            params,
            seen,
            tied_head: None,
            tied: cfg.tie_word_embeddings,
            unexpected: Vec::new(),
            may_be_absent: |_| false,
            fused: &[],
        })
    }

    /// Places tensor `name` of `shape`; `fill` writes its values into the
    /// slice it is given (exactly `shape`'s size).
    fn put(
        &mut self,
        name: &str,
        shape: &[usize],
        fill: impl FnOnce(&mut [f32]) -> Result<(), LlamaError>,
    ) -> Result<(), LlamaError> {
        let check_shape = |expected: &[usize]| {
            if shape == expected {
                Ok(())
            } else {
                Err(LlamaError::ShapeMismatch {
                    name: name.to_string(),
                    got: shape.to_vec(),
                    expected: expected.to_vec(),
                })
            }
        };
        if let Some((layer, f)) = fused_weight(name, self.fused) {
            return self.put_fused(name, shape, part_names(layer, f), fill);
        }
        if let Some(&i) = self.index.get(name) {
            let spec = &self.layout.tensors()[i];
            check_shape(&spec.shape)?;
            if std::mem::replace(&mut self.seen[i], true) {
                return Err(LlamaError::DuplicateTensor { name: name.to_string() });
            }
            return fill(&mut self.params[spec.range()]);
        }
        if name == HEAD && self.tied {
            let embed = &self.layout.tensors()[0];
            check_shape(&embed.shape)?;
            if self.tied_head.is_some() {
                return Err(LlamaError::DuplicateTensor { name: name.to_string() });
            }
            let mut head = vec![0.0; embed.numel()];
            fill(&mut head)?;
            self.tied_head = Some(head);
        } else if !name.ends_with(".rotary_emb.inv_freq") {
            // (Older transformers saved RoPE's inverse frequencies as a buffer; we compute them.)
            self.unexpected.push(name.to_string());
        }
        Ok(())
    }

    /// Places the fused weight `name` of `shape` over its parts `parts`
    /// (layout names), which the layout keeps back to back: the file's
    /// `[Σ out, in]` is their rows stacked.
    fn put_fused(
        &mut self,
        name: &str,
        shape: &[usize],
        parts: Vec<String>,
        fill: impl FnOnce(&mut [f32]) -> Result<(), LlamaError>,
    ) -> Result<(), LlamaError> {
        let Some(idx) = parts.iter().map(|p| self.index.get(p).copied()).collect::<Option<Vec<usize>>>() else {
            self.unexpected.push(name.to_string());
            return Ok(());
        };
        let specs: Vec<_> = idx.iter().map(|&i| self.layout.tensors()[i].clone()).collect();
        let mut expected = specs[0].shape.clone();
        expected[0] = specs.iter().map(|s| s.shape[0]).sum();
        if shape != expected.as_slice() {
            return Err(LlamaError::ShapeMismatch { name: name.to_string(), got: shape.to_vec(), expected });
        }
        if specs.windows(2).any(|w| w[0].range().end != w[1].range().start) {
            return Err(LlamaError::config(name, format!("its parts {parts:?} are not back to back in this layout")));
        }
        for &i in &idx {
            if std::mem::replace(&mut self.seen[i], true) {
                return Err(LlamaError::DuplicateTensor { name: name.to_string() });
            }
        }
        let whole = specs[0].range().start..specs[specs.len() - 1].range().end;
        fill(&mut self.params[whole])
    }

    fn finish(mut self) -> Result<Vec<f32>, LlamaError> {
        if !self.unexpected.is_empty() {
            self.unexpected.sort();
            self.unexpected.truncate(5);
            return Err(LlamaError::UnexpectedTensors { names: self.unexpected });
        }
        let tensors = self.layout.tensors();
        if let Some(i) = self.seen.iter().enumerate().position(|(i, s)| !s && !(self.may_be_absent)(&tensors[i].name)) {
            return Err(LlamaError::MissingTensor { name: tensors[i].name.clone() });
        }
        if let Some(head) = &self.tied_head {
            let embed = &self.params[self.layout.tensors()[0].range()];
            debug_assert_eq!(self.layout.tensors()[0].name, EMBED);
            if let Some(first_diff) = head.iter().zip(embed).position(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(LlamaError::TiedHeadMismatch { first_diff });
            }
        }
        Ok(self.params)
    }
}

/// Parameters of the base model of `cfg` (layout of [`Llama::new`]) from
/// named tensors with Hugging Face names and shapes — what a loader of
/// another format (GGUF, already dequantised, Q/K already un-permuted)
/// hands over. Every missing, extra, duplicated or misshaped tensor is a
/// named error; with `tie_word_embeddings` an `lm_head.weight` may be
/// present and must equal the embedding.
pub fn from_named_tensors(
    cfg: &LlamaConfig,
    tensors: impl IntoIterator<Item = NamedTensor>,
) -> Result<Vec<f32>, LlamaError> {
    from_named_tensors_into(Llama::new(cfg.clone())?.layout().clone(), cfg, tensors)
}

/// [`from_named_tensors`] into `layout` (a model of `cfg`).
pub(crate) fn from_named_tensors_into(
    layout: ParamLayout,
    cfg: &LlamaConfig,
    tensors: impl IntoIterator<Item = NamedTensor>,
) -> Result<Vec<f32>, LlamaError> {
    let mut placer = Placer::for_layout(layout, cfg)?;
    for (name, shape, data) in tensors {
        placer.put(&name, &shape, |dst| {
            if data.len() != dst.len() {
                return Err(LlamaError::ShapeMismatch {
                    name: name.clone(),
                    got: vec![data.len()],
                    expected: shape.clone(),
                });
            }
            dst.copy_from_slice(&data);
            Ok(())
        })?;
    }
    placer.finish()
}

/// [`from_named_tensors_into`] from the tensors `names` (GGUF names) of a
/// GGUF file, each dequantised straight into its place in the parameters:
/// loading holds the parameters and no second copy of any tensor (the
/// embedding alone is 113 MB of f32 in SmolLM2-135M). The weights `fused`
/// are split into their parts; gains stored as `1 + w` are shifted back.
pub(crate) fn from_gguf_into(
    (layout, fused): (ParamLayout, &'static [Fused]),
    cfg: &LlamaConfig,
    file: &gguf::llama::LlamaGguf,
    names: &[String],
) -> Result<Vec<f32>, LlamaError> {
    let mut placer = Placer::for_layout(layout, cfg)?;
    placer.fused = fused;
    for g in names {
        let (name, shape) = file.hf_shape(g)?;
        let one_plus = crate::export::stores_one_plus(cfg, &name);
        placer.put(&name, &shape, |dst| {
            file.tensor_into(g, dst)?;
            if one_plus {
                dst.iter_mut().for_each(|x| *x -= 1.0);
            }
            Ok(())
        })?;
        nn::io::release_pages(file.file().mapped(), file.file().tensor_bytes(g)?.1);
    }
    placer.finish()
}

/// Reads a Hugging Face `config.json`.
pub fn load_config(path: &Path) -> Result<LlamaConfig, LlamaError> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
    LlamaConfig::from_hf_json(&v).map_err(|e| e.in_file(path))
}

/// The safetensors files holding a model directory's weights:
/// `model.safetensors`, or else the shards `model.safetensors.index.json`
/// lists, each with the tensor names the index assigns to it.
fn weight_files(dir: &Path) -> Result<Vec<(PathBuf, BTreeSet<String>)>, LlamaError> {
    let single = dir.join(WEIGHTS_FILE);
    if single.exists() {
        return Ok(vec![(single, BTreeSet::new())]);
    }
    let index = dir.join(INDEX_FILE);
    if !index.exists() {
        return Err(bad(dir, format!("holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")));
    }
    let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(&index, format!("not valid JSON: {e}")))?;
    let map =
        v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad(&index, "has no `weight_map` object"))?;
    let mut shards: HashMap<String, BTreeSet<String>> = HashMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| bad(&index, format!("weight_map[{name}] is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
            return Err(bad(&index, format!("shard `{file}` is not a plain file name in this directory")));
        }
        shards.entry(file.to_string()).or_default().insert(name.clone());
    }
    let mut files: Vec<_> = shards.into_iter().map(|(f, names)| (dir.join(f), names)).collect();
    files.sort();
    Ok(files)
}

/// Loads the weights of the model directory `dir` for `cfg`.
pub fn load_weights(dir: &Path, cfg: &LlamaConfig) -> Result<Vec<f32>, LlamaError> {
    load_weights_stored_as(dir, cfg, &[])
}

/// [`load_weights`] of a family whose files store the weights `fused`
/// (Phi-3's `qkv_proj`, `gate_up_proj`); their parts' names are read too.
pub fn load_weights_stored_as(dir: &Path, cfg: &LlamaConfig, fused: &'static [Fused]) -> Result<Vec<f32>, LlamaError> {
    let layout = Llama::new(cfg.clone())?.layout().clone();
    load_weights_with(dir, cfg, layout, &mut |_, _, _| Ok(false), (|_| false, fused))
}

/// The base weights of `dir` placed straight into `layout`, a model of
/// `cfg` with adapters, whose adapter tensors (which the base file does
/// not hold) are left zero for [`crate::lora::init_in_place`]: loading a
/// LoRA model holds one copy of it, not the base and then the whole again.
///
/// With `packed` (the run's frozen base, packed, which `layout` leaves
/// out) each projection in the folder is checked against it, bit for bit,
/// and not placed: the folder's f32 base is what the packed one
/// dequantises to, unless the base file changed after the run. Weights
/// the shape stores fused (Phi-3's) are read as such.
pub(crate) fn load_base_into_adapted(
    dir: &Path,
    cfg: &LlamaConfig,
    layout: ParamLayout,
    packed: Option<&crate::FrozenBase>,
) -> Result<Vec<f32>, LlamaError> {
    let mut verify = |name: &str, _: &[usize], view: &TensorView<'_>| {
        let (Some(base), Some((layer, parts))) = (packed, crate::frozen::stored_projs(name, cfg)) else {
            return Ok(false);
        };
        // A fused weight is its parts' rows, stacked.
        let want: Vec<f32> = parts.iter().flat_map(|&(pr, _)| base.dequantize(cfg, layer, pr)).collect();
        let ours = decode_view(name, view)?;
        match ours.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits()) {
            None if ours.len() == want.len() => Ok(true),
            at => Err(LlamaError::config(
                "frozen base",
                format!(
                    "`{name}` in this folder differs from the packed base it was trained on (train.frozen_source) at element {}: that file changed after the run; restore it, or read the folder's own f32 base (generate / eval --dequantize)",
                    at.unwrap_or(ours.len().min(want.len()))
                ),
            )),
        }
    };
    load_weights_with(dir, cfg, layout, &mut verify, (nn::lora::is_adapter, cfg.fused_weights()))
}

/// Offered each stored tensor `(name, shape, view)` before it is placed;
/// `true`: taken (not placed).
pub(crate) type TakeTensor<'a> = dyn FnMut(&str, &[usize], &TensorView<'_>) -> Result<bool, LlamaError> + 'a;

/// Loads the weights of `dir` into `layout` (a model of `cfg`), each
/// tensor first offered to `take(name, shape, view)`: one it takes (a
/// frozen projection it packs) is not placed.
pub(crate) fn load_weights_into(
    dir: &Path,
    cfg: &LlamaConfig,
    layout: ParamLayout,
    take: &mut TakeTensor<'_>,
) -> Result<Vec<f32>, LlamaError> {
    load_weights_with(dir, cfg, layout, take, (|_| false, &[]))
}

/// [`load_weights_into`], where the layout's tensors `may_be_absent` names
/// need not be in the files, which store the weights `fused` fused.
fn load_weights_with(
    dir: &Path,
    cfg: &LlamaConfig,
    layout: ParamLayout,
    take: &mut TakeTensor<'_>,
    (may_be_absent, fused): (fn(&str) -> bool, &'static [Fused]),
) -> Result<Vec<f32>, LlamaError> {
    let files = weight_files(dir)?;
    let mut placer = Placer::for_layout(layout, cfg)?;
    placer.may_be_absent = may_be_absent;
    placer.fused = fused;
    for (path, listed) in &files {
        let mut found = BTreeSet::new();
        for_each_tensor(path, |name, view| {
            if !listed.is_empty() && !listed.contains(name) {
                return Err(bad(path, format!("holds `{name}`, which {INDEX_FILE} does not assign to it")));
            }
            found.insert(name.to_string());
            if take(name, view.shape(), view)? {
                return Ok(());
            }
            placer.put(name, view.shape(), |dst| decode(name, view, dst))
        })?;
        if let Some(name) = listed.difference(&found).next() {
            return Err(bad(path, format!("{INDEX_FILE} assigns `{name}` to this shard, but it is not there")));
        }
    }
    let located = if files.len() == 1 && files[0].1.is_empty() { files[0].0.clone() } else { dir.join(INDEX_FILE) };
    placer.finish().map_err(|e| e.in_file(&located))
}

/// A stored tensor's values as f32 (F32, F16, BF16).
pub(crate) fn decode_view(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, LlamaError> {
    let mut out = vec![0.0; view.shape().iter().product()];
    decode(name, view, &mut out)?;
    Ok(out)
}

/// Loads `config.json` and the weights of a Hugging Face model directory.
pub fn load(dir: &Path) -> Result<(LlamaConfig, Vec<f32>), LlamaError> {
    let cfg = load_config(&dir.join(CONFIG_FILE))?;
    let params = load_weights(dir, &cfg)?;
    Ok((cfg, params))
}

/// The named tensors of `params` laid out by `layout`, for writing.
pub(crate) fn named<'a>(layout: &ParamLayout, params: &'a [f32], prefix: &str) -> Vec<(String, Vec<usize>, &'a [f32])> {
    layout.tensors().iter().map(|t| (format!("{prefix}{}", t.name), t.shape.clone(), &params[t.range()])).collect()
}

/// Saves the base tensors of `model`'s parameters `params` — every tensor
/// but LoRA adapters, so a LoRA model's frozen base — as `model.safetensors`
/// and `config.json`, straight from `params` (no copy of the base).
pub fn save_base(dir: &Path, model: &Llama, params: &[f32]) -> Result<(), LlamaError> {
    save_base_with_config(dir, model, params, &model.config().to_hf_json())
}

/// [`save_base`] with `config` as `config.json` (a family on the Llama
/// block writes its own dialect of it).
pub fn save_base_with_config(
    dir: &Path,
    model: &Llama,
    params: &[f32],
    config: &serde_json::Value,
) -> Result<(), LlamaError> {
    save_base_packed(dir, model, params, (None, &[]), config)
}

/// [`save_base_with_config`] of a model whose projections are packed in
/// `base`: the whole model in `LlamaForCausalLM`'s order, each projection
/// dequantised as it is written (one tensor's f32 values at a time); the
/// weights `fused` written fused, as the family's files store them.
pub fn save_base_packed(
    dir: &Path,
    model: &Llama,
    params: &[f32],
    (base, fused): (Option<&crate::FrozenBase>, &[Fused]),
    config: &serde_json::Value,
) -> Result<(), LlamaError> {
    let layout = model.layout();
    LlamaError::check_count("model", layout.n_params(), params.len())?;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let cfg = model.config();
    // Where each tensor's values come from: the parameters, or the packed base.
    let mut heads = Vec::new();
    let mut sources = Vec::new();
    let plain = Llama::new(cfg.clone())?;
    for t in plain.layout().tensors() {
        let src = match (layout.get(&t.name), base, crate::frozen::proj_of(&t.name)) {
            (Some(s), _, _) => Ok(s.range()),
            (None, Some(_), Some(lp)) => Err(lp),
            _ => return Err(LlamaError::MissingTensor { name: t.name.clone() }),
        };
        heads.push((t.name.clone(), t.shape.clone()));
        sources.push(src);
    }
    // Each written tensor: the plain layout's tensors it stacks (one, or a
    // fused weight's parts, which follow each other in that layout).
    let mut pieces: Vec<std::ops::Range<usize>> = (0..heads.len()).map(|i| i..i + 1).collect();
    if !fused.is_empty() {
        let tensors = heads.drain(..).zip(pieces).map(|((n, s), i)| (n, s, i)).collect();
        let stored = stored_as(tensors, fused)
            .map_err(|part| LlamaError::config(&part, "is not beside the rest of its fused weight in the layout"))?;
        pieces = stored.iter().map(|(_, _, i)| i.clone()).collect();
        heads = stored.into_iter().map(|(n, s, _)| (n, s)).collect();
    }
    let value = |src: &Result<std::ops::Range<usize>, (usize, crate::layout::Proj)>| match src {
        Ok(r) => std::borrow::Cow::Borrowed(&params[r.clone()]),
        Err((layer, pr)) => std::borrow::Cow::Owned(base.map_or(Vec::new(), |b| b.dequantize(cfg, *layer, *pr))),
    };
    let mut data = |i: usize| {
        let srcs = &sources[pieces[i].clone()];
        // Parts back to back in the parameters are one range of them.
        let ranges: Option<Vec<_>> = srcs.iter().map(|s| s.clone().ok()).collect();
        match ranges.filter(|r| r.windows(2).all(|w| w[0].end == w[1].start)) {
            Some(r) if !r.is_empty() => std::borrow::Cow::Borrowed(&params[r[0].start..r[r.len() - 1].end]),
            _ => std::borrow::Cow::Owned(srcs.iter().flat_map(|s| value(s).into_owned()).collect()),
        }
    };
    nn::io::write_safetensors_with(&dir.join(WEIGHTS_FILE), &heads, &[], &mut data)?;
    let text = serde_json::to_string_pretty(config).map_err(|e| bad(dir, e.to_string()))?;
    nn::io::write_atomic(&dir.join(CONFIG_FILE), text.as_bytes())?;
    Ok(())
}

/// Saves base-model parameters (layout of [`Llama::new`]) and the config
/// into `dir` as `model.safetensors` (F32) and `config.json`, each written
/// atomically.
pub fn save(dir: &Path, cfg: &LlamaConfig, params: &[f32]) -> Result<(), LlamaError> {
    let model = Llama::new(cfg.clone())?;
    let layout = model.layout();
    LlamaError::check_count("base model", layout.n_params(), params.len())?;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    nn::io::write_safetensors(&dir.join(WEIGHTS_FILE), &named(layout, params, ""), &[])?;
    let text = serde_json::to_string_pretty(&cfg.to_hf_json()).map_err(|e| bad(dir, e.to_string()))?;
    nn::io::write_atomic(&dir.join(CONFIG_FILE), text.as_bytes())?;
    Ok(())
}

/// `(name, dtype)` of every tensor of the model folder `dir`, read from
/// the safetensors headers alone (no tensor data).
pub(crate) fn stored_dtypes(dir: &Path) -> Result<Vec<(String, String)>, LlamaError> {
    use std::io::Read;
    let mut out = Vec::new();
    for (path, _) in weight_files(dir)? {
        let mut f = std::fs::File::open(&path).map_err(io_err(&path))?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(io_err(&path))?;
        let len = u64::from_le_bytes(len);
        let size = f.metadata().map_err(io_err(&path))?.len();
        if len > size.saturating_sub(8) {
            return Err(bad(&path, format!("header of {len} bytes in a file of {size}: not a safetensors file")));
        }
        let mut head = vec![0u8; len as usize];
        f.read_exact(&mut head).map_err(io_err(&path))?;
        let v: serde_json::Value =
            serde_json::from_slice(&head).map_err(|e| bad(&path, format!("header is not valid JSON: {e}")))?;
        let Some(map) = v.as_object() else { return Err(bad(&path, "header is not a JSON object")) };
        for (name, t) in map.iter().filter(|(n, _)| n.as_str() != "__metadata__") {
            let dtype = t.get("dtype").and_then(|d| d.as_str()).unwrap_or("unknown");
            out.push((name.clone(), dtype.to_string()));
        }
    }
    Ok(out)
}
