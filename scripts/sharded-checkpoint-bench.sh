#!/usr/bin/env bash
# Sharded against whole checkpoints (train.checkpoint_sharded), side by side:
#   save: a fresh run on 8 thread ranks (P 2 × T 2 × D 2) — build, one step,
#         its checkpoint (--stop-after 1);
#   load: that checkpoint resumed at D 4 with ZeRO-3 without a step — the
#         load and the final save (whole: gathered and written; sharded: the
#         last checkpoint named) — on a fresh copy of the folder each time
#         (the copy is timed too, the same for both).
# Runs alternate (sharded, whole, sharded, …) so drift hits both; prints
# each variant's median, min and max wall time and peak RSS (GNU time).
#
#   scripts/sharded-checkpoint-bench.sh [RUNS]      # default 5
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
cargo build --release -q -p macrobatch
bin=$PWD/target/release/macrobatch
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
sets=(--set model.n_layer=8 --set model.n_embd=768 --set model.n_head=12 --set model.block_size=64
  --set batch.global=8 --set batch.micro=1 --set batch.accumulation_steps=4 --set train.steps=10
  --set train.eval_every=0 --set train.threads=1 --set dist.world_size=8 --set dist.tensor_parallel=2
  --set dist.pipeline_parallel=2)
resume=(--set train.steps=1 --set dist.world_size=4 --set dist.tensor_parallel=1 --set dist.pipeline_parallel=1
  --set dist.zero_stage=3 --set batch.accumulation_steps=2)
timed() { # FILE COMMAND...: appends "wall_s max_rss_kib"
  local file=$1
  shift
  /usr/bin/time -f "%e %M" -a -o "$file" "$@" >/dev/null 2>"$out/err" || { cat "$out/err" >&2; exit 1; }
}
for sharded in true false; do
  "$bin" train --out "$out/src-$sharded" "${sets[@]}" --set train.checkpoint_sharded=$sharded --stop-after 1 \
    >/dev/null 2>&1
done
for _ in $(seq "$runs"); do
  for sharded in true false; do
    rm -rf "$out/run"
    timed "$out/save-$sharded" "$bin" train --out "$out/run" "${sets[@]}" \
      --set train.checkpoint_sharded=$sharded --stop-after 1
    rm -rf "$out/res"
    timed "$out/load-$sharded" sh -c "cp -a '$out/src-$sharded' '$out/res' && exec '$bin' train --resume '$out/res' $(printf '%q ' "${resume[@]}")"
  done
done
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $runs runs each"
echo "checkpoint: $(du -sh "$out/src-true/checkpoints/step-00000001" | cut -f1) sharded, $(du -sh "$out/src-false/checkpoints/step-00000001" | cut -f1) whole"
for phase in save load; do
  for sharded in true false; do
    python3 - "$out/$phase-$sharded" "$phase" "$sharded" <<'EOF'
import statistics, sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip() and l[0].isdigit()]
wall, rss = [r[0] for r in rows], [r[1] / 1024 for r in rows]
kind = "sharded" if sys.argv[3] == "true" else "whole"
print(f"{sys.argv[2]:<5} {kind:<8} wall median {statistics.median(wall):6.2f} s (min {min(wall):.2f}, max {max(wall):.2f})"
      f"  peak RSS median {statistics.median(rss):7.0f} MiB (min {min(rss):.0f}, max {max(rss):.0f})")
EOF
  done
done
