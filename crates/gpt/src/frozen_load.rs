//! Reading a GPT-2 LoRA run's frozen base from its model folder one
//! `Conv1D` weight at a time into [`FrozenBase`]'s packed matrices.

use crate::config::GptConfig;
use crate::error::GptError;
use crate::frozen::{conv_of, FrozenBase};
use family::{safetensors_format, FrozenFormat};
use family::{BoxError, PackedSource};
use nn::linear::PackFormat;
use std::path::Path;
use std::sync::Arc;

/// The stored type of every `Conv1D` weight in the folder `dir`'s
/// `model.safetensors` (its header alone), with the packed format that
/// keeps it (`None`: none does, e.g. F32): what `train.frozen_dtype =
/// "source"` keeps and `"auto"` decides on.
pub fn source_formats(dir: &Path) -> Result<Vec<(String, String, Option<PackFormat>)>, GptError> {
    let path = dir.join(crate::hf::WEIGHTS_FILE);
    let bytes = nn::io::map_file(&path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        GptError::File(nn::io::bad(
            &path,
            format!("not a valid safetensors file ({e}); it may be truncated or corrupt"),
        ))
    })?;
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(name, _)| conv_of(name).is_some())
        .map(|(name, view)| {
            let dtype = format!("{:?}", view.dtype());
            let kept = safetensors_format(&dtype);
            (name, dtype, kept)
        })
        .collect();
    out.sort_by(|x, y| x.0.cmp(&y.0));
    Ok(out)
}

/// The frozen base of `cfg` read from the model folder `dir` one weight at
/// a time, packed as `format` says, and, given `rest` (the packed layout
/// without adapters), every other tensor of it: without, they are not
/// read. A 16-bit weight kept as `"source"` goes through f32 exactly.
pub fn load(
    cfg: &GptConfig,
    dir: &Path,
    format: FrozenFormat,
    rest: Option<engine::ParamLayout>,
) -> Result<(FrozenBase, Option<Vec<f32>>), GptError> {
    let wanted = rest.is_some();
    let layout = rest.unwrap_or_default();
    let mut mats = Vec::with_capacity(4 * cfg.n_layer);
    let path = dir.join(crate::hf::WEIGHTS_FILE);
    let params = crate::hf::load_weights_with(&path, &layout, &mut |name, view| {
        // Without `rest` every other tensor is taken, unread.
        let Some(at) = conv_of(name) else { return Ok(!wanted) };
        crate::frozen::check_stored(cfg, (name, at), view.shape(), &path)?;
        let stored = format!("{:?}", view.dtype());
        let fmt = format
            .target(name, &stored, safetensors_format(&stored))
            .map_err(|e| GptError::Setting(format!("train.frozen_dtype: {e}")))?;
        let mut w = vec![0.0; view.shape().iter().product()];
        nn::io::decode_into(view.dtype(), view.data(), &mut w)
            .map_err(|e| GptError::File(nn::io::bad(&path, format!("tensor `{name}` {e}"))))?;
        mats.push((at.0, at.1, FrozenBase::pack(cfg, at, &w, fmt)?));
        Ok(true)
    })?;
    Ok((FrozenBase::from_matrices(cfg, mats)?, wanted.then_some(params)))
}

/// A packed frozen base: its format and where and when it is read.
#[derive(Debug)]
pub(crate) struct Packed {
    pub format: FrozenFormat,
    pub base: PackedSource<FrozenBase>,
}

impl Packed {
    /// The base, read from its folder on first use.
    pub(crate) fn get(&self, cfg: &GptConfig) -> family::Result<Arc<FrozenBase>> {
        Ok(self.base.get(false, &|dir, rest| self.read(cfg, dir, rest))?.0)
    }

    /// The base from the folder `dir` and, when asked, the other tensors.
    pub(crate) fn read(&self, cfg: &GptConfig, dir: &Path, rest: bool) -> std::result::Result<Read, BoxError> {
        let layout = match rest {
            true => Some(engine::Model::layout(&crate::Gpt::with_packed_layout(*cfg, None)?).clone()),
            false => None,
        };
        Ok(load(cfg, dir, self.format, layout)?)
    }
}

/// A base and the other tensors read with it.
type Read = (FrozenBase, Option<Vec<f32>>);
