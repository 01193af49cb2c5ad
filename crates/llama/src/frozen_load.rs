//! Reading a frozen base from its file (a GGUF file or a Hugging Face
//! folder) one tensor at a time into [`FrozenBase`]'s packed matrices,
//! keeping a file's own 16-bit or block-quantised bytes where asked.

use crate::config::LlamaConfig;
use crate::dialect::Dialect;
use crate::error::LlamaError;
use crate::frozen::{pack, proj_of, FrozenBase, FrozenFormat};
use gguf::llama::LlamaGguf;
use nn::linear::{PackFormat, PackedMatrix};
use std::path::Path;

/// The packed format that keeps a GGUF tensor type's blocks as they are.
fn gguf_format(ty: gguf::GgmlType) -> Option<PackFormat> {
    match ty.name {
        "F16" => Some(PackFormat::F16),
        "BF16" => Some(PackFormat::Bf16),
        "Q8_0" => Some(PackFormat::Q8_0),
        "Q4_0" => Some(PackFormat::Q4_0),
        "Q4_1" => Some(PackFormat::Q4_1),
        _ => None,
    }
}

/// The packed format that keeps a safetensors dtype's values as they are.
fn safetensors_format(dtype: &str) -> Option<PackFormat> {
    match dtype {
        "F16" => Some(PackFormat::F16),
        "BF16" => Some(PackFormat::Bf16),
        _ => None,
    }
}

/// Whether `source` is a GGUF file (by its name).
fn is_gguf(source: &Path) -> bool {
    source.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The stored type of every projection weight of `source` (a GGUF file or
/// a Hugging Face folder), from its metadata alone, with the packed format
/// that keeps it (`None`: none does, e.g. F32): what `train.frozen_dtype =
/// "source"` keeps, what `"auto"` decides on, what a plan counts.
pub fn source_formats(
    dialect: &dyn Dialect,
    source: &Path,
) -> Result<Vec<(String, String, Option<PackFormat>)>, LlamaError> {
    if is_gguf(source) {
        let file = open_gguf(dialect, source)?;
        let mut out = Vec::new();
        for (g, name) in file.tensor_names() {
            if proj_of(&name).is_some() {
                let t = file.raw_tensor(&g).map_err(|e| hf_read(source, e))?;
                out.push((name, t.ty.name.to_string(), gguf_format(t.ty)));
            }
        }
        return Ok(out);
    }
    let mut out = Vec::new();
    for (name, dtype) in crate::hf::stored_dtypes(source)? {
        if proj_of(&name).is_some() {
            let fmt = safetensors_format(&dtype);
            out.push((name, dtype, fmt));
        }
    }
    Ok(out)
}

fn hf_read(source: &Path, e: impl std::fmt::Display) -> LlamaError {
    crate::hf::bad(source, e.to_string())
}

/// The GGUF file `source` as `dialect` reads it ([`crate::import::open`]).
fn open_gguf(dialect: &dyn Dialect, source: &Path) -> Result<LlamaGguf, LlamaError> {
    let file = gguf::GgufFile::open(source).map_err(|e| hf_read(source, e))?;
    Ok(crate::import::open(dialect, file).map_err(|e| hf_read(source, e))?.1)
}

/// What `format` makes of a projection stored as `stored` (`kept`: the
/// packed format of its own bytes, if any).
fn target(format: FrozenFormat, name: &str, stored: &str, kept: Option<PackFormat>) -> Result<PackFormat, LlamaError> {
    match format {
        FrozenFormat::Pack(f) => Ok(f),
        FrozenFormat::Source => kept.ok_or_else(|| {
            LlamaError::config(
                "train.frozen_dtype",
                format!(
                    "\"source\" keeps each frozen projection in its file's format, but `{name}` is stored as {stored}, which has no packed form (F16, BF16, Q8_0, Q4_0, Q4_1 do); set train.frozen_dtype = \"bf16\" or \"nf4\""
                ),
            )
        }),
    }
}

/// The frozen base of `cfg` read from `source` (a GGUF file or a Hugging
/// Face folder) one tensor at a time, packed as `format` says, and, given
/// `rest` (the packed layout without adapters), every other tensor in it —
/// without, they are not read at all. A GGUF tensor kept as `source` is its
/// file's bytes, with llama.cpp's Q/K row permutation undone on whole rows;
/// the f32 values of one tensor at most exist at a time.
pub fn load(
    (dialect, cfg): (&dyn Dialect, &LlamaConfig),
    source: &Path,
    format: FrozenFormat,
    rest: Option<engine::ParamLayout>,
) -> Result<(FrozenBase, Option<Vec<f32>>), LlamaError> {
    let mut mats = Vec::with_capacity(7 * cfg.n_layer);
    let rest = if is_gguf(source) {
        let file = open_gguf(dialect, source)?;
        let mut others = Vec::new();
        for (g, name) in file.tensor_names() {
            let Some((layer, pr)) = proj_of(&name) else {
                others.push(g);
                continue;
            };
            let raw = file.raw_tensor(&g).map_err(|e| hf_read(source, e))?;
            let kept = gguf_format(raw.ty);
            let fmt = target(format, &name, raw.ty.name, kept)?;
            let [rows, cols] = raw.shape[..] else {
                return Err(LlamaError::ShapeMismatch { name, got: raw.shape, expected: pr.shape(cfg).to_vec() });
            };
            let m = if kept == Some(fmt) {
                let m = PackedMatrix::from_raw(rows, cols, fmt, raw.bytes.to_vec()).map_err(|e| hf_read(source, e))?;
                match &raw.row_order {
                    Some(order) => m.permute_rows(order).map_err(|e| hf_read(source, e))?,
                    None => m,
                }
            } else {
                let (_, _, w) = file.tensor(&g).map_err(|e| hf_read(source, e))?;
                pack(rows, cols, &w, fmt)?
            };
            nn::io::release_pages(file.file().mapped(), raw.bytes);
            mats.push((layer, pr, m));
        }
        match rest {
            Some(layout) => Some(crate::hf::from_gguf_into((layout, dialect.fused()), cfg, &file, &others)?),
            None => None,
        }
    } else {
        let wanted = rest.is_some();
        let layout = rest.unwrap_or_default();
        let rest = crate::hf::load_weights_into(source, cfg, layout, &mut |name, shape, view| {
            // Without `rest` every other tensor is taken, unread.
            let Some((layer, pr)) = proj_of(name) else { return Ok(!wanted) };
            let stored = format!("{:?}", view.dtype());
            let kept = safetensors_format(&stored);
            let fmt = target(format, name, &stored, kept)?;
            let [rows, cols] = shape[..] else { return Ok(false) };
            let m = if kept == Some(fmt) {
                PackedMatrix::from_raw(rows, cols, fmt, view.data().to_vec()).map_err(|e| hf_read(source, e))?
            } else {
                pack(rows, cols, &crate::hf::decode_view(name, view)?, fmt)?
            };
            mats.push((layer, pr, m));
            Ok(true)
        })?;
        wanted.then_some(rest)
    };
    Ok((FrozenBase::from_matrices(cfg, mats)?, rest))
}
