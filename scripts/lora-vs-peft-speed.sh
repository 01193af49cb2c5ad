#!/usr/bin/env bash
# LoRA fine-tuning speed side by side: macrobatch vs PyTorch + PEFT eager on
# the same model (SmolLM2-135M-Instruct from its GGUF), the same micro-batches
# (macrobatch records them with --dump-steps; PEFT replays them), the same
# threads, in alternating rounds. Prints median ms/step and tokens/s (input
# tokens, padding included) per round and the ratio.
#
#   scripts/lora-vs-peft-speed.sh [ROUNDS] [STEPS] [THREADS] [FROZEN] [PRECISION]
#
# Defaults: 2 rounds, 6 steps, 2 threads, FROZEN = source (our base in the
# GGUF's Q4_1 blocks; PEFT's is always f32), PRECISION = f32. FROZEN = f32
# compares the same dtype on both sides; PRECISION = bf16 runs ours with
# train.precision = "bf16" and PEFT under torch.autocast(bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}; steps=${2:-6}; threads=${3:-2}; frozen=${4:-source}; precision=${5:-f32}
peer_flags=(); [[ $precision == bf16 ]] && peer_flags=(--bf16)
model=$(scripts/fetch-smollm.sh)
cargo build --release -q
out=$(mktemp -d)
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $threads threads, micro 1 x K 8, $steps steps (first skipped), our base: $frozen, precision: $precision"
for r in $(seq 1 "$rounds"); do
  run="$out/r$r"
  target/release/macrobatch train examples/smollm-lora/config.toml --init-from "$model" --out "$run" \
    --dump-steps "$run/dump" --set batch.accumulation_steps=8 --set train.steps="$steps" \
    --set train.eval_every=0 --set train.eval_batches=1 --set train.threads="$threads" \
    --set train.frozen_dtype="\"$frozen\"" --set train.precision="\"$precision\"" >/dev/null 2>&1
  python3 scripts/lora_vs_peft.py "$run" "$model" --threads "$threads" "${peer_flags[@]}" --json "$run/peft.json" >/dev/null 2>&1 || true
  python3 - "$run" <<'PY'
import json, sys, statistics
run = sys.argv[1]
ours = [json.loads(l) for l in open(f"{run}/metrics.jsonl")][1:]
steps = [json.loads(l) for l in open(f"{run}/dump/steps.jsonl")][1:]
peft = json.load(open(f"{run}/peft.json"))
toks = [sum(m["n_seqs"] * m["seq_len"] for m in s["micro_batches"]) for s in steps]
ms_ours = statistics.median(r["step_ms"] for r in ours)
ms_peft = statistics.median(t * 1e3 for t in peft["step_s"][1:])
tps_ours = sum(toks) / (sum(r["step_ms"] for r in ours) / 1e3)
tps_peft = sum(peft["tokens"][1:]) / sum(peft["step_s"][1:])
print(f"round: macrobatch {ms_ours:.0f} ms/step {tps_ours:.0f} tok/s | peft {ms_peft:.0f} ms/step {tps_peft:.0f} tok/s | ratio {tps_ours / tps_peft:.2f}x")
PY
done
rm -rf "$out"
