#!/usr/bin/env python3
"""Checks that LoRA adapters macrobatch saved with its variants (rsLoRA,
DoRA) load in PEFT and compute the logits macrobatch computed.

Usage: python3 scripts/peft_variants_check.py BASE EXPECTED ADAPTER_DIR...
Needs: torch, transformers, peft, safetensors; gguf for a GGUF base.

BASE is a GGUF file (loaded by transformers, dequantised to float32, as
scripts/lora_vs_peft.py does) or a Hugging Face folder. EXPECTED is a
safetensors file written by the Rust test: `input_ids` [B, T] (as float32),
`base_logits` [B*T, V] (the base alone) and `logits.<i>` [B*T, V], the
adapted logits of the i-th ADAPTER_DIR (adapter_config.json +
adapter_model.safetensors, as llama::lora::save_adapter writes them).

Each adapter is applied with PeftModel.from_pretrained on a fresh copy of
the base (its config's use_rslora / use_dora read by PEFT itself), in eval
mode. Tolerance: max |difference| <= 2e-3 absolute on logits of magnitude
~30, as crates/llama/tests/smollm.rs allows for the base: both sides
compute in float32 and sum the 576- to 1536-term products of 30 layers in
other orders (~1e-4 measured for the base); DoRA's row norms add one
float32 reduction per row (~1e-7 relative). What the adapters change is
printed beside it: a scale of α/r instead of α/√r, or DoRA read as plain
LoRA, moves the logits by far more (the test asserts the change exceeds
100 times the tolerance). Exits 0 when every comparison passes, 1 otherwise.
"""
import copy
import pathlib
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

ATOL = 2e-3


def load_base(base: pathlib.Path):
    if base.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(base.parent, gguf_file=base.name, dtype=torch.float32)
    # Gemma 2 in eager attention: the implementation that applies its
    # attention soft cap (others keep transformers' default).
    eager = AutoConfig.from_pretrained(base).model_type == "gemma2"
    extra = {"attn_implementation": "eager"} if eager else {}
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **extra)


def compare(what, got, want) -> bool:
    err = (got - want).abs().max().item()
    ok = err <= ATOL
    print(f"{what}: max |difference| {err:.2e} (tolerance {ATOL:.0e}) {'ok' if ok else 'FAILED'}")
    return ok


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    base_path, expected_path, adapters = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    expected = load_file(expected_path)
    ids = expected["input_ids"].to(torch.long)
    base = load_base(base_path).eval()
    base.config.attn_implementation = "eager"
    ok = True
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits.reshape(-1, base.config.vocab_size)
        ok &= compare("base model", base_logits, expected["base_logits"])
        for i, adapter in enumerate(adapters):
            model = PeftModel.from_pretrained(copy.deepcopy(base), adapter).eval()
            cfg = model.peft_config["default"]
            got = model(input_ids=ids).logits.reshape(-1, base.config.vocab_size)
            change = (got - base_logits).abs().max().item()
            print(
                f"adapter {adapter}: r={cfg.r} lora_alpha={cfg.lora_alpha} use_rslora={cfg.use_rslora} "
                f"use_dora={cfg.use_dora}; it moves the logits by up to {change:.2e}"
            )
            ok &= compare(f"  base + adapter {i}", got, expected[f"logits.{i}"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
