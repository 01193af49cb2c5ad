#!/usr/bin/env bash
# The memory model against measured peak RSS: for each preset, ZeRO stage,
# precision and checkpointing choice, a short run (thread ranks, W = 2 for
# stages > 0) records `mem_predicted` (the plan's per-process bytes) and
# the process's peak resident set (VmHWM) in memory.json.
#
#   scripts/memory-table.sh [PRESETS...]      # default: tiny mini small
#   STAGES="0" SEQ=128 scripts/memory-table.sh llama/tiny llama/smollm2-135m
#
# A preset `FAMILY/NAME` picks the model family (default gpt2); STAGES
# limits the ZeRO stages (default "0 1 2 3"), SEQ sets data.seq_len.
#
# Prints a Markdown table (docs/memory.md holds one). Name the CPU next to it.
set -euo pipefail
cd "$(dirname "$0")/.."
presets=("${@:-tiny mini small}")
# Freed large buffers go back to the OS at once, so VmHWM measures what is live.
export MALLOC_MMAP_THRESHOLD_=65536
# MACROBATCH_BIN: a binary to measure instead of building this checkout's.
bin=${MACROBATCH_BIN:-}
if [ -z "$bin" ]; then cargo build --release -q; bin=target/release/macrobatch; fi
out=$(mktemp -d)
echo "| preset | W | stage | precision | checkpointing | predicted MiB | measured peak MiB | error | per rank: predicted / measured heap MiB |"
echo "|---|---|---|---|---|---|---|---|---|"
for spec in ${presets[@]}; do
  family=gpt2; preset=$spec
  if [[ "$spec" == */* ]]; then family=${spec%%/*}; preset=${spec#*/}; fi
  extra=()
  if [ -n "${SEQ:-}" ]; then extra+=(--set data.seq_len="$SEQ"); fi
  for stage in ${STAGES:-0 1 2 3}; do
    w=$([ "$stage" = 0 ] && echo 1 || echo 2)
    for prec in f32 bf16; do
      for ck in none blocks; do
        dir="$out/$family-$preset-$stage-$prec-$ck"
        "$bin" train --out "$dir" --set model.family="$family" --set model.preset="$preset" "${extra[@]}" \
          --set dist.world_size="$w" --set dist.zero_stage="$stage" --set train.precision="$prec" \
          --set train.activation_checkpointing="$ck" --set batch.global=16 --set batch.micro=$((8 / w)) \
          --set train.steps=2 --set train.eval_every=0 --set train.eval_batches=1 >/dev/null 2>&1 \
          || { echo "| $spec | $w | $stage | $prec | $ck | run failed | | | |"; continue; }
        python3 - "$dir" "$spec" "$w" "$stage" "$prec" "$ck" <<'PY'
import json, sys
d, preset, w, stage, prec, ck = sys.argv[1:]
m = json.load(open(f"{d}/memory.json"))
p = m["predicted"]
per_rank = sum(p[k] for k in ["params", "master", "grads", "optimizer", "comm_buffers", "comm_staging", "activations", "batches"])
training = per_rank * p["knobs"]["ranks_per_process"] + p["comm_shared"] + p["data"] + p["runtime"] + p["workspace"]
predicted = training  # the step phase: what VmHWM measures (no checkpoint, memory.json precedes the save)
measured = max(m["peak_rss"])
mib = lambda b: b / 2**20
heaps = m.get("peak_rank_heap", [])
ranks = " / ".join(f"{mib(h):.1f}" for h in heaps)
print(f"| {preset} | {w} | {stage} | {prec} | {ck} | {mib(predicted):.1f} | {mib(measured):.1f} | {100 * (predicted - measured) / measured:+.1f}% | {mib(per_rank):.1f} / {ranks} |")
PY
      done
    done
  done
done
rm -rf "$out"
