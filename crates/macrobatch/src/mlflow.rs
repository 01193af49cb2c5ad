//! `train.mlflow`: the run's metrics, written straight into an MLflow
//! tracking folder (MLflow's file store, `mlruns/`) as MLflow's own
//! `FileStore` lays it out, so `mlflow ui --backend-store-uri DIR` and
//! `MlflowClient(tracking_uri=DIR)` read it without a server or a Python
//! process beside the run:
//!
//! ```text
//! DIR/<experiment id>/meta.yaml             name, artifact location, times
//! DIR/<experiment id>/<run id>/meta.yaml    run name (the run folder's run id), status, times
//! DIR/<experiment id>/<run id>/metrics/<k>  one line per step: "<ms> <value> <step>"
//! DIR/<experiment id>/<run id>/params/<k>   the resolved config, one file per key
//! DIR/<experiment id>/<run id>/tags/<k>     mlflow.runName, mlflow.source.name, the run folder
//! ```
//!
//! Every number of every `metrics.jsonl` line is a metric of the same name
//! at its step (a boolean as 0 / 1, a list as `name_0`, `name_1`, …), its
//! value the line's (f64, exactly). `DIR/.../meta.yaml` of the run starts
//! RUNNING and ends FINISHED with the final save. A resumed run continues
//! the same MLflow run (the run folder's `mlflow.json` names it), each
//! metric cut back to the checkpoint's step as `metrics.jsonl` is.

use crate::metrics::StepRecord;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The run folder's file naming the MLflow run it writes.
pub const RUN_FILE: &str = "mlflow.json";

/// MLflow's `RunStatus`: RUNNING and FINISHED.
const RUNNING: u8 = 1;
const FINISHED: u8 = 3;

/// The tracking folder of `train.mlflow`: a path or a `file:` URI; any
/// other scheme (a tracking server) is refused with the fix.
pub fn tracking_dir(uri: &str) -> Result<PathBuf> {
    let path = match uri.strip_prefix("file://").or_else(|| uri.strip_prefix("file:")) {
        Some(p) => p,
        None if uri.contains("://") => bail!(
            "train.mlflow = \"{uri}\": macrobatch writes MLflow's file store (a folder, or a file:// URI), not to a tracking server; give a folder, then serve it (`MLFLOW_ALLOW_FILE_STORE=true mlflow server --backend-store-uri FOLDER`) or move it into a database (`mlflow migrate-filestore`)"
        ),
        None => uri,
    };
    std::path::absolute(path).with_context(|| format!("train.mlflow = \"{uri}\""))
}

/// Milliseconds since the epoch, as MLflow stores times.
fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// A `file://` URI of `p` (absolute).
fn uri(p: &Path) -> String {
    format!("file://{}", p.display())
}

/// `name: value` of a flat YAML file (a single-quoted value unquoted).
fn yaml_field(text: &str, name: &str) -> Option<String> {
    let v = text.lines().find_map(|l| l.strip_prefix(&format!("{name}: ")))?.trim();
    Some(match v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
        Some(q) => q.replace("''", "'"),
        None => v.to_string(),
    })
}

/// `s` as a single-quoted YAML scalar: read back as the same string
/// whatever it holds (`: `, `#`, digits, `null`).
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The id of experiment `name` in `root`, created (with MLflow's Default
/// experiment 0 beside it) if absent.
fn experiment(root: &Path, name: &str) -> Result<String> {
    std::fs::create_dir_all(root).with_context(|| format!("train.mlflow: cannot create {}", root.display()))?;
    let mut ids = Vec::new();
    for e in std::fs::read_dir(root).with_context(|| format!("train.mlflow: cannot read {}", root.display()))? {
        let e = e?;
        let Ok(id) = e.file_name().to_string_lossy().parse::<u64>() else { continue };
        ids.push(id);
        let meta = std::fs::read_to_string(e.path().join("meta.yaml")).unwrap_or_default();
        if yaml_field(&meta, "name").as_deref() == Some(name) {
            return Ok(id.to_string());
        }
    }
    let write_experiment = |id: &str, name: &str| -> Result<()> {
        let dir = root.join(id);
        std::fs::create_dir_all(&dir)?;
        let t = now_ms();
        let meta = format!(
            "artifact_location: {}\ncreation_time: {t}\nexperiment_id: '{id}'\nlast_update_time: {t}\nlifecycle_stage: active\nname: {}\n",
            quoted(&uri(&dir)),
            quoted(name)
        );
        nn::io::write_atomic(&dir.join("meta.yaml"), meta.as_bytes()).map_err(Into::into)
    };
    if !ids.contains(&0) {
        write_experiment("0", "Default")?;
        ids.push(0);
    }
    if name == "Default" {
        return Ok("0".into());
    }
    let id = (ids.iter().max().copied().unwrap_or(0) + 1).to_string();
    write_experiment(&id, name)?;
    Ok(id)
}

/// A run id: 32 hex digits (MLflow's uuid4 hex), from the time, the
/// process and the run folder's id.
fn new_run_id(seed: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (seed, now_ms(), std::process::id(), SystemTime::now()).hash(&mut h);
    let a = h.finish();
    a.hash(&mut h);
    format!("{a:016x}{:016x}", h.finish())
}

/// `train.mlflow` of a training run (rank 0): its MLflow run is opened at
/// the first step recorded, so a run that fails before it leaves none.
pub struct Mlflow {
    root: PathBuf,
    experiment: String,
    folder: PathBuf,
    run_id: String,
    params: Vec<(String, String)>,
    resume_step: Option<u64>,
    run: Option<MlflowRun>,
}

impl Mlflow {
    /// The MLflow log of the run folder `folder` (`run_id` its id) into
    /// experiment `experiment` of the tracking folder `root`, with `params`
    /// (a resume at `resume_step` continues the run `mlflow.json` names).
    pub fn new(
        (root, experiment): (PathBuf, &str),
        (folder, run_id): (&Path, &str),
        params: Vec<(String, String)>,
        resume_step: Option<u64>,
    ) -> Result<Self> {
        if experiment.trim().is_empty() {
            bail!("train.mlflow_experiment is empty; name the experiment (default \"macrobatch\")");
        }
        let (folder, run_id, experiment) = (folder.to_path_buf(), run_id.to_string(), experiment.to_string());
        Ok(Self { root, experiment, folder, run_id, params, resume_step, run: None })
    }

    /// The line that says where the run goes and how to look at it.
    pub fn describe(&self) -> String {
        format!(
            "MLflow: experiment {} in {} (look: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {})",
            quoted(&self.experiment),
            self.root.display(),
            quoted(&self.root.display().to_string())
        )
    }

    /// Appends one `metrics.jsonl` line's numbers (the run opened first).
    pub fn record(&mut self, r: &StepRecord) -> Result<()> {
        let run = match &mut self.run {
            Some(run) => run,
            None => {
                let at = (self.folder.as_path(), self.run_id.as_str());
                let run = MlflowRun::open(&self.root, &self.experiment, at, &self.params, self.resume_step)?;
                self.run.insert(run)
            }
        };
        run.record(r)
    }

    /// Marks the run FINISHED (the final model saved).
    pub fn finish(&self) -> Result<()> {
        self.run.as_ref().map_or(Ok(()), MlflowRun::finish)
    }
}

/// The MLflow run of a training run: rank 0 appends each step's metrics.
pub struct MlflowRun {
    dir: PathBuf,
    run_name: String,
    start_ms: u128,
}

impl MlflowRun {
    /// Opens the MLflow run of the run folder `folder` (`run_id` its id) in
    /// experiment `experiment` of the tracking folder `root`: a new one
    /// with `params` logged, or on a resume (`resume_step`) the one its
    /// `mlflow.json` names, each metric cut back to that step.
    pub fn open(
        root: &Path,
        experiment_name: &str,
        (folder, run_id): (&Path, &str),
        params: &[(String, String)],
        resume_step: Option<u64>,
    ) -> Result<Self> {
        let saved =
            std::fs::read_to_string(folder.join(RUN_FILE)).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok());
        if let (Some(step), Some(saved)) = (resume_step, saved) {
            let dir = PathBuf::from(saved["run_dir"].as_str().unwrap_or_default());
            if dir.join("meta.yaml").is_file() {
                let meta = std::fs::read_to_string(dir.join("meta.yaml"))?;
                let start_ms = yaml_field(&meta, "start_time").and_then(|t| t.parse().ok()).unwrap_or_else(now_ms);
                let run = Self { dir, run_name: run_id.to_string(), start_ms };
                run.cut_metrics(step)?;
                run.write_meta(RUNNING, None)?;
                return Ok(run);
            }
        }
        let exp = experiment(root, experiment_name)?;
        let id = new_run_id(run_id);
        let dir = root.join(&exp).join(&id);
        for sub in ["metrics", "params", "tags", "artifacts"] {
            std::fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("train.mlflow: cannot create {}", dir.display()))?;
        }
        let run = Self { dir, run_name: run_id.to_string(), start_ms: now_ms() };
        for (k, v) in params {
            run.put("params", k, v)?;
        }
        let folder_abs = std::path::absolute(folder).unwrap_or_else(|_| folder.to_path_buf());
        for (k, v) in [
            ("mlflow.runName", run_id.to_string()),
            ("mlflow.source.name", "macrobatch".to_string()),
            ("macrobatch.run_folder", folder_abs.display().to_string()),
        ] {
            run.put("tags", k, &v)?;
        }
        run.write_meta(RUNNING, None)?;
        let link = serde_json::json!({ "run_dir": run.dir.display().to_string(), "experiment_id": exp, "run_id": id });
        nn::io::write_atomic(&folder.join(RUN_FILE), format!("{link}\n").as_bytes())?;
        Ok(run)
    }

    /// Writes `value` into `kind/key` (a param or a tag; `/` in a key makes
    /// a folder, as MLflow's file store does).
    fn put(&self, kind: &str, key: &str, value: &str) -> Result<()> {
        let path = self.dir.join(kind).join(key);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        nn::io::write_atomic(&path, value.as_bytes()).map_err(Into::into)
    }

    fn write_meta(&self, status: u8, end_ms: Option<u128>) -> Result<()> {
        let id = self.dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let exp =
            self.dir.parent().and_then(Path::file_name).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let end = end_ms.map_or("null".to_string(), |t| t.to_string());
        let meta = format!(
            "artifact_uri: {}\nend_time: {end}\nentry_point_name: ''\nexperiment_id: '{exp}'\nlifecycle_stage: active\nrun_id: {id}\nrun_name: {}\nrun_uuid: {id}\nsource_name: ''\nsource_type: 4\nsource_version: ''\nstart_time: {}\nstatus: {status}\ntags: []\nuser_id: {}\n",
            quoted(&uri(&self.dir.join("artifacts"))),
            quoted(&self.run_name),
            self.start_ms,
            quoted(&std::env::var("USER").unwrap_or_else(|_| "macrobatch".into())),
        );
        nn::io::write_atomic(&self.dir.join("meta.yaml"), meta.as_bytes()).map_err(Into::into)
    }

    /// Drops every metric line past `step` (a resume from its checkpoint).
    fn cut_metrics(&self, step: u64) -> Result<()> {
        let Ok(entries) = std::fs::read_dir(self.dir.join("metrics")) else { return Ok(()) };
        for e in entries {
            let path = e?.path();
            let text = std::fs::read_to_string(&path)?;
            let kept: String = text
                .lines()
                .filter(|l| l.rsplit(' ').next().and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s <= step))
                .map(|l| format!("{l}\n"))
                .collect();
            nn::io::write_atomic(&path, kept.as_bytes())?;
        }
        Ok(())
    }

    /// Appends every number of one `metrics.jsonl` line at its step.
    pub fn record(&mut self, r: &StepRecord) -> Result<()> {
        // The numbers as the line writes them (an f32 field's shortest
        // decimal, read as f64), not the f32's own binary value.
        let line = serde_json::to_string(r).context("cannot serialise metrics")?;
        let value: Value = serde_json::from_str(&line).context("cannot read the metrics back")?;
        let t = now_ms();
        for (name, x) in metrics(&value) {
            let path = self.dir.join("metrics").join(&name);
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .with_context(|| format!("train.mlflow: cannot write {}", path.display()))?;
            // One write per line: a reader never sees half of one.
            let line = format!("{t} {x:?} {}\n", r.step);
            f.write_all(line.as_bytes()).with_context(|| format!("train.mlflow: cannot write {}", path.display()))?;
        }
        Ok(())
    }

    /// Marks the run FINISHED (the final model saved).
    pub fn finish(&self) -> Result<()> {
        self.write_meta(FINISHED, Some(now_ms()))
    }
}

/// The metrics of one `metrics.jsonl` record: every number, boolean (0 /
/// 1) and list of numbers (`name_i`) but `step`, under its own name.
pub fn metrics(record: &Value) -> Vec<(String, f64)> {
    let named = |(field, item, x): (&str, Option<usize>, f64)| match item {
        None => (field.to_string(), x),
        Some(i) => (format!("{field}_{i}"), x),
    };
    crate::metrics::numbers(record).into_iter().map(named).collect()
}

/// The resolved config as MLflow params: every leaf by its dotted key
/// (arrays and strings as TOML writes them).
pub fn params(resolved: &toml::Table) -> Vec<(String, String)> {
    fn walk(prefix: &str, t: &toml::Table, out: &mut Vec<(String, String)>) {
        for (k, v) in t {
            let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
            match v {
                toml::Value::Table(sub) => walk(&key, sub, out),
                toml::Value::String(s) => out.push((key, s.clone())),
                other => out.push((key, other.to_string())),
            }
        }
    }
    let mut out = Vec::new();
    walk("", resolved, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_uri_is_refused_and_paths_are_absolute() {
        let e = tracking_dir("http://localhost:5000").unwrap_err().to_string();
        assert!(e.contains("file store") && e.contains("mlflow server"), "{e}");
        assert_eq!(tracking_dir("file:///tmp/mlruns").unwrap(), PathBuf::from("/tmp/mlruns"));
        assert!(tracking_dir("mlruns").unwrap().is_absolute());
    }

    #[test]
    fn yaml_values_are_quoted_and_read_back() {
        for name in ["lora: v2", "2024", "null", "#x", "it's"] {
            let text = format!("name: {}\n", quoted(name));
            assert_eq!(yaml_field(&text, "name").as_deref(), Some(name), "{text}");
        }
        assert_eq!(yaml_field("name: Default\n", "name").as_deref(), Some("Default"));
    }

    #[test]
    fn metrics_flatten_lists_and_booleans_and_leave_out_the_step() {
        let r = serde_json::json!({"step": 3, "loss": 2.5, "clipped": true, "stage_ms": [1.0, 2.0], "note": "x"});
        let m = metrics(&r);
        assert_eq!(
            m,
            vec![
                ("clipped".to_string(), 1.0),
                ("loss".to_string(), 2.5),
                ("stage_ms_0".to_string(), 1.0),
                ("stage_ms_1".to_string(), 2.0)
            ]
        );
    }
}
