#!/usr/bin/env bash
# The LoRA example on an NF4 base against PyTorch + PEFT on the same
# dequantised weights: trains STEPS steps with train.frozen_dtype = "nf4"
# (--dump-steps) with train.save_base (the run folder's model.safetensors
# is then the base as the run held it: every projection dequantised from
# its NF4 blocks), copies that base into a folder of its own, and replays
# the run there with scripts/lora_vs_peft.py.
#
#   scripts/nf4-vs-peft.sh [OUT_DIR] [STEPS]     # default /tmp/nf4-vs-peft, 2 steps
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/nf4-vs-peft}
steps=${2:-2}
model=$(scripts/fetch-smollm.sh)
bin=${MACROBATCH_BIN:-target/release/macrobatch}
rm -rf "$out"
"$bin" train examples/smollm-lora/config.toml --init-from "$model" --out "$out/run" \
  --dump-steps "$out/run/dump" --set train.steps="$steps" --set 'train.frozen_dtype="nf4"' --set train.save_base=true
mkdir -p "$out/base"
cp "$out/run/model.safetensors" "$out/run/config.json" "$out/base/"
python3 scripts/lora_vs_peft.py "$out/run" "$out/base"
