//! A frozen base read from its file into packed matrices: how each weight
//! is packed (`train.frozen_dtype`), what a plan counts before the file is
//! read, and which stored types keep their bytes. The packed weights are
//! read through [`crate::proj::Frozen`].

use crate::linear::PackFormat;

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
pub type StoredWeights = [(String, String, Option<PackFormat>)];

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
