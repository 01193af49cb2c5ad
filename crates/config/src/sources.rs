//! `data.sources`: several data files mixed by weight, each with its own
//! format, schema and held-out share.

use crate::{invalid, ConfigError, DataConfig};
use data::{DataFormat, Schema};
use serde::{Deserialize, Serialize};

/// One entry of `data.sources`: a file (or folder) drawn from with
/// probability `weight / Σ weight` per sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// The file or folder.
    pub path: String,
    /// Relative weight (finite, > 0; 1 when unset).
    #[serde(default = "one")]
    pub weight: f64,
    /// Its format; unset: told by its name (`.parquet`, `.arrow` or a
    /// `save_to_disk` folder, `.jsonl` / `.json`, a token file by its
    /// `meta.json`, else text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<DataFormat>,
    /// How its records are read (formats with records); unset: `data.schema`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Schema>,
    /// Its share held out for validation (from its end); unset:
    /// `data.val_fraction`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_fraction: Option<f64>,
}

fn one() -> f64 {
    1.0
}

impl SourceConfig {
    /// The format it is read in: given, else detected from its path.
    pub fn format(&self) -> Result<DataFormat, data::DataError> {
        match self.format {
            Some(f) => Ok(f),
            None => DataFormat::detect(std::path::Path::new(&self.path)),
        }
    }
}

/// The checks of `data.sources` that need no file: not beside `data.path`
/// or `data.val_path`, not empty, each path given, each weight finite and
/// positive, each `val_fraction` in (0, 1), a schema only with a format
/// that has records.
pub(crate) fn validate(d: &DataConfig) -> Result<(), ConfigError> {
    let Some(sources) = &d.sources else { return Ok(()) };
    if let Some(p) = &d.path {
        return Err(invalid(
            "data.sources",
            format!("[… {} sources] with data.path = \"{p}\"", sources.len()),
            "give either data.path (one file) or data.sources (several, mixed by weight), not both; list data.path as one of the sources",
        ));
    }
    if let Some(v) = &d.val_path {
        return Err(invalid(
            "data.val_path",
            format!("\"{v}\""),
            "does not combine with data.sources: each source holds out its own last val_fraction (data.sources[i].val_fraction, default data.val_fraction) for validation; unset data.val_path",
        ));
    }
    if sources.is_empty() {
        return Err(invalid("data.sources", "[]", "list at least one { path, weight }, or unset it for data.path"));
    }
    for (i, s) in sources.iter().enumerate() {
        let at = |what: String| format!("[{i}] {what}");
        if s.path.is_empty() {
            return Err(invalid("data.sources", at("path = \"\"".into()), "give each source a file or folder"));
        }
        if !(s.weight.is_finite() && s.weight > 0.0) {
            return Err(invalid(
                "data.sources",
                at(format!("weight = {}", s.weight)),
                "a weight must be finite and > 0",
            ));
        }
        if let Some(f) = s.val_fraction.filter(|f| !(*f > 0.0 && *f < 1.0)) {
            return Err(invalid(
                "data.sources",
                at(format!("val_fraction = {f}")),
                "must be strictly between 0 and 1 (each source holds out its last val_fraction for validation)",
            ));
        }
        if let (Some(schema), Some(format)) = (s.schema, s.format) {
            if schema != Schema::Auto && !format.has_records() {
                return Err(invalid(
                    "data.sources",
                    at(format!("schema = \"{}\" with format = \"{}\"", schema.name(), format.name())),
                    "a schema applies to jsonl, parquet and arrow sources (how their records are read)",
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::Config;

    fn validated(toml: &str) -> Result<Config, String> {
        let cfg = Config::from_toml(toml, "t", &[]).map_err(|e| e.to_string())?;
        cfg.validate().map_err(|e| e.to_string())?;
        Ok(cfg)
    }

    /// Sources parse with their defaults, survive the resolved config's
    /// round trip, and bad ones are refused naming the key and the fix.
    #[test]
    fn sources_parse_round_trip_and_are_checked() {
        let cfg = validated(
            "[data]\nsources = [{ path = \"a.parquet\", weight = 2.0 }, { path = \"b.jsonl\", schema = \"alpaca\", val_fraction = 0.2 }]",
        )
        .unwrap();
        let s = cfg.data.sources.as_ref().unwrap();
        assert_eq!((s[0].weight, s[1].weight), (2.0, 1.0));
        assert_eq!(s[0].format().unwrap(), data::DataFormat::Parquet);
        assert_eq!(s[1].format().unwrap(), data::DataFormat::Jsonl);
        assert_eq!(Config::from_toml(&cfg.to_toml(), "resolved", &[]).unwrap(), cfg);
        let err = |sources: &str, extra: &str| validated(&format!("[data]\n{extra}\nsources = {sources}")).unwrap_err();
        let one = "[{ path = \"a.txt\" }]";
        let e = err(one, "path = \"b.txt\"");
        assert!(
            e.starts_with("data.sources = ") && e.contains("data.path = \"b.txt\"") && e.contains("not both"),
            "{e}"
        );
        let e = err(one, "val_path = \"v.txt\"");
        assert!(e.starts_with("data.val_path = \"v.txt\": does not combine with data.sources"), "{e}");
        assert!(err("[]", "").contains("list at least one"));
        let e = err("[{ path = \"a.txt\", weight = -1.0 }]", "");
        assert_eq!(e, "data.sources = [0] weight = -1: a weight must be finite and > 0");
        let e = err("[{ path = \"a.txt\" }, { path = \"b.txt\", val_fraction = 1.0 }]", "");
        assert!(e.starts_with("data.sources = [1] val_fraction = 1: must be strictly between 0 and 1"), "{e}");
        let e = err("[{ path = \"a.bin\", format = \"u16\", schema = \"messages\" }]", "");
        assert!(e.contains("a schema applies to jsonl, parquet and arrow sources"), "{e}");
        let e = validated("[data]\nsources = [{ path = \"a.txt\", weigth = 2.0 }]").unwrap_err();
        assert!(e.contains("weigth"), "{e}");
        // a table path with the default format needs no data.format for data.schema / data.pack
        validated("[data]\npath = \"x.parquet\"\nschema = \"alpaca\"\npack = true").unwrap();
        assert!(validated("[data]\npath = \"x.txt\"\npack = true").unwrap_err().contains("data.pack"));
    }
}
