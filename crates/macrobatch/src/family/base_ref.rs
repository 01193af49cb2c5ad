//! A LoRA run's frozen base by reference. The base a run trains adapters
//! on never changes, and it is already on disk (`train.frozen_source`,
//! the `--init-from` file or folder), so a LoRA run's checkpoints and its
//! final folder hold only what training changes: the adapters in PEFT's
//! format, their optimizer state and the sampler's position, and
//! `base.json` naming the base by path and SHA-256. Reading such a folder
//! reads the base from that path again — exactly as the run read it at
//! its start — after checking its bytes are the ones the run trained on;
//! a base changed or gone is refused, naming the fix.

use super::{load_hf, Build, Family};
use crate::digest::sha256_files;
use anyhow::{bail, Context, Result};
use engine::ParamLayout;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The file in a folder that holds the reference.
pub const FILE: &str = "base.json";

/// A frozen base as a run read it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BaseRef {
    /// The GGUF file or Hugging Face folder, absolute (links kept: a
    /// cache's link names the file's type, its target may not).
    pub path: PathBuf,
    /// The values the run held it as ([`held_as`]): the file's own, or
    /// rounded to `bf16` / `nf4` / `nf4-dq`. Another rounding: another base.
    #[serde(default)]
    pub held_as: String,
    /// The files that hold it (the GGUF file; a folder's `config.json` and
    /// safetensors files, with their index), by name, in hashing order.
    pub files: Vec<String>,
    /// Their bytes together.
    pub bytes: u64,
    /// SHA-256 of their contents one after another, in `files`' order.
    pub sha256: String,
}

impl BaseRef {
    /// The base at `path` as it is now (its files read and hashed), held
    /// as `held_as` says.
    pub fn of(path: &Path, held_as: String) -> Result<Self> {
        if !path.exists() {
            bail!("the frozen base {} cannot be found", path.display());
        }
        let path = std::path::absolute(path).with_context(|| format!("{}: no absolute path", path.display()))?;
        let files = files_of(&path)?;
        let full: Vec<PathBuf> =
            files.iter().map(|f| if path.is_dir() { path.join(f) } else { path.clone() }).collect();
        let (bytes, sha256) = sha256_files(&full.iter().map(PathBuf::as_path).collect::<Vec<_>>())?;
        Ok(Self { path, held_as, files, bytes, sha256 })
    }

    /// The reference in the folder `dir`, if it has one.
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(FILE);
        if !dir.is_dir() || !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        Ok(Some(serde_json::from_str(&text).with_context(|| format!("{} is corrupt", path.display()))?))
    }

    /// Writes the reference into the folder `dir` (atomically).
    pub fn write(&self, dir: &Path) -> Result<()> {
        nn::io::write_atomic(&dir.join(FILE), serde_json::to_string_pretty(self)?.as_bytes())?;
        Ok(())
    }

    /// `now` (the base as it is at `now.path`, held as the reader holds
    /// it) is this base, byte for byte and held alike; else an error saying
    /// what changed, for the folder `dir`, ending with `fix`.
    pub fn same_as(&self, now: &BaseRef, dir: &Path, fix: &str) -> Result<()> {
        if !self.held_as.is_empty() && now.held_as != self.held_as {
            bail!(
                "{}: the run held its frozen base as {}, this one would hold it as {}: rounded otherwise, it is another base. Keep the run's train.frozen_dtype (and frozen_double_quant, and a split that keeps it packed)",
                dir.display(),
                self.held_as,
                now.held_as
            );
        }
        if (&now.files, now.bytes, &now.sha256) == (&self.files, self.bytes, &self.sha256) {
            return Ok(());
        }
        bail!(
            "{}: its frozen base is not the one it was trained on: {} holds {} ({} bytes, sha256 {}), the run read {} ({} bytes, sha256 {}); adapters on another base are another model. Put the run's base back at {} ({fix})",
            dir.display(),
            now.path.display(),
            now.files.join(", "),
            now.bytes,
            now.sha256,
            self.files.join(", "),
            self.bytes,
            self.sha256,
            self.path.display()
        )
    }

    /// The base at its path checked to be this one, byte for byte (for the
    /// folder `dir`, read with its own config: held as the run held it).
    pub fn check(&self, dir: &Path) -> Result<()> {
        let fix = format!("or write the path of a copy of it into {}", dir.join(FILE).display());
        if !self.path.exists() {
            bail!(
                "{}: its frozen base {} is gone ({} bytes, sha256 {}): the folder holds only the adapters. Put the base back at that path ({fix})",
                dir.display(),
                self.path.display(),
                self.bytes,
                self.sha256
            );
        }
        self.same_as(&Self::of(&self.path, self.held_as.clone())?, dir, &fix)
    }
}

/// [`held_as`] of a run that keeps its base file's own values.
pub const FILE_VALUES: &str = "its file's values";

/// The values a run of `cfg` holds its frozen base as: the file's own
/// (`f32`, `auto` and `source` keep them, packed or not, at any split), or
/// rounded to `bf16`, `nf4`, `nf4-dq`.
pub fn held_as(cfg: &config::Config) -> String {
    match cfg.train.frozen_dtype {
        config::FrozenDtype::Auto | config::FrozenDtype::F32 | config::FrozenDtype::Source => FILE_VALUES.into(),
        config::FrozenDtype::Bf16 => "bf16".into(),
        config::FrozenDtype::Nf4 if cfg.train.frozen_double_quant => "nf4-dq".into(),
        config::FrozenDtype::Nf4 => "nf4".into(),
    }
}

/// The files of the model at `path` a reference hashes, by name.
fn files_of(path: &Path) -> Result<Vec<String>> {
    if !path.is_dir() {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        return name.map(|n| vec![n]).with_context(|| format!("{} is not a model file", path.display()));
    }
    let entries = std::fs::read_dir(path).with_context(|| format!("cannot list {}", path.display()))?;
    let mut files = Vec::new();
    for e in entries {
        let name = e.with_context(|| format!("cannot list {}", path.display()))?.file_name();
        let name = name.to_string_lossy();
        if name == super::CONFIG_FILE || name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json") {
            files.push(name.into_owned());
        }
    }
    files.sort();
    if !files.iter().any(|f| f.ends_with(".safetensors")) {
        bail!("{} holds no safetensors weights: it is no base model", path.display());
    }
    Ok(files)
}

/// Writes `params`' adapters into `dir` with the reference to `base` and
/// `config.json`: the folder `save_hf` would write, without the base.
pub fn save(dir: &Path, family: &dyn Family, (layout, params): (&ParamLayout, &[f32]), base: &BaseRef) -> Result<()> {
    let config = serde_json::to_string_pretty(&family.hf_config())?;
    nn::io::write_atomic(&dir.join(super::CONFIG_FILE), config.as_bytes())?;
    family.save_adapters(dir, layout, params, &base.path.display().to_string())?;
    base.write(dir)
}

/// The parameters of `family` (a LoRA shape) a run starts from on the base
/// at `source`: the base as the run reads it (a packed base's other
/// tensors, else the whole model dequantised), adapters as initialised.
pub fn params_from_base(family: &dyn Family, source: &Path) -> Result<Vec<f32>> {
    let context = || format!("cannot read the frozen base {}", source.display());
    let base = match family.frozen_bytes() {
        Some(_) => family.load_unfrozen(source).with_context(context)?,
        None => load_hf(source).with_context(context)?.1,
    };
    Ok(family.start_from_pretrained(base, 0)?)
}

/// The parameters of the adapters-only folder `dir` for `family` (its
/// shape, or that shape with the base packed): the base read from `base`
/// (checked first) and the folder's adapters.
pub fn load(dir: &Path, family: &dyn Family, base: &BaseRef) -> Result<Vec<f32>> {
    base.check(dir)?;
    with_adapters(dir, family, &base.path)
}

/// The parameters of `family` on the base at `source` ([`params_from_base`])
/// with the adapters of the folder `dir` in place of the initial ones.
pub fn with_adapters(dir: &Path, family: &dyn Family, source: &Path) -> Result<Vec<f32>> {
    let mut params = params_from_base(family, source)?;
    let model = family.build(Build::default())?;
    family.load_adapters(dir, model.layout(), &mut params)?;
    super::check_finite(model.layout(), &params, dir)?;
    Ok(params)
}
