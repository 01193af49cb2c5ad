//! Reading a frozen base from its file (a GGUF file or a Hugging Face
//! folder) one tensor at a time into [`FrozenBase`]'s packed matrices,
//! keeping a file's own 16-bit or block-quantised bytes where asked.

use crate::config::LlamaConfig;
use crate::dialect::Dialect;
use crate::error::LlamaError;
use crate::frozen::{pack, stored_projs, FrozenBase, FrozenFormat};
use crate::layout::Proj;
use family::safetensors_format;
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

/// Whether `source` is a GGUF file (by its name).
fn is_gguf(source: &Path) -> bool {
    source.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The stored type of every projection weight of `source` (a GGUF file or
/// a Hugging Face folder), from its metadata alone, with the packed format
/// that keeps it (`None`: none does, e.g. F32): what `train.frozen_dtype =
/// "source"` keeps, what `"auto"` decides on, what a plan counts.
/// A fused weight (Phi-3's `qkv_proj`) counts as each of its parts.
pub fn source_formats(
    (dialect, cfg): (&dyn Dialect, &LlamaConfig),
    source: &Path,
) -> Result<Vec<(String, String, Option<PackFormat>)>, LlamaError> {
    let mut out = Vec::new();
    let mut push = |name: &str, dtype: &str, fmt: Option<PackFormat>| {
        if let Some((layer, parts)) = stored_projs(name, cfg) {
            for (pr, _) in parts {
                out.push((format!("model.layers.{layer}.{}.weight", pr.path()), dtype.to_string(), fmt));
            }
        }
    };
    if is_gguf(source) {
        let file = open_gguf(dialect, source)?;
        for (g, name) in file.tensor_names() {
            if stored_projs(&name, cfg).is_some() {
                let t = file.raw_tensor(&g).map_err(|e| hf_read(source, e))?;
                push(&name, t.ty.name, gguf_format(t.ty));
            }
        }
    } else {
        for (name, dtype) in crate::hf::stored_dtypes(source)? {
            push(&name, &dtype, safetensors_format(&dtype));
        }
    }
    Ok(out)
}

/// The token embedding's name (also the tied head).
const EMBED: &str = "model.embed_tokens.weight";

/// The packed format that keeps `source`'s token embedding as it is stored
/// (a GGUF's Q8_0 / Q4_0 / Q4_1 / F16 / BF16 blocks, a safetensors file's
/// 16-bit values); `None` for F32 or another type: what decides whether a
/// model read for `generate` / `eval` keeps its embedding packed.
pub fn embed_format(dialect: &dyn Dialect, source: &Path) -> Result<Option<PackFormat>, LlamaError> {
    if is_gguf(source) {
        let file = open_gguf(dialect, source)?;
        for (g, name) in file.tensor_names() {
            if name == EMBED {
                return Ok(gguf_format(file.raw_tensor(&g).map_err(|e| hf_read(source, e))?.ty));
            }
        }
        return Ok(None);
    }
    let stored = crate::hf::stored_dtypes(source)?;
    Ok(stored.into_iter().find(|(n, _)| n == EMBED).and_then(|(_, dtype)| safetensors_format(&dtype)))
}

/// The token embedding `[rows, cols]` from its stored `bytes`, packed as
/// `kept` stores it (`None`: not a packed type, refused).
fn embedding(
    (source, cfg): (&Path, &LlamaConfig),
    (rows, cols): (usize, usize),
    kept: Option<PackFormat>,
    bytes: &[u8],
) -> Result<PackedMatrix, LlamaError> {
    if [rows, cols] != [cfg.vocab_size, cfg.hidden_size] {
        let want = [cfg.vocab_size, cfg.hidden_size];
        return Err(LlamaError::ShapeMismatch { name: EMBED.into(), got: vec![rows, cols], expected: want.to_vec() });
    }
    let fmt = kept.ok_or_else(|| hf_read(source, format!("`{EMBED}` is not stored in a packed type")))?;
    PackedMatrix::from_raw(rows, cols, fmt, bytes.to_vec()).map_err(|e| hf_read(source, e))
}

/// A tensor's f32 values, read when asked.
type Values<'a> = &'a dyn Fn() -> Result<Vec<f32>, LlamaError>;

/// The packed matrices of the projections `parts` (rows of a stored
/// `[rows, cols]` weight `name`) as `fmt`: slices of its own bytes `kept`
/// (whole rows) when they are `fmt`'s, else packed from its f32 `values`.
fn pack_parts(
    (name, rows, cols): (&str, usize, usize),
    parts: Vec<(Proj, std::ops::Range<usize>)>,
    fmt: PackFormat,
    (kept, values): (Option<&[u8]>, Values<'_>),
) -> Result<Vec<(Proj, PackedMatrix)>, LlamaError> {
    if parts.last().map(|(_, r)| r.end) != Some(rows) {
        let want: Vec<usize> = parts.iter().map(|(_, r)| r.len()).collect();
        return Err(LlamaError::config(name, format!("has {rows} rows, its projections {want:?}")));
    }
    let raw = |bytes: Vec<u8>, rows| {
        PackedMatrix::from_raw(rows, cols, fmt, bytes).map_err(|e| LlamaError::config(name, e.to_string()))
    };
    match kept {
        Some(bytes) => {
            let rb = bytes.len() / rows.max(1);
            parts.into_iter().map(|(pr, r)| Ok((pr, raw(bytes[r.start * rb..r.end * rb].to_vec(), r.len())?))).collect()
        }
        None => {
            let w = values()?;
            parts
                .into_iter()
                .map(|(pr, r)| Ok((pr, pack(r.len(), cols, &w[r.start * cols..r.end * cols], fmt)?)))
                .collect()
        }
    }
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
    format.target(name, stored, kept).map_err(|e| LlamaError::config("train.frozen_dtype", e))
}

/// The frozen base of `cfg` read from `source` (a GGUF file or a Hugging
/// Face folder) one tensor at a time, packed as `format` says, and, given
/// `rest` (the packed layout without adapters), every other tensor in it —
/// without, they are not read at all. A GGUF tensor kept as `source` is its
/// file's bytes, with llama.cpp's Q/K row permutation undone on whole rows;
/// the f32 values of one tensor at most exist at a time. With `embed`, the
/// token embedding is kept packed as stored too ([`embed_format`]; `rest`
/// then leaves it out).
pub fn load(
    (dialect, cfg): (&dyn Dialect, &LlamaConfig),
    source: &Path,
    (format, embed): (FrozenFormat, bool),
    rest: Option<engine::ParamLayout>,
) -> Result<(FrozenBase, Option<Vec<f32>>), LlamaError> {
    let mut mats = Vec::with_capacity(7 * cfg.n_layer);
    let mut table = None;
    let rest = if is_gguf(source) {
        let file = open_gguf(dialect, source)?;
        let mut others = Vec::new();
        for (g, name) in file.tensor_names() {
            if embed && name == EMBED {
                let raw = file.raw_tensor(&g).map_err(|e| hf_read(source, e))?;
                let [rows, cols] = raw.shape[..] else {
                    return Err(hf_read(source, format!("`{name}` is not a matrix")));
                };
                table = Some(embedding((source, cfg), (rows, cols), gguf_format(raw.ty), raw.bytes)?);
                nn::io::release_pages(file.file().mapped(), raw.bytes);
                continue;
            }
            let Some((layer, parts)) = stored_projs(&name, cfg) else {
                others.push(g);
                continue;
            };
            let raw = file.raw_tensor(&g).map_err(|e| hf_read(source, e))?;
            let kept = gguf_format(raw.ty);
            let fmt = target(format, &name, raw.ty.name, kept)?;
            let [rows, cols] = raw.shape[..] else {
                let expected = parts.iter().map(|(pr, _)| pr.shape(cfg)).collect::<Vec<_>>().concat();
                return Err(LlamaError::ShapeMismatch { name, got: raw.shape, expected });
            };
            let values = || Ok(file.tensor(&g).map_err(|e| hf_read(source, e))?.2);
            let packed = match (&raw.row_order, kept == Some(fmt)) {
                // llama.cpp's Q/K row order, undone on whole rows (one projection's weight).
                (Some(order), true) => {
                    let m =
                        PackedMatrix::from_raw(rows, cols, fmt, raw.bytes.to_vec()).map_err(|e| hf_read(source, e))?;
                    let [(pr, _)] = &parts[..] else {
                        return Err(hf_read(source, format!("`{name}`: permuted rows of a fused weight")));
                    };
                    vec![(*pr, m.permute_rows(order).map_err(|e| hf_read(source, e))?)]
                }
                (_, true) => pack_parts((&name, rows, cols), parts, fmt, (Some(raw.bytes), &values))?,
                (_, false) => pack_parts((&name, rows, cols), parts, fmt, (None, &values))?,
            };
            nn::io::release_pages(file.file().mapped(), raw.bytes);
            mats.extend(packed.into_iter().map(|(pr, m)| (layer, pr, m)));
        }
        match rest {
            Some(layout) => Some(crate::hf::from_gguf_into((layout, cfg.fused_weights()), cfg, &file, &others)?),
            None => None,
        }
    } else {
        let wanted = rest.is_some();
        let layout = rest.unwrap_or_default();
        let rest = crate::hf::load_weights_into(source, cfg, layout, &mut |name, shape, view| {
            if embed && name == EMBED {
                let [rows, cols] = shape[..] else { return Ok(false) };
                let kept = safetensors_format(&format!("{:?}", view.dtype()));
                table = Some(embedding((source, cfg), (rows, cols), kept, view.data())?);
                return Ok(true);
            }
            // Without `rest` every other tensor is taken, unread.
            let Some((layer, parts)) = stored_projs(name, cfg) else { return Ok(!wanted) };
            let stored = format!("{:?}", view.dtype());
            let kept = safetensors_format(&stored);
            let fmt = target(format, name, &stored, kept)?;
            let [rows, cols] = shape[..] else { return Ok(false) };
            let values = || crate::hf::decode_view(name, view);
            let bytes = (kept == Some(fmt)).then(|| view.data());
            let packed = pack_parts((name, rows, cols), parts, fmt, (bytes, &values))?;
            mats.extend(packed.into_iter().map(|(pr, m)| (layer, pr, m)));
            Ok(true)
        })?;
        wanted.then_some(rest)
    };
    let base = FrozenBase::from_matrices(cfg, mats)?;
    let base = match table {
        Some(m) => base.with_embedding(m),
        None if embed => return Err(hf_read(source, format!("no `{EMBED}` to keep packed"))),
        None => base,
    };
    Ok((base, rest))
}
