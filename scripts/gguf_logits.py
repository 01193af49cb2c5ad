#!/usr/bin/env python3
"""Logits of a model as transformers loads it, for checks of written files.

Usage:
  python3 scripts/gguf_logits.py MODEL_PATH IDS_JSON OUT_JSON
      MODEL_PATH: a .gguf file (read by transformers' GGUF loader,
                  AutoModelForCausalLM.from_pretrained(folder, gguf_file=name),
                  which needs the `gguf` package) or a Hugging Face model folder.
      IDS_JSON:   a file holding a JSON list of token ids (one sequence).
      OUT_JSON:   receives {"logits": [[V floats] per position],
                  "architecture": model.config.model_type}.
  The model runs in float32 on the CPU, in eval mode, without a cache, with
  eager attention (the reference arithmetic; Gemma 2's soft cap needs it).
  Exits non-zero (the error on stderr) when loading or running fails.
Needs: torch, transformers (and gguf for .gguf files).
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM


def load(path: str):
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                    attn_implementation="eager")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    model_path, ids_path, out_path = sys.argv[1:]
    with open(ids_path) as f:
        ids = json.load(f)
    model = load(model_path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], dtype=torch.long), use_cache=False).logits[0]
    with open(out_path, "w") as f:
        json.dump({"logits": logits.tolist(), "architecture": model.config.model_type}, f)


if __name__ == "__main__":
    main()
