//! `extends = "base.toml"`: a config file built on another. The path is
//! relative to the file that names it; a base may extend another, a cycle
//! is refused. The files merge key by key: the extending file's keys
//! override its base's, tables merge recursively, any other value (arrays
//! included) is replaced whole. `--set` overrides apply after the merge.

use crate::{parse_table, Config, ConfigError};
use std::path::{Path, PathBuf};

/// The key naming a base file.
const KEY: &str = "extends";

/// The TOML text of the config file `path` with its `extends` chain
/// resolved: the file's own text when it extends nothing (so errors keep
/// its lines), else the merged table written out, without `extends`.
pub fn read_toml(path: &Path) -> Result<String, ConfigError> {
    let text = read(path, None)?;
    let table = parse_table(&text, &path.display().to_string())?;
    if !table.contains_key(KEY) {
        return Ok(text);
    }
    let mut files = vec![(path.to_path_buf(), text.clone())];
    let merged = resolve(path, table, &mut Vec::new(), &mut files)?;
    // The merged document's lines are no file's: an unknown key is reported
    // in the file where it is written, at its line there.
    if toml::Value::Table(merged.clone()).try_into::<Config>().is_err() {
        if let Some(e) = files.iter().find_map(|(file, text)| unknown_key(file, text)) {
            return Err(e);
        }
    }
    toml::to_string(&merged)
        .map_err(|e| ConfigError::Parse { origin: path.display().to_string(), message: e.to_string() })
}

/// The error of an unknown key in `text` (the file `path`) read on its own,
/// `extends` aside (blanked, so lines and columns stay the file's).
fn unknown_key(path: &Path, text: &str) -> Option<ConfigError> {
    let mut own = text.to_string();
    if let Ok(doc) = toml::de::DeTable::parse(text) {
        if let Some((key, value)) = doc.get_ref().iter().find(|(k, _)| k.get_ref().as_ref() == KEY) {
            let span = key.span().start..value.span().end;
            let blank: String = text[span.clone()].chars().map(|c| if c == '\n' { c } else { ' ' }).collect();
            own.replace_range(span, &blank);
        }
    }
    match toml::from_str::<Config>(&own) {
        Err(e) if e.message().starts_with("unknown field") => {
            Some(ConfigError::Parse { origin: path.display().to_string(), message: e.to_string() })
        }
        _ => None,
    }
}

/// The text of `path`; `named_by` is the file whose `extends` names it.
fn read(path: &Path, named_by: Option<&Path>) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| match named_by {
        None => ConfigError::Read { path: path.display().to_string(), source },
        Some(file) => {
            ConfigError::ReadBase { path: path.display().to_string(), named_by: file.display().to_string(), source }
        }
    })
}

/// `table` (read from `path`) over the tables it extends; `chain` holds the
/// files that led here, outermost first; each base read is added to `files`
/// with its text.
fn resolve(
    path: &Path,
    mut table: toml::Table,
    chain: &mut Vec<PathBuf>,
    files: &mut Vec<(PathBuf, String)>,
) -> Result<toml::Table, ConfigError> {
    let origin = path.display().to_string();
    // Files are told apart by their canonical paths (`a/../b.toml` is `b.toml`).
    let id = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    if let Some(at) = chain.iter().position(|p| *p == id) {
        let names: Vec<String> = chain[at..].iter().chain([&id]).map(|p| p.display().to_string()).collect();
        return Err(ConfigError::Parse {
            origin,
            message: format!("`extends` makes a cycle: {}; a base cannot extend a file built on it", names.join(" → ")),
        });
    }
    chain.push(id);
    let Some(base) = table.remove(KEY) else { return Ok(table) };
    let toml::Value::String(base) = base else {
        return Err(ConfigError::Parse {
            origin,
            message: format!(
                "`extends` must be a string: the path of a base config, relative to this file (got {base})"
            ),
        });
    };
    let base_path = path.parent().unwrap_or(Path::new("")).join(&base);
    let base_text = read(&base_path, Some(path))?;
    let base_table = parse_table(&base_text, &base_path.display().to_string())?;
    files.push((base_path.clone(), base_text));
    let mut merged = resolve(&base_path, base_table, chain, files)?;
    merge(&mut merged, table);
    Ok(merged)
}

/// `over`'s keys written into `base`: tables merged recursively, any other
/// value replaced.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    /// A fresh folder for a test's files.
    fn folder(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("macrobatch-extends-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn load(path: &Path, sets: &[&str]) -> Result<Config, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::from_toml(&read_toml(path)?, &path.display().to_string(), &sets)
    }

    /// c ← b ← a, each a folder apart: paths are relative to the file that
    /// names them; the nearer file wins key by key, tables merge, arrays
    /// are replaced whole, `--set` applies last; the resolved config has no
    /// `extends` and reads back as itself.
    #[test]
    fn a_chain_of_three_merges_key_by_key_and_set_applies_last() {
        let dir = folder("chain");
        std::fs::create_dir_all(dir.join("bases/common")).unwrap();
        std::fs::write(
            dir.join("bases/common/c.toml"),
            "[train]\nsteps = 100\nseed = 7\ntrainable = [\"a.*\", \"b.*\"]\n[optim]\nlr = 0.5\n[data]\nseq_len = 64\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("bases/b.toml"),
            "extends = \"common/c.toml\"\n[train]\nsteps = 50\ntrainable = [\"c.*\"]\n[data]\nshuffle = false\n",
        )
        .unwrap();
        std::fs::write(dir.join("a.toml"), "extends = \"bases/b.toml\"\n[train]\nsteps = 20\n").unwrap();
        let cfg = load(&dir.join("a.toml"), &[]).unwrap();
        assert_eq!(cfg.train.steps, 20, "a overrides b and c");
        assert_eq!(cfg.train.seed, 7, "c's key survives where b and a are silent");
        assert_eq!(cfg.train.trainable, vec!["c.*".to_string()], "arrays are replaced whole");
        assert_eq!(cfg.optim.lr, 0.5);
        assert_eq!((cfg.data.seq_len, cfg.data.shuffle), (Some(64), false), "[data] merged from c and b");
        let set = load(&dir.join("a.toml"), &["train.steps=3", "optim.lr=0.1"]).unwrap();
        assert_eq!((set.train.steps, set.optim.lr, set.train.seed), (3, 0.1, 7));
        let resolved = cfg.to_toml();
        assert!(!resolved.contains("extends"), "{resolved}");
        assert_eq!(Config::from_toml(&resolved, "config.resolved.toml", &[]).unwrap(), cfg);
        // a file without `extends` is its own text, lines and all
        let b_text = std::fs::read_to_string(dir.join("bases/common/c.toml")).unwrap();
        assert_eq!(read_toml(&dir.join("bases/common/c.toml")).unwrap(), b_text);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A typo in a base is reported in the base, at its line there (not
    /// against the extending file and a line of the merged document); a
    /// typo in the extending file, at its own line, `extends` included.
    #[test]
    fn an_unknown_key_is_reported_in_the_file_and_line_that_write_it() {
        let dir = folder("typo");
        std::fs::write(dir.join("base.toml"), "[model]\nn_layer = 2\n\n[train]\nseed = 3\nstpes = 5\n").unwrap();
        std::fs::write(dir.join("run.toml"), "extends = \"base.toml\"\n[optim]\nlr = 0.1\n").unwrap();
        let e = load(&dir.join("run.toml"), &[]).unwrap_err().to_string();
        let base = dir.join("base.toml").display().to_string();
        assert!(e.starts_with(&format!("{base}: ")), "{e}");
        assert!(e.contains("line 6") && e.contains("unknown field `stpes`"), "{e}");
        std::fs::write(dir.join("base.toml"), "[train]\nseed = 3\n").unwrap();
        std::fs::write(dir.join("run.toml"), "extends = \"base.toml\"\n[optim]\nlr = 0.1\nbeta = 0.9\n").unwrap();
        let e = load(&dir.join("run.toml"), &[]).unwrap_err().to_string();
        let run = dir.join("run.toml").display().to_string();
        assert!(e.starts_with(&format!("{run}: ")) && e.contains("line 4") && e.contains("`beta`"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_cycle_is_refused_naming_the_chain() {
        let dir = folder("cycle");
        std::fs::write(dir.join("a.toml"), "extends = \"b.toml\"\n").unwrap();
        std::fs::write(dir.join("b.toml"), "extends = \"./c.toml\"\n").unwrap();
        std::fs::write(dir.join("c.toml"), "extends = \"a.toml\"\n").unwrap();
        let e = load(&dir.join("a.toml"), &[]).unwrap_err().to_string();
        let canon = |n: &str| std::fs::canonicalize(dir.join(n)).unwrap().display().to_string();
        let chain = format!("{} → {} → {} → {}", canon("a.toml"), canon("b.toml"), canon("c.toml"), canon("a.toml"));
        assert!(e.contains(&format!("`extends` makes a cycle: {chain}")), "{e}");
        std::fs::write(dir.join("self.toml"), "extends = \"self.toml\"\n").unwrap();
        let e = load(&dir.join("self.toml"), &[]).unwrap_err().to_string();
        assert!(e.contains("cycle") && e.contains("self.toml → "), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_or_mistyped_base_names_the_path_and_the_file_naming_it() {
        let dir = folder("missing");
        std::fs::write(dir.join("a.toml"), "extends = \"b.toml\"\n").unwrap();
        std::fs::write(dir.join("b.toml"), "extends = \"gone/base.toml\"\n").unwrap();
        let e = load(&dir.join("a.toml"), &[]).unwrap_err().to_string();
        let want = format!(
            "cannot read base config {} (extends in {})",
            dir.join("gone/base.toml").display(),
            dir.join("b.toml").display()
        );
        assert!(e.starts_with(&want), "{e}");
        std::fs::write(dir.join("n.toml"), "extends = 3\n").unwrap();
        let e = load(&dir.join("n.toml"), &[]).unwrap_err().to_string();
        assert!(e.contains("`extends` must be a string") && e.contains("n.toml"), "{e}");
        // `extends` below the top level is an unknown key, as any other
        std::fs::write(dir.join("t.toml"), "[train]\nextends = \"b.toml\"\n").unwrap();
        let e = load(&dir.join("t.toml"), &[]).unwrap_err().to_string();
        assert!(e.contains("unknown field `extends`"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
