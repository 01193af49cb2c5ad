#!/usr/bin/env bash
# ms/step, bytes communicated per step and per-rank memory of every ZeRO stage
# at W = 2 and W = 4, under mpirun, on the `mini` preset (10.7M parameters).
#
#   scripts/zero-table.sh [STEPS]
#
# Needs OpenMPI (apt-get install libopenmpi-dev openmpi-bin libclang1-14 libclang-common-14-dev).
# Prints a Markdown table (docs/zero.md holds one).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-6}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader
export MALLOC_MMAP_THRESHOLD_=65536
cargo build --release -q --features mpi
out=$(mktemp -d)
echo "| W | stage | ms/step (median) | comm MB/step/rank | params MB | grads MB | optimizer MB | comm buffers MB | model states MB (formula) | measured MB (rank 0..W-1) | peak RSS MB (max) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for w in 2 4; do
  for stage in 0 1 2 3; do
    dir="$out/w$w-s$stage"
    mpirun -np "$w" target/release/macrobatch train --out "$dir" \
      --set model.preset=mini --set data.seq_len=128 --set batch.micro=2 --set batch.global=$((2 * w)) \
      --set train.steps="$steps" --set train.threads=1 --set train.eval_every=0 --set train.eval_batches=1 \
      --set dist.zero_stage="$stage" >/dev/null 2>&1
    python3 - "$dir" "$w" "$stage" <<'PY'
import json, statistics, sys
d, w, stage = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")][1:]  # skip the first (warm-up) step
m = json.load(open(f"{d}/memory.json"))
a = m["accounting"]
mb = lambda x: f"{x / 1e6:.1f}"
states = a["params"] + a["grads"] + a["optimizer"] + a["master"]
print(f"| {w} | {stage} | {statistics.median(r['step_ms'] for r in rows):.0f} | {mb(statistics.median(r['comm_bytes'] for r in rows))} "
      f"| {mb(a['params'])} | {mb(a['grads'])} | {mb(a['optimizer'])} | {mb(a['comm_buffers'])} "
      f"| {mb(states)} ({mb(m['formula_model_states'])}) | {' / '.join(mb(x) for x in m['measured_model_states'])} | {mb(max(m['peak_rss']))} |")
PY
  done
done
rm -rf "$out"
