#!/usr/bin/env bash
# Side by side on this machine: our tiled attention (nn::flash, through
# crates/nn/examples/attention_bench.rs) and PyTorch's
# scaled_dot_product_attention on CPU, forward and backward, SmolLM2's
# attention shape, one causal sequence of each length, f32, same threads,
# medians of 5 runs after a warm-up, alternating for ROUNDS rounds.
#
#   scripts/attention-vs-sdpa.sh [ROUNDS] [THREADS] [T ...]    (default 3 2 1024 2048)
#
# Needs python3 with torch (pip install torch). Prints each round and the
# ratio of medians (ours / torch: below 1 is faster).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}; threads=${2:-2}; shift 2 || true
lens=("$@"); [ ${#lens[@]} -gt 0 ] || lens=(1024 2048)
cargo build --release -q -p macrobatch-nn --example attention_bench
ours=$(mktemp); theirs=$(mktemp); trap 'rm -f "$ours" "$theirs"' EXIT
for r in $(seq 1 "$rounds"); do
  RAYON_NUM_THREADS=$threads target/release/examples/attention_bench "${lens[@]}" \
    | awk '$2 == "flash" { print $1, $3, $4 }' | tee -a "$ours" | sed "s/^/round $r ours  T fwd bwd: /"
  python3 scripts/attention_sdpa.py --threads "$threads" "${lens[@]}" | tee -a "$theirs" | sed "s/^/round $r torch T fwd bwd: /"
done
python3 - "$ours" "$theirs" "$threads" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" <<'PY'
import collections, statistics, sys
def load(path):
    d = collections.defaultdict(lambda: ([], []))
    for line in open(path):
        t, f, b = line.split()
        d[int(t)][0].append(float(f)); d[int(t)][1].append(float(b))
    return d
o, t = load(sys.argv[1]), load(sys.argv[2])
print(f"median ms over rounds, {sys.argv[3]} threads on{sys.argv[4]}:")
for n in sorted(o):
    of, ob = statistics.median(o[n][0]), statistics.median(o[n][1])
    tf, tb = statistics.median(t[n][0]), statistics.median(t[n][1])
    print(f"T={n}: forward ours {of:.1f} / sdpa {tf:.1f} = {of/tf:.2f}x; backward ours {ob:.1f} / sdpa {tb:.1f} = {ob/tb:.2f}x; "
          f"forward+backward {(of+ob)/(tf+tb):.2f}x")
PY
