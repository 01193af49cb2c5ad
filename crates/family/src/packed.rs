//! A LoRA run's frozen base kept packed outside a family's layout: what
//! `train.frozen_dtype` asks of a family's weights (checked before the file
//! is read), how each weight is packed as it is read, what a plan counts,
//! and the base itself, read once per process.

use crate::{BoxError, FrozenBytes, FrozenStorage, Result};
use config::FrozenDtype;
use linalg::packed::PackFormat;
use std::path::Path;
use std::sync::Arc;

/// A frozen base kept packed outside a family's layout: the file it is
/// read from, the bytes it takes, and (once the first model is built) the
/// base itself, shared by every model of the process (thread ranks hold
/// one copy).
#[derive(Debug)]
pub struct PackedSource<B> {
    /// Where the base is read from (`None`: a plan of a shape, never built).
    pub source: Option<std::path::PathBuf>,
    /// Its formats and bytes, as planned before it is read.
    pub planned: FrozenBytes,
    loaded: std::sync::Mutex<Option<Arc<B>>>,
}

/// What reads a frozen base from its file: the base and, when asked
/// (`true`), the layout's other tensors.
pub type ReadBase<'a, B> = &'a dyn Fn(&Path, bool) -> std::result::Result<(B, Option<Vec<f32>>), BoxError>;

impl<B> PackedSource<B> {
    /// A base to be read from `source`, planned as `planned`.
    pub fn new(source: Option<std::path::PathBuf>, planned: FrozenBytes) -> Self {
        Self { source, planned, loaded: std::sync::Mutex::new(None) }
    }

    /// The base, read by `read` on first use; also the layout's other
    /// tensors when `want_rest` (they are read again then: a model built
    /// after the run's start does not need them).
    pub fn get(&self, want_rest: bool, read: ReadBase<'_, B>) -> Result<(Arc<B>, Option<Vec<f32>>)> {
        let mut slot = self.loaded.lock().map_err(|_| "the frozen base's loader panicked on another rank")?;
        if let (Some(b), false) = (slot.as_ref(), want_rest) {
            return Ok((b.clone(), None));
        }
        let Some(source) = &self.source else {
            return Err("a packed frozen base is read from a pretrained model: pass --init-from (a GGUF file or a Hugging Face folder) or set train.frozen_source".into());
        };
        let (base, rest) = read(source, want_rest).map_err(|e| format!("{}: {}", source.display(), chain(&*e)))?;
        let base = slot.get_or_insert_with(|| Arc::new(base)).clone();
        Ok((base, rest))
    }

    /// The layout's other tensors read from `source`, which must be the
    /// base's own file ([`crate::Family::load_unfrozen`]).
    pub fn load_unfrozen(&self, source: &Path, read: ReadBase<'_, B>) -> Result<Vec<f32>> {
        if self.source.as_deref() != Some(source) {
            return Err(format!(
                "the frozen base is read from {}, the other tensors from {}: they must be one model",
                self.source.as_deref().unwrap_or(Path::new("nowhere")).display(),
                source.display()
            )
            .into());
        }
        Ok(self.get(true, read)?.1.unwrap_or_default())
    }
}

/// `e` and every cause below it, joined by `: ` (a file error's cause is
/// what is wrong in the file).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}

/// How each frozen projection is packed as it is read from its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrozenFormat {
    /// Every projection in this format (quantised or rounded from its values).
    Pack(PackFormat),
    /// Each projection in the format its source stores it in.
    Source,
}

impl FrozenFormat {
    /// The format a weight `name` stored as `stored` is packed in (`kept`:
    /// the packed format of its own bytes, if any); the error says why
    /// `"source"` cannot keep it and what to set instead.
    pub fn target(self, name: &str, stored: &str, kept: Option<PackFormat>) -> Result<PackFormat, String> {
        match self {
            FrozenFormat::Pack(f) => Ok(f),
            FrozenFormat::Source => kept.ok_or_else(|| {
                format!(
                    "\"source\" keeps each frozen projection in its file's format, but `{name}` is stored as {stored}, which has no packed form (F16, BF16, Q8_0, Q4_0, Q4_1 do); set train.frozen_dtype = \"bf16\" or \"nf4\""
                )
            }),
        }
    }
}

/// A source's stored weights: `(name, stored type, the packed format that
/// keeps it)`.
pub type StoredWeights = [StoredWeight];

/// One stored weight of a source: its name, stored type and the packed
/// format that keeps it.
pub type StoredWeight = (String, String, Option<PackFormat>);

impl FrozenFormat {
    /// The formats (joined by `+`) and bytes of a base packed as `self`
    /// says: every weight in one format (`all_in`: the model's bytes in it),
    /// or each of `stored` in its own (`shape`: its `[rows, cols]`). A
    /// stored weight no packed format keeps is refused, naming `key`, the
    /// `source` and the fix.
    pub fn planned(
        self,
        (key, source): (&str, Option<&std::path::Path>),
        stored: &StoredWeights,
        shape: &dyn Fn(&str) -> [usize; 2],
        all_in: &dyn Fn(PackFormat) -> u128,
    ) -> Result<(String, u128), String> {
        if let FrozenFormat::Pack(f) = self {
            return Ok((f.name().into(), all_in(f)));
        }
        let (mut names, mut bytes) = (Vec::new(), 0u128);
        for (name, dtype, kept) in stored {
            let Some(f) = kept else {
                return Err(format!(
                    "{key}: `{name}` is stored as {dtype} in {}, which has no packed form (F16, BF16, Q8_0, Q4_0, Q4_1 do); set train.frozen_dtype = \"bf16\" or \"nf4\"",
                    source.unwrap_or(std::path::Path::new("the source")).display()
                ));
            };
            let [rows, cols] = shape(name);
            bytes += f.bytes_for(rows, cols);
            if !names.contains(&f.name()) {
                names.push(f.name());
            }
        }
        Ok((names.join("+"), bytes))
    }
}

/// The packed format that keeps a safetensors dtype's values as they are
/// (`F16`, `BF16`; none for `F32`).
pub fn safetensors_format(dtype: &str) -> Option<PackFormat> {
    match dtype {
        "F16" => Some(PackFormat::F16),
        "BF16" => Some(PackFormat::Bf16),
        _ => None,
    }
}

/// What `s` asks of a family whose frozen weights are `weights` (each
/// `(name, [rows, cols])` as packed, a row's values in blocks), their
/// stored types read from the source by `stored_of`: `None` keeps them in
/// the layout (`f32`, or `auto` on a source that is not all 16-bit, or
/// without one); otherwise the format and the source's stored weights
/// (none without a source: a plan counts a named format from the shape).
/// Refused, naming the key and the fix: a file's own format asked for
/// without a file (`files`: what may be given), rows a format's blocks do
/// not divide (before the file is read).
pub fn frozen_packing(
    s: &FrozenStorage,
    stored_of: &dyn Fn(&Path) -> Result<Vec<StoredWeight>>,
    weights: &[(&str, [usize; 2])],
    files: &str,
) -> Result<Option<(FrozenFormat, Vec<StoredWeight>)>> {
    let key = format!("train.frozen_dtype = \"{}\"", s.dtype.name());
    let format = match s.dtype {
        FrozenDtype::F32 => return Ok(None),
        FrozenDtype::Bf16 => FrozenFormat::Pack(PackFormat::Bf16),
        FrozenDtype::Nf4 => FrozenFormat::Pack(PackFormat::Nf4 { double_quant: s.double_quant }),
        FrozenDtype::Source | FrozenDtype::Auto => FrozenFormat::Source,
    };
    let stored = match &s.source {
        Some(p) => stored_of(p)?,
        None if matches!(format, FrozenFormat::Pack(_)) => Vec::new(),
        None if s.packs_by_name() => {
            return Err(format!("{key} keeps the base in its file's format, and no file is given: pass --init-from ({files}) or set train.frozen_source = PATH").into())
        }
        None => return Ok(None),
    };
    if s.dtype == FrozenDtype::Auto {
        let sixteen = |f: &Option<PackFormat>| matches!(f, Some(PackFormat::Bf16 | PackFormat::F16));
        if stored.is_empty() || !stored.iter().all(|(_, _, f)| sixteen(f)) {
            return Ok(None);
        }
    }
    if let (FrozenFormat::Pack(f), Some(source)) = (format, &s.source) {
        for &(name, [rows, cols]) in weights {
            if !cols.is_multiple_of(f.block()) {
                return Err(format!(
                    "{key} cannot pack {}'s `{name}` weights ([{rows}, {cols}] as packed): {} packs each row in blocks of {} values, and {cols} is not a multiple of {}; set train.frozen_dtype = \"bf16\" (or \"f32\") for this model",
                    source.display(),
                    f.name(),
                    f.block(),
                    f.block()
                )
                .into());
            }
        }
    }
    Ok(Some((format, stored)))
}
