#!/usr/bin/env bash
# Tokens/s and the share of each step spent in gradient collectives against
# the accumulation steps K, for two ranks on two namespace hosts joined by a
# rate-limited link (scripts/netns): once at a fixed micro-batch (the
# global batch grows with K) and once at a fixed global batch. Needs root,
# OpenMPI and a build with --features mpi.
#
#   scripts/slow-link-sweep.sh [RATE] [STEPS]      # default 1gbit, 6 steps
#
# Prints one table row per run: K, micro, global batch, median input
# tokens/s and median comm share over the steps after the first.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=mbsw
source scripts/netns/common.sh
netns_sweep_hosts $prefix "$@"
out=$(mktemp -d)
run() { # K MICRO TABLE
  local k=$1 micro=$2 dir="$out/$3-k$1-m$2"
  scripts/netns/mpirun.sh --prefix $prefix --np 2 -- "$PWD/$bin" train --out "$dir" \
    --set model.preset="$model" --set data.seq_len=64 --set batch.micro="$micro" \
    --set batch.accumulation_steps="$k" --set train.steps="$steps" --set train.eval_every=0 \
    --set train.threads=1 --set train.checkpoint_every=0 --set schedule.warmup_steps=0 >/dev/null 2>"$dir.err" || { cat "$dir.err" >&2; exit 1; }
  python3 - "$dir/metrics.jsonl" "$k" "$micro" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
tps = statistics.median(r["input_tokens_per_s"] for r in rows)
share = statistics.median(100 * r["comm_s"] * 1e3 / r["step_ms"] for r in rows)
comm_ms = statistics.median(r["comm_s"] * 1e3 for r in rows)
k, micro = int(sys.argv[2]), int(sys.argv[3])
print(f"| {k} | {micro} | {2 * k * micro} | {tps:.0f} | {comm_ms:.0f} | {share:.0f}% |")
PY
}
echo "link: $rate (rate only where the kernel has no netem), model $model, seq 64, 2 ranks, $steps steps"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo
echo "fixed micro-batch (4 per rank): the global batch grows with K"
echo "| K | micro | global | input tok/s | comm ms/step | comm share |"
echo "|---|---|---|---|---|---|"
for k in 1 2 4 8 16; do run "$k" 4 micro; done
echo
echo "fixed global batch (64)"
echo "| K | micro | global | input tok/s | comm ms/step | comm share |"
echo "|---|---|---|---|---|---|"
for k in 1 2 4 8 16; do run "$k" $((32 / k)) global; done
rm -rf "$out"
