#!/usr/bin/env python3
"""Checks that a LoRA adapter macrobatch saved loads in PEFT and computes
what macrobatch computed.

Usage: python3 scripts/peft_check.py BASE_DIR ADAPTER_DIR EXPECTED_JSON
Needs: torch, transformers, peft (pip install torch transformers peft).

BASE_DIR is a Hugging Face directory (config.json + model.safetensors) of
any causal LM transformers knows (Llama, GPT-2, ...; e.g. written by
llama::hf::save or gpt::hf::save), ADAPTER_DIR a PEFT adapter
(adapter_config.json + adapter_model.safetensors, e.g. written by
llama::lora::save_adapter or gpt::lora::save_adapter), EXPECTED_JSON
macrobatch's logits:
{"input_ids": [[...], ...], "logits": [...] (B*T*V values, row-major),
 "base_logits": [...] (optional: the base model alone),
 "labels": [[...], ...], "loss": x (optional: the mean cross-entropy of
 the adapted model, -100 ignored, as transformers computes it)}.

It loads BASE_DIR with AutoModelForCausalLM.from_pretrained (checking our
config.json and weights on the way), compares the base logits if given,
wraps it with PeftModel.from_pretrained(ADAPTER_DIR) and compares the
adapted logits and loss. Tolerance: max |difference| <= 1e-4 of the
largest |logit| (and 1e-5 relative on the loss): both sides compute in f32
with different summation orders (~1e-6 relative, measured in
crates/llama/tests/torch_reference.rs), far below what a wrong tensor
name, transpose or scale would do (~1e-1).
Exits 0 when every comparison passes, 1 otherwise.
"""
import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

TOL = 1e-4


def compare(what, got, want) -> bool:
    want = torch.tensor(want, dtype=torch.float32).reshape(got.shape)
    err = ((got - want).abs().max() / want.abs().max()).item()
    ok = err <= TOL
    print(f"{what}: max |difference| {err:.2e} of the largest logit (tolerance {TOL:.0e}) {'ok' if ok else 'FAILED'}")
    return ok


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    base_dir, adapter_dir, expected_path = sys.argv[1:]
    with open(expected_path) as f:
        expected = json.load(f)
    ids = torch.tensor(expected["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ok = True
    with torch.no_grad():
        if "base_logits" in expected:
            ok &= compare("base model", model(input_ids=ids).logits, expected["base_logits"])
        peft_model = PeftModel.from_pretrained(model, adapter_dir).eval()
        cfg = peft_model.peft_config["default"]
        print(f"adapter: r={cfg.r} lora_alpha={cfg.lora_alpha} target_modules={sorted(cfg.target_modules)}")
        ok &= compare("base + adapter", peft_model(input_ids=ids).logits, expected["logits"])
        if "loss" in expected:
            # Every position against our targets (already the next
            # tokens; -100 ignored), averaged over the counted ones.
            logits = peft_model(input_ids=ids).logits
            targets = torch.tensor(expected["labels"])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
            ).item()
            err = abs(loss - expected["loss"]) / abs(expected["loss"])
            good = err <= 1e-5
            print(f"loss: ours {expected['loss']:.7f}, PEFT {loss:.7f}, relative difference {err:.1e} {'ok' if good else 'FAILED'}")
            ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
