#!/usr/bin/env python3
"""Fine-tuning data as Hugging Face `datasets` writes it, read by macrobatch.

Writes one JSON Lines file per schema with `datasets.Dataset.from_list(rows)
.to_json(path)` (what a user exporting a Hub dataset gets: absent keys as
null, slashes escaped), trains one step on each with the SmolLM2 tokenizer
and chat template (held-out examples from data.val_fraction), and checks
that each chat schema trains to the loss of the same conversations written
as `messages` lines.

    python3 scripts/data_schemas_check.py [--bin target/release/macrobatch] [--gguf PATH]

Needs `pip install datasets` and the SmolLM2 GGUF (scripts/fetch-smollm.sh).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import datasets
from datasets import Dataset

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf():
    """Where scripts/fetch-smollm.sh stores the model, unless $MACROBATCH_SMOLLM_GGUF names it."""
    if os.environ.get("MACROBATCH_SMOLLM_GGUF"):
        return os.environ["MACROBATCH_SMOLLM_GGUF"]
    cache = os.environ.get("MACROBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "macrobatch"
    )
    return os.path.join(cache, "smollm2", GGUF)


QA = [
    ("Name the ship.", "Call me Ishmael. The Pequod sailed from Nantucket.", "The Pequod."),
    ("Who narrates?", "Call me Ishmael.", "Ishmael."),
    ("Where does it sail from?", "", "Nantucket."),
    ("What is hunted?", "The white whale, Moby Dick.", "A white whale."),
    ("Who is the captain?", "Ahab stood upon the quarter-deck.", "Ahab."),
    ("Count to three.", "", "1, 2, 3."),
    ("Spell whale.", "", "w-h-a-l-e"),
    ("What colour is the whale?", "The whiteness of the whale appalled me.", "White."),
]


def user_text(instruction, context):
    return instruction if not context else f"{instruction}\n\n{context}"


def rows():
    """Each schema's rows, and the `messages` rows of the same conversations."""
    system = {"role": "system", "content": "Answer in a few words."}
    chats = [[system, {"role": "user", "content": user_text(i, c)}, {"role": "assistant", "content": a}] for i, c, a in QA]
    sharegpt_from = {"system": "system", "user": "human", "assistant": "gpt"}
    schemas = {
        "messages": [{"messages": c} for c in chats],
        "sharegpt": [{"conversations": [{"from": sharegpt_from[m["role"]], "value": m["content"]} for m in c]} for c in chats],
        "prompt_completion_chat": [{"prompt": c[:-1], "completion": c[-1:]} for c in chats],
        # no system turn in Alpaca; "input" absent on some rows (to_json writes null)
        "alpaca": [{"instruction": i, "output": a} | ({"input": c} if c else {}) for i, c, a in QA],
        "alpaca_messages": [
            {"messages": [{"role": "user", "content": user_text(i, c)}, {"role": "assistant", "content": a}]} for i, c, a in QA
        ],
        "prompt_completion": [{"prompt": f"Q: {user_text(i, c)}\nA:", "completion": f" {a}"} for i, c, a in QA],
        "text": [{"text": f"Q: {user_text(i, c)}\nA: {a}"} for i, c, a in QA],
    }
    return schemas


def train(binary, gguf, data, out):
    sets = [
        "model.family=llama", "model.preset=tiny", "model.vocab_size=49152",
        "data.format=jsonl", f"data.path={data}", f"data.tokenizer={gguf}", "data.seq_len=128",
        "data.val_fraction=0.25", "batch.micro=2", "batch.accumulation_steps=3",
        "train.steps=1", "train.threads=1",
    ]
    cmd = [binary, "train", "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{data.name}: macrobatch train failed:\n{done.stderr}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics[-1]["loss"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="target/release/macrobatch")
    ap.add_argument("--gguf", default=default_gguf())
    args = ap.parse_args()
    if not Path(args.gguf).is_file():
        sys.exit(f"{args.gguf} is missing: run scripts/fetch-smollm.sh or pass --gguf")
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        loss = {}
        for name, data_rows in rows().items():
            path = tmp / f"{name}.jsonl"
            Dataset.from_list(data_rows).to_json(str(path))
            loss[name] = train(args.bin, args.gguf, path, tmp / f"run-{name}")
            print(f"{name:24} loss {loss[name]:.6f}")
    same = [("sharegpt", "messages"), ("prompt_completion_chat", "messages"), ("alpaca", "alpaca_messages")]
    failed = [(a, b) for a, b in same if loss[a] != loss[b]]
    for a, b in failed:
        print(f"FAIL: {a} trained to {loss[a]!r}, its messages lines to {loss[b]!r}")
    if loss["prompt_completion"] == loss["text"]:
        failed.append(("prompt_completion", "text"))
        print("FAIL: prompt/completion trained to the loss of the unmasked text lines: the prompt is not masked")
    if failed:
        sys.exit(1)
    print("PASS: every chat schema trains to the loss of its messages lines; the prompt of prompt/completion is masked")


if __name__ == "__main__":
    main()
