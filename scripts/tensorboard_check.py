#!/usr/bin/env python3
"""Checks a run's TensorBoard log against its metrics.jsonl with TensorBoard's
own reader.

    python3 scripts/tensorboard_check.py RUN_DIR [--logdir DIR]

Loads DIR (default RUN_DIR/tensorboard) with
tensorboard.backend.event_processing.event_accumulator.EventAccumulator,
keeping every scalar (size_guidance scalars=0), and checks that every number
of every metrics.jsonl line is in the series of its tag at the line's step,
and that no series has a step, or a tag, metrics.jsonl does not.

Tags: a field `G_rest` with G in GROUPS is `G/rest`, any other field `f` is
`train/f`; a list adds its index (`train/micro_losses/0`); booleans are 0/1;
null and absent fields are not logged; `step` is the step.

Values are compared exactly as float32: TensorBoard stores a scalar as a
float32 `simple_value`, and macrobatch writes float32(x) of each number x
of the line, so the reader's value must equal numpy.float32(x) bit for bit
(no tolerance: any difference is a wrong value, not rounding).

Prints a summary; exits 1 on any mismatch.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

GROUPS = ("val", "mem", "comm", "pipeline", "p2p", "tp")


def tag(field):
    group, sep, rest = field.partition("_")
    return f"{group}/{rest}" if sep and group in GROUPS else f"train/{field}"


def expected(metrics_path):
    """{tag: {step: float32}} from metrics.jsonl."""
    series = {}
    for n, line in enumerate(metrics_path.read_text().splitlines(), 1):
        record = json.loads(line)
        step = record["step"]
        for name, v in record.items():
            if name == "step":
                continue
            if isinstance(v, bool):
                items = [(tag(name), 1.0 if v else 0.0)]
            elif isinstance(v, (int, float)):
                items = [(tag(name), v)]
            elif isinstance(v, list):
                items = [(f"{tag(name)}/{i}", x) for i, x in enumerate(v) if isinstance(x, (int, float))]
            else:
                items = []
            for t, x in items:
                series.setdefault(t, {})[step] = np.float32(float(x))
    return series


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--logdir", type=Path, help="the event files' folder (default RUN/tensorboard)")
    a = ap.parse_args()
    logdir = a.logdir or a.run / "tensorboard"
    want = expected(a.run / "metrics.jsonl")

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    got = {}
    problems = []
    for t in acc.Tags()["scalars"]:
        steps = {}
        for ev in acc.Scalars(t):
            if ev.step in steps:
                problems.append(f"{t}: step {ev.step} twice")
            steps[ev.step] = np.float32(ev.value)
        got[t] = steps

    checked = 0
    for t, steps in sorted(want.items()):
        have = got.get(t)
        if have is None:
            problems.append(f"{t}: no series")
            continue
        for step, v in sorted(steps.items()):
            checked += 1
            if step not in have:
                problems.append(f"{t}: step {step} missing")
            elif have[step].tobytes() != v.tobytes():
                problems.append(f"{t} step {step}: {have[step]!r} != metrics.jsonl's float32 {v!r}")
        extra = sorted(set(have) - set(steps))
        if extra:
            problems.append(f"{t}: steps not in metrics.jsonl: {extra}")
    for t in sorted(set(got) - set(want)):
        problems.append(f"{t}: a series metrics.jsonl has no field for")

    for p in problems[:50]:
        print("MISMATCH", p)
    steps = sorted({s for v in want.values() for s in v})
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
    print(
        f"{logdir}: {len(got)} series, {checked} scalars of {len(steps)} metrics.jsonl lines ({span}) "
        f"checked by EventAccumulator: {len(problems)} mismatches"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
