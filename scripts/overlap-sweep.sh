#!/usr/bin/env bash
# Gradient communication under the backward (dist.overlap_comm): two ranks
# on two namespace hosts joined by a rate-limited link (scripts/netns), at
# K = 1 and K = 4 (4 sequences per micro-batch), buckets of 25 MiB (the
# default) and 4 MiB (SWEEP_BUCKET_MB), ZeRO stage SWEEP_ZERO (default 0),
# each run with and without overlap.
# Needs root, OpenMPI and a build with --features mpi.
#
#   scripts/overlap-sweep.sh [RATE] [STEPS]      # default 1gbit, 6 steps
#
# Prints per run the medians over the steps after the first: step time,
# exposed communication (comm_s: what the step waited for) and hidden
# communication (comm_hidden_s), then each rank's timeline of the last step
# (metrics.jsonl's overlap_ranks and comm_timeline), and checks that the
# losses and the saved weights are the same bits with and without overlap.
set -euo pipefail
cd "$(dirname "$0")/.."
buckets=${SWEEP_BUCKET_MB:-25 4}
zero=${SWEEP_ZERO:-0}
prefix=mbov
source scripts/netns/common.sh
netns_sweep_hosts $prefix "$@"
out=$(mktemp -d)
run() { # K OVERLAP BUCKET_MB
  local k=$1 overlap=$2 mb=$3 dir="$out/k$1-$2-b$3"
  scripts/netns/mpirun.sh --prefix $prefix --np 2 -- "$PWD/$bin" train --out "$dir" \
    --set model.preset="$model" --set data.seq_len=64 --set batch.micro=4 \
    --set batch.accumulation_steps="$k" --set train.steps="$steps" --set train.eval_every=0 \
    --set train.threads=1 --set train.checkpoint_every=0 --set schedule.warmup_steps=0 \
    --set dist.overlap_comm="$overlap" --set dist.bucket_mb="$mb" --set dist.zero_stage="$zero" >/dev/null 2>"$dir.err" || { cat "$dir.err" >&2; exit 1; }
  python3 - "$dir/metrics.jsonl" "$k" "$overlap" "$mb" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
med = lambda f: statistics.median(f(r) for r in rows)
step = med(lambda r: r["step_ms"])
comm = med(lambda r: r["comm_s"] * 1e3)
hidden = med(lambda r: r.get("comm_hidden_s", 0.0) * 1e3)
spread = max(r["step_ms"] for r in rows) - min(r["step_ms"] for r in rows)
print(f"| {sys.argv[2]} | {sys.argv[4]} | {sys.argv[3]} | {step:.0f} (spread {spread:.0f}) | {comm:.0f} | {100 * comm / step:.0f}% | {hidden:.0f} |")
PY
}
timeline() { # K BUCKET_MB
  python3 - "$out/k$1-true-b$2/metrics.jsonl" "$1" "$2" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
print(f"K = {sys.argv[2]}, buckets of {sys.argv[3]} MiB, step {r['step']}: per rank [step, end of last micro-step, waited, in collectives] (ms)")
for i, t in enumerate(r["overlap_ranks"]):
    print(f"  rank {i}: " + ", ".join(f"{1e3 * x:.0f}" for x in t))
t = r["comm_timeline"]
print(f"  rank 0's collectives (handed over, started, finished; ms from the step's start; last micro-step ended at {1e3 * t['backward_end_s']:.0f}):")
for c in t["collectives"]:
    print("   " + ", ".join(f"{1e3 * x:.0f}" for x in c))
PY
}
same() { # K BUCKET_MB
  local a="$out/k$1-false-b$2" b="$out/k$1-true-b$2"
  python3 - "$a/metrics.jsonl" "$b/metrics.jsonl" <<'PY'
import json, sys
la, lb = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert la == lb, f"losses differ: {la} vs {lb}"
PY
  cmp -s "$a/model.safetensors" "$b/model.safetensors" || { echo "K=$1 bucket $2 MiB: weights differ" >&2; exit 1; }
  echo "K = $1, buckets of $2 MiB: losses and model.safetensors identical with and without overlap"
}
echo "link: $rate (rate only where the kernel has no netem), model $model, seq 64, micro 4, 2 ranks, ZeRO $zero, $steps steps"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo
echo "| K | bucket MiB | overlap | step ms | exposed comm ms | exposed share | hidden comm ms |"
echo "|---|---|---|---|---|---|---|"
for k in 1 4; do for mb in $buckets; do run "$k" false "$mb"; run "$k" true "$mb"; done; done
echo
for k in 1 4; do for mb in $buckets; do same "$k" "$mb"; done; done
echo
for k in 1 4; do for mb in $buckets; do timeline "$k" "$mb"; done; done
rm -rf "$out"
