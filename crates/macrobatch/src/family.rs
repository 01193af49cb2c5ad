//! The registry of model families. Planning, training, memory checks,
//! checkpoints, Hugging Face / GGUF I/O and generation see a model only
//! through the `family` crate's [`Family`] and [`LanguageModel`]; this module
//! finds the family a config, a model folder or a GGUF file names, in
//! [`FAMILIES`]. A new family is a crate implementing `family::Registration`
//! plus one line in that list.

pub mod base_ref;

use anyhow::{bail, Context, Result};
use config::ModelConfig;
use engine::ParamLayout;
pub use family::{Build, Family, FrozenStorage, LanguageModel, Loaded, Registration, CONFIG_FILE, WEIGHTS_FILE};
use std::path::Path;
use std::sync::Arc;

/// Every family the binary knows, each registered once by its crate.
pub static FAMILIES: &[&dyn Registration] = &[
    &gpt::FAMILY,
    &llama::FAMILY,
    &qwen2::FAMILY,
    &qwen3::FAMILY,
    &mistral::FAMILY,
    &phi3::FAMILY,
    &gemma2::FAMILY,
    &mixtral::FAMILY,
    &qwen2::MOE_FAMILY,
    &qwen3::MOE_FAMILY,
];

/// The names `model.family` may take, for messages.
fn known() -> String {
    FAMILIES.iter().map(|r| r.family()).collect::<Vec<_>>().join(", ")
}

/// The registered family called `name` (`model.family`, `model_type`).
fn registered(name: &str) -> Option<&'static dyn Registration> {
    FAMILIES.iter().copied().find(|r| r.family() == name)
}

/// The family and shape `[model]` (and `[lora]`) ask for.
pub fn from_config(m: &ModelConfig, lora: Option<&toml::Table>) -> Result<Arc<dyn Family>> {
    let Some(r) = registered(&m.family) else {
        bail!(
            "model.family = \"{}\" is not a family macrobatch knows; choose one of {} (presets: {})",
            m.family,
            known(),
            presets()
        );
    };
    Ok(r.for_config(m, lora)?)
}

/// The presets of every family, as `family: preset, …; …` (for errors).
fn presets() -> String {
    FAMILIES.iter().map(|r| format!("{}: {}", r.family(), r.presets().join(", "))).collect::<Vec<_>>().join("; ")
}

/// The GGUF file `path`, open, and the family that loads its
/// `general.architecture` (the file is read once).
fn gguf_family(path: &Path) -> Result<(&'static dyn Registration, gguf::GgufFile)> {
    let file = gguf::GgufFile::open(path)?;
    let arch = file.get_str("general.architecture")?;
    let Some(r) = FAMILIES.iter().copied().find(|r| r.gguf_architecture() == Some(arch)) else {
        let loads: Vec<_> = FAMILIES.iter().filter_map(|r| r.gguf_architecture()).collect();
        bail!(
            "{}: GGUF architecture `{arch}` is not one macrobatch loads (it loads {}); convert the model to a Hugging Face folder (config.json + model.safetensors) instead",
            path.display(),
            loads.join(", ")
        );
    };
    Ok((r, file))
}

/// The family and shape of a saved model: the `config.json` in `dir` (by
/// its `model_type`; none means GPT-2, as transformers' oldest files), or
/// a GGUF file's metadata.
pub fn read_hf_config(dir: &Path) -> Result<Arc<dyn Family>> {
    if is_gguf(dir) {
        let (r, file) = gguf_family(dir)?;
        return Ok(r.gguf_shape(file)?);
    }
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
    let model_type = match json.get("model_type") {
        None => config::DEFAULT_FAMILY,
        Some(v) => v.as_str().with_context(|| format!("{}: model_type {v} is not a string", path.display()))?,
    };
    let Some(r) = registered(model_type) else {
        bail!("{}: model_type `{model_type}` is not a family macrobatch knows (it trains {})", path.display(), known());
    };
    Ok(r.for_hf_dir(dir, &json)?)
}

/// The parameter count as the start-up lines print it: the layout's, and
/// the frozen values held packed outside it (`30.79M params + 103.94M
/// frozen in q4_1+q8_0`).
pub fn params_label(f: &dyn Family) -> String {
    let mut label = format!("{:.2}M params", f.n_params() as f64 / 1e6);
    if let Some(fb) = f.frozen_bytes() {
        label += &format!(" + {:.2}M frozen in {}", fb.values as f64 / 1e6, fb.formats);
    }
    label
}

/// Whether `path` is a GGUF model file (by its name).
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A saved model — a Hugging Face folder (`config.json` + weights, with
/// PEFT adapters beside them) or a GGUF file (dequantised to f32) — as its
/// family and parameters. (Adapters with a [`base_ref`] instead of the
/// base: `saved::load_whole`.)
pub fn load_hf(dir: &Path) -> Result<Loaded> {
    if is_gguf(dir) {
        let (r, file) = gguf_family(dir)?;
        let (family, params) = r.load_gguf(file)?;
        let model = family.build(Build::default())?;
        check_finite(model.layout(), &params, dir)?;
        return Ok((family, params));
    }
    let family = read_hf_config(dir)?;
    let model = family.build(Build::default())?;
    let params = family.load_weights(dir, model.layout())?;
    check_finite(model.layout(), &params, dir)?;
    Ok((family, params))
}

/// Every loaded weight is finite; else the first NaN or infinity is named by
/// tensor and element (a damaged file, or one saved after a diverged step,
/// would otherwise surface as a NaN loss blamed on the learning rate).
pub fn check_finite(layout: &ParamLayout, params: &[f32], source: &Path) -> Result<()> {
    let Some(n) = layout.first_non_finite(params) else { return Ok(()) };
    bail!(
        "{}: tensor `{}` (shape {:?}) holds {} at element {:?}, {} non-finite value(s) in all; the weights are damaged or were saved after training diverged. Load another copy of the model (or an earlier checkpoint)",
        source.display(),
        n.tensor,
        n.shape,
        n.value,
        n.index,
        n.count
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_registered_once_and_builds_its_presets() {
        let mut names: Vec<_> = FAMILIES.iter().map(|r| r.family()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len(), "a family registered twice");
        for r in FAMILIES {
            for preset in r.presets() {
                let m =
                    ModelConfig { family: r.family().into(), preset: Some(preset.to_string()), ..Default::default() };
                let f = from_config(&m, None).unwrap_or_else(|e| panic!("{} {preset}: {e:#}", r.family()));
                // The shape pins into [model] and rebuilds to the same config.json.
                let mut pinned = ModelConfig::default();
                f.pin_shape(&mut pinned);
                assert_eq!(pinned.family, r.family());
                let g = from_config(&pinned, None).unwrap_or_else(|e| panic!("{} {preset}: {e:#}", r.family()));
                assert_eq!(f.hf_config(), g.hf_config(), "{} {preset}", r.family());
            }
        }
        let e = from_config(&ModelConfig { family: "bert".into(), ..Default::default() }, None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("\"bert\"") && e.contains("gpt2, llama"), "{e}");
    }
}
