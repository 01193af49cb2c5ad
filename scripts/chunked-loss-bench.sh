#!/usr/bin/env bash
# The head and its loss over chunks of rows against the whole logits held
# at once: two builds of macrobatch run the same training step in turn —
# SmolLM2-135M's shape (vocabulary 49,152, tied head) on a random base, a
# full fine-tune (so the head's gradient is computed), micro MICRO × SEQ
# tokens, every block recomputed — and each round prints the step's time,
# the first step's heap growth (memory.json: what the step's activations
# and temporaries took), the process's peak RSS and the loss's bits.
#
#   scripts/chunked-loss-bench.sh OLD_BIN NEW_BIN [SEQ] [MICRO] [ROUNDS]
#
# OLD_BIN is a build of a commit before the chunked loss, e.g.
#   git worktree add /tmp/old 5ac316b && (cd /tmp/old && cargo build --release -p macrobatch)
#   scripts/chunked-loss-bench.sh /tmp/old/target/release/macrobatch target/release/macrobatch 2048 2 3
# PRESET (default smollm2-135m) picks another Llama-family shape and
# SETS adds `--set` overrides, e.g. Llama 3's vocabulary of 128,256 on two
# of its layers:
#   PRESET=llama3.2-1b SETS="model.n_layer=2" scripts/chunked-loss-bench.sh OLD NEW 1024 2 3
# Prints medians and the NEW / OLD ratios. Name the CPU next to the numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?OLD_BIN}; new=${2:?NEW_BIN}; seq=${3:-2048}; micro=${4:-2}; rounds=${5:-3}
# Freed large buffers go back to the OS at once, so the peak RSS measures what is live.
export MALLOC_MMAP_THRESHOLD_=65536
out=$(mktemp -d)
sets=()
for kv in ${SETS:-}; do sets+=(--set "$kv"); done
run() { # BIN DIR
  "$1" train --out "$2" --set model.family=llama --set model.preset="${PRESET:-smollm2-135m}" "${sets[@]}" \
    --set data.seq_len="$seq" --set batch.global="$micro" --set batch.micro="$micro" \
    --set train.steps=1 --set train.eval_every=0 --set train.eval_batches=1 \
    --set train.activation_checkpointing=blocks --set schedule.warmup_steps=0 >/dev/null 2>&1
}
for r in $(seq "$rounds"); do
  for which in old new; do
    bin=$old; [ "$which" = new ] && bin=$new
    run "$bin" "$out/$which-$r" || { echo "$which round $r failed"; exit 1; }
  done
done
python3 - "$out" "$rounds" "$seq" "$micro" <<'PY'
import json, statistics, sys
out, rounds, seq, micro = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = {"old": [], "new": []}
for which in rows:
    for r in range(1, rounds + 1):
        d = f"{out}/{which}-{r}"
        m = json.loads(open(f"{d}/metrics.jsonl").readline())
        mem = json.load(open(f"{d}/memory.json"))
        rows[which].append((m["step_ms"], mem["first_step_growth"] / 2**20, max(mem["peak_rss"]) / 2**20, m["loss"]))
print(f"seq {seq} x micro {micro}, {rounds} rounds (old, new alternating)")
print("| build | step ms (median, min-max) | first-step growth MiB | peak RSS MiB | loss |")
print("|---|---|---|---|---|")
med = {}
for which, rs in rows.items():
    ms = [x[0] for x in rs]
    med[which] = [statistics.median(x[i] for x in rs) for i in range(3)]
    losses = sorted({x[3].hex() for x in rs})
    print(f"| {which} | {med[which][0]:.0f} ({min(ms):.0f}-{max(ms):.0f}) | {med[which][1]:.1f} | {med[which][2]:.1f} | {', '.join(losses)} |")
n, o = med["new"], med["old"]
print(f"new / old: step time {n[0] / o[0]:.3f}, first-step growth {n[1] / o[1]:.3f}, peak RSS {n[2] / o[2]:.3f}")
PY
