#!/usr/bin/env python3
"""Loads a macrobatch run directory with Hugging Face transformers and checks
that GPT2LMHeadModel computes the same validation loss as macrobatch logged.

Usage: python3 scripts/hf_check.py RUN_DIR
Needs: torch, transformers (pip install torch transformers).

It rebuilds exactly the validation sequences macrobatch evaluates (the last
data.val_fraction of the corpus bytes, non-overlapping windows of seq_len+1
bytes, the first batch.micro * train.eval_batches of them), runs them through
GPT2LMHeadModel.from_pretrained(RUN_DIR), and compares the mean per-token
cross-entropy with the last `val_loss` in RUN_DIR/metrics.jsonl.
Tolerance 1e-4 relative: both sides compute in f32 with different operation
orders (≈1e-6 relative per reduction), far below any real mismatch (a wrong
layout or a missing bias changes the loss in the first decimal).
"""
import json
import math
import os
import sys
import tomllib

import torch
from transformers import GPT2LMHeadModel


def main() -> int:
    run = sys.argv[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(run, "config.resolved.toml"), "rb") as f:
        cfg = tomllib.load(f)
    data = cfg["data"]
    path = data.get("path") or os.path.join(repo, "data", "moby-dick.txt")
    tokens = list(open(path, "rb").read())
    n_val = math.floor(len(tokens) * data["val_fraction"] + 0.5)
    val = tokens[len(tokens) - n_val:]
    t = data["seq_len"]
    n_samples = (len(val) - 1) // t
    n = min(cfg["batch"]["micro"] * cfg["train"]["eval_batches"], n_samples)
    xs = torch.tensor([val[i * t:i * t + t] for i in range(n)])
    ys = torch.tensor([val[i * t + 1:i * t + t + 1] for i in range(n)])

    model = GPT2LMHeadModel.from_pretrained(run).eval()
    with torch.no_grad():
        logits = model(xs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1)).item()

    logged = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    ours = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    rel = abs(loss - ours) / ours
    print(f"transformers {loss:.7f} vs macrobatch {ours:.7f}: relative difference {rel:.2e} (tolerance 1e-4)")
    return 0 if rel <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
