//! `train.mlflow`: every number of every `metrics.jsonl` line is an MLflow
//! metric of the same name at its step, with the line's value exactly (a
//! float64: the f64 a JSON reader makes of the line's text), and a resume
//! after a crash continues the same MLflow run with no step twice.
//!
//! Checked twice: by reading MLflow's file store here (`metrics/<name>`
//! lines "ms value step"), and by MLflow's own `MlflowClient`
//! (scripts/mlflow_check.py), skipped with a note when python3 cannot
//! import mlflow unless MACROBATCH_REQUIRE_PYTHON=1. MLflow 3 keeps its
//! file store in maintenance mode: its client reads one with
//! `MLFLOW_ALLOW_FILE_STORE=true` (or after `mlflow migrate-filestore`).

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

/// The MLflow run's history of metric `name`: (step, value) per line.
fn history(run_dir: &Path, name: &str) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(run_dir.join("metrics").join(name)).unwrap_or_default();
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            assert_eq!(f.len(), 3, "{name}: {l}");
            (f[2].parse().unwrap(), f[1].parse().unwrap())
        })
        .collect()
}

fn python_mlflow() -> bool {
    let ok = Command::new("python3").args(["-c", "import mlflow"]).output().is_ok_and(|o| o.status.success());
    assert!(
        ok || std::env::var("MACROBATCH_REQUIRE_PYTHON").as_deref() != Ok("1"),
        "MACROBATCH_REQUIRE_PYTHON=1 but python3 cannot import mlflow"
    );
    ok
}

#[test]
fn every_metrics_number_is_an_mlflow_metric_and_a_resume_continues_the_run() {
    let (run, store) = (tmp("mlflow-run"), tmp("mlflow-store"));
    let uri = format!("train.mlflow={}", store.display());
    let sets = tiny(&["train.eval_every=2", "train.checkpoint_every=2", "train.steps=8", &uri]);
    // A crash at the start of step 6: steps 1-5 logged, the checkpoint at 4.
    let o = train_cmd(&run, &sets).env("MACROBATCH_FAULT", "kind=kill,step=6").output().unwrap();
    assert!(!o.status.success(), "the run was killed: {}", stderr(&o));
    let link: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("mlflow.json")).unwrap()).unwrap();
    let run_dir = std::path::PathBuf::from(link["run_dir"].as_str().unwrap());
    assert!(run_dir.starts_with(&store), "{}", run_dir.display());
    let steps = |h: Vec<(u64, f64)>| h.into_iter().map(|(s, _)| s).collect::<Vec<_>>();
    assert_eq!(steps(history(&run_dir, "loss")), [1, 2, 3, 4, 5], "every step written as it ends");
    let meta = std::fs::read_to_string(run_dir.join("meta.yaml")).unwrap();
    assert!(meta.contains("status: 1\n"), "RUNNING until the final save: {meta}");

    let err = resume_ok(&run, &[]);
    assert!(err.contains("MLflow: experiment 'macrobatch' in "), "{err}");
    let again: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("mlflow.json")).unwrap()).unwrap();
    assert_eq!(again["run_dir"], link["run_dir"], "the resume continues the same MLflow run");
    let meta = std::fs::read_to_string(run_dir.join("meta.yaml")).unwrap();
    assert!(meta.contains("status: 3\n") && !meta.contains("end_time: null"), "FINISHED: {meta}");
    // Step 5 of the crashed run is cut with metrics.jsonl's; every line's
    // numbers are there once, with the line's values.
    let lines = metrics(&run);
    assert_eq!(lines.len(), 8);
    for (field, v) in lines[0].as_object().unwrap() {
        if field == "step" || !(v.is_number() || v.is_boolean()) {
            continue;
        }
        let h = history(&run_dir, field);
        let want: Vec<(u64, f64)> = lines
            .iter()
            .filter_map(|l| {
                let x = l.get(field)?;
                Some((l["step"].as_u64()?, x.as_f64().or(x.as_bool().map(|b| f64::from(u8::from(b))))?))
            })
            .collect();
        assert_eq!(h, want, "{field}");
    }
    assert_eq!(steps(history(&run_dir, "val_loss")), [2, 4, 6, 8]);
    assert_eq!(std::fs::read_to_string(run_dir.join("params/train.steps")).unwrap(), "8");
    assert_eq!(
        std::fs::read_to_string(run_dir.join("tags/mlflow.runName")).unwrap(),
        std::fs::read_to_string(run.join("run_id")).unwrap().trim()
    );

    if python_mlflow() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/mlflow_check.py");
        let o = Command::new("python3")
            .arg(&script)
            .arg(&run)
            .arg(&store)
            .env("MLFLOW_ALLOW_FILE_STORE", "true")
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success() && out.contains(": OK"), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
        eprintln!("{}", out.trim_end());
    } else {
        eprintln!("skipped MLflow's own client: python3 cannot import mlflow (pip install mlflow)");
    }
    let _ = (std::fs::remove_dir_all(&run), std::fs::remove_dir_all(&store));
}

/// A run that fails before its first step leaves no MLflow run and no
/// `mlflow.json`: the same command runs again into the same folder.
#[test]
fn a_run_that_fails_before_its_first_step_leaves_no_mlflow_run() {
    let (run, store) = (tmp("mlflow-early"), tmp("mlflow-early-store"));
    let uri = format!("train.mlflow={}", store.display());
    let sets = tiny(&["train.steps=2", &uri]);
    let o = train_cmd(&run, &sets).env("MACROBATCH_FAULT", "kind=error,step=1").output().unwrap();
    assert!(!o.status.success(), "{}", stderr(&o));
    assert!(!run.join("mlflow.json").exists(), "no MLflow run was opened");
    train_ok(&run, &sets);
    assert!(run.join("mlflow.json").exists());
    let _ = (std::fs::remove_dir_all(&run), std::fs::remove_dir_all(&store));
}

#[test]
fn a_tracking_server_is_refused_before_anything_runs() {
    refused_train(
        "mlflow-server",
        None,
        &tiny(&["train.mlflow=http://localhost:5000"]),
        &["train.mlflow", "file store"],
    );
}
