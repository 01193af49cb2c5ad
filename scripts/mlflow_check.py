#!/usr/bin/env python3
"""Checks a run's MLflow run (train.mlflow) against its metrics.jsonl with
MLflow's own client.

    python3 scripts/mlflow_check.py RUN_DIR TRACKING_DIR

Reads the run that RUN_DIR/mlflow.json names through
mlflow.tracking.MlflowClient(tracking_uri=file://TRACKING_DIR) and checks:
every number of every metrics.jsonl line is in the history of the metric
of the same name (a boolean as 0/1, a list's item i as NAME_i) at the
line's step, with the line's value exactly (MLflow stores a float64, and
macrobatch writes the line's f64 in its shortest exact form: no tolerance);
no metric has a step metrics.jsonl does not; the params hold the resolved
config's keys (train.steps among them); the run's name is the run folder's
run id and its status FINISHED.

Prints a summary; exits 1 on any mismatch.
"""

import json
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient


def expected(lines):
    """(metric name, step) -> value, from metrics.jsonl records."""
    want = {}
    for rec in lines:
        step = rec["step"]
        for name, v in rec.items():
            if name == "step" or v is None:
                continue
            if isinstance(v, bool):
                want[(name, step)] = 1.0 if v else 0.0
            elif isinstance(v, (int, float)):
                want[(name, step)] = float(v)
            elif isinstance(v, list):
                for i, x in enumerate(v):
                    if isinstance(x, (int, float)) and not isinstance(x, bool):
                        want[(f"{name}_{i}", step)] = float(x)
    return want


def main():
    run_dir, tracking = Path(sys.argv[1]), Path(sys.argv[2]).resolve()
    link = json.loads((run_dir / "mlflow.json").read_text())
    client = MlflowClient(tracking_uri=tracking.as_uri())
    run = client.get_run(link["run_id"])
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    want = expected(records)
    errors = []
    names = {name for name, _ in want}
    got = {}
    for name in sorted(set(run.data.metrics) | names):
        for m in client.get_metric_history(run.info.run_id, name):
            if (name, m.step) in got:
                errors.append(f"{name}: step {m.step} logged twice")
            got[(name, m.step)] = m.value
    for key, v in want.items():
        if key not in got:
            errors.append(f"{key[0]} at step {key[1]}: missing (metrics.jsonl has {v!r})")
        elif got[key] != v:
            errors.append(f"{key[0]} at step {key[1]}: {got[key]!r}, metrics.jsonl has {v!r}")
    errors += [f"{k[0]} at step {k[1]}: not in metrics.jsonl" for k in got if k not in want]
    run_id = (run_dir / "run_id").read_text().strip()
    if run.info.run_name != run_id:
        errors.append(f"run name {run.info.run_name!r}, the run folder's id is {run_id!r}")
    if run.info.status != "FINISHED":
        errors.append(f"status {run.info.status}, not FINISHED")
    if "train.steps" not in run.data.params:
        errors.append(f"params lack train.steps: {sorted(run.data.params)[:8]}")
    print(f"mlflow_check: {len(want)} values of {len(records)} steps, {len(names)} metrics, "
          f"{len(run.data.params)} params, status {run.info.status}: {'OK' if not errors else 'FAIL'}")
    for e in errors[:20]:
        print("  " + e)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
