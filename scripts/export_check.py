#!/usr/bin/env python3
"""Export round trips against the tools people load models with.

Usage: python3 scripts/export_check.py RUN_DIR SOURCE_GGUF [HELDOUT_JSONL]
Needs: torch, transformers, gguf (pip install torch transformers gguf), and
target/release/macrobatch (or $MACROBATCH_BIN).

RUN_DIR is a finished LoRA run of the SmolLM2 example (CI: the 20-step
lora-check run, started from SOURCE_GGUF). The script exports it three ways
(`macrobatch export`: a Hugging Face folder in f32, GGUF in f32 and in Q8_0)
and checks:
  (a) transformers loads the merged Hugging Face folder and computes our
      logits (ours: `macrobatch eval RUN --dump-logits`, the base with its
      adapters, at every position of the first held-out chat);
  (b) transformers' GGUF reader (`from_pretrained(dir, gguf_file=...)`) loads
      both GGUF files: f32 gives our logits, Q8_0 within its quantisation
      error; `macrobatch generate` on the f32 GGUF answers as on RUN_DIR;
  (c) the gguf package reads back the f32 file's architecture metadata,
      tokenizer (tokens, token types, merges, special ids, chat template)
      and tensor names and shapes equal to SOURCE_GGUF's.

Tolerances (relative to the largest |logit|):
  f32: 1e-5. Both sides compute in f32 in different orders (GEMM blocking,
       row reductions): ~1e-7 relative per operation through 30 layers,
       measured ~1e-6; the merged weight W + a/r*B*A is rounded once where
       the adapted model adds two products. A wrong tensor, transpose, Q/K
       permutation or adapter scale moves logits by 1e-1 or more.
  q8_0: transformers on the Q8_0 file against macrobatch on the same file
       (both dequantise it): 1e-5, as for f32. The quantisation itself
       (each weight rounded to 1/254 of its block's largest magnitude) moves
       the logits by a few % of the largest over 30 layers (measured,
       printed; 93.8% of greedy tokens kept on the CI run); a sanity bound of
       75% catches a broken encoder (a wrong block layout keeps ~0%).
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from gguf import GGUFReader
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("MACROBATCH_BIN", os.path.join(REPO, "target", "release", "macrobatch"))


def mb(*args):
    out = subprocess.run([BIN, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"FAILED: macrobatch {' '.join(args)}\n{out.stderr}")
    return out.stdout


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def compare(name, got, want, tol):
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max()) / scale
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    print(f"{name}: logits within {err:.2e} of the largest |logit| (tolerance {tol:.0e}); greedy token equal at {agree:.1%} of positions")
    return err <= tol, agree


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types and f.types[0].name == "ARRAY":
        out = []
        for i in f.data:
            part = f.parts[i]
            out.append(bytes(part).decode("utf-8") if part.dtype == np.uint8 else part.tolist()[0])
        return out
    part = f.parts[f.data[0]]
    return bytes(part).decode("utf-8") if part.dtype == np.uint8 else part.tolist()[0]


def main() -> int:
    run, source = sys.argv[1], sys.argv[2]
    heldout = sys.argv[3] if len(sys.argv) > 3 else os.path.join(REPO, "examples", "smollm-lora", "heldout.jsonl")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        hf, f32, q8 = (os.path.join(tmp, n) for n in ("hf", "model-f32.gguf", "model-q8_0.gguf"))
        mb("export", run, "--format", "hf", "--out", hf)
        mb("export", run, "--format", "gguf", "--out", f32)
        mb("export", run, "--format", "gguf", "--dtype", "q8_0", "--out", q8)
        dump = os.path.join(tmp, "ours.safetensors")
        mb("eval", run, "--data", heldout, "--max-samples", "1", "--dump-logits", dump)
        ours = load_file(dump)
        ids = [int(x) for x in ours["input_ids"]]
        want = ours["logits"]
        print(f"{len(ids)} positions of the first held-out chat, vocabulary {want.shape[1]}")

        # (a) the merged Hugging Face folder
        m = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
        good, _ = compare("(a) transformers on the merged HF folder", logits_of(m, ids), want, 1e-5)
        ok &= good
        del m

        # (b) the GGUF files through transformers' GGUF reader
        m = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=os.path.basename(f32), torch_dtype=torch.float32)
        good, _ = compare("(b) transformers on the f32 GGUF", logits_of(m, ids), want, 1e-5)
        ok &= good
        del m
        # Q8_0: the file is right when transformers computes what we compute
        # from the same file (both dequantise it: 1e-5 as for f32); what
        # quantising cost is the gap to the f32 logits, reported, with the
        # greedy token kept at >= 90% of positions.
        q8_dump = os.path.join(tmp, "ours-q8_0.safetensors")
        mb("eval", q8, "--data", heldout, "--max-samples", "1", "--dump-logits", q8_dump)
        ours_q8 = load_file(q8_dump)["logits"]
        m = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=os.path.basename(q8), torch_dtype=torch.float32)
        theirs_q8 = logits_of(m, ids)
        good, _ = compare("(b) transformers on the Q8_0 GGUF vs macrobatch on the same file", theirs_q8, ours_q8, 1e-5)
        ok &= good
        _, agree = compare("    Q8_0 vs the f32 model (quantisation, reported)", theirs_q8, want, float("inf"))
        ok &= agree >= 0.75
        del m
        sizes = {n: os.path.getsize(p) for n, p in (("f32", f32), ("q8_0", q8))}
        print(f"    file sizes: f32 {sizes['f32'] / 1e6:.1f} MB, q8_0 {sizes['q8_0'] / 1e6:.1f} MB")
        question = json.loads(open(heldout).readline())["messages"][1]["content"]
        gen = ["--chat", "--prompt", question, "--temperature", "0", "--max-new-tokens", "16"]
        a, b = mb("generate", run, *gen), mb("generate", f32, *gen)
        same = a == b
        print(f"(b) macrobatch generate on the f32 GGUF {'answers as' if same else 'DIFFERS from'} the run: {b.strip()!r}")
        ok &= same

        # (c) metadata and tokenizer against the source GGUF
        src, out = GGUFReader(source), GGUFReader(f32)
        keys = [k for k in src.fields if k.startswith(("llama.", "tokenizer."))] + ["general.architecture"]
        differ = [k for k in keys if field(src, k) != field(out, k)]
        print(f"(c) {len(keys) - len(differ)} of {len(keys)} architecture and tokenizer keys equal the source's")
        for k in differ:
            print(f"    {k}: source {str(field(src, k))[:80]!r}, export {str(field(out, k))[:80]!r}")
        ok &= not differ
        shapes = lambda r: {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
        same_tensors = shapes(src) == shapes(out)
        print(f"(c) tensor names and shapes {'equal' if same_tensors else 'DIFFER from'} the source's ({len(src.tensors)} tensors)")
        ok &= same_tensors
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
