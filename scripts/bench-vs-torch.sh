#!/usr/bin/env bash
# Side-by-side: macrobatch vs the PyTorch eager twin (../shared/peers/torch_gpt.py)
# on the same model, batch and threads, alternating rounds on the same machine.
#
#   scripts/bench-vs-torch.sh [tiny|gpt2] [ROUNDS] [THREADS] [f32|bf16]
#
# bf16: macrobatch runs train.precision = "bf16" (bf16 GEMM operands where the
# CPU has AVX512-BF16), the peer runs bf16 autocast (--dtype bf16).
# Needs: python3 with torch (pip install torch numpy).
#
# Rounds alternate which side runs first (drift on a shared machine hits
# both sides alike), and each round is a pair measured back to back. The
# result is the median of the per-round ratios (ours / torch) with its
# min–max and a distribution-free interval for that median (order
# statistics of the pairs, >= 90% coverage, e.g. the extremes of 6 pairs
# cover it with 97%), and a verdict against the goal (1.5x f32, 1.25x
# bf16; GOAL=x overrides): met, missed, or "spread too wide to conclude"
# when the interval straddles it. ROUNDS defaults to 6.
set -euo pipefail
cd "$(dirname "$0")/.."
shape=${1:-tiny}; rounds=${2:-6}; threads=${3:-2}; dtype=${4:-f32}
case "$dtype" in f32|bf16) ;; *) echo "dtype must be f32 or bf16"; exit 2 ;; esac
peer=${TORCH_GPT:-../shared/peers/torch_gpt.py}
[ -f "$peer" ] || { echo "peer script not found: $peer (set TORCH_GPT)"; exit 2; }
case "$shape" in
  tiny) L=4 H=4 C=256 T=128 V=256 B=8 steps=15 warm=3 ;;
  gpt2) L=12 H=12 C=768 T=256 V=50257 B=4 steps=4 warm=2 ;;
  *) echo "shape must be tiny or gpt2"; exit 2 ;;
esac
cargo build --release -q
ours=(); theirs=()
run_ours() {
  target/release/macrobatch bench --json --no-k-sweep --steps $steps --warmup $warm \
      --set model.n_layer=$L --set model.n_head=$H --set model.n_embd=$C --set model.vocab_size=$V \
      --set model.block_size=$T --set batch.micro=$B --set batch.global=$B --set train.threads=$threads --set train.precision=$dtype \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["step"]["tokens_per_s"])'
}
run_torch() {
  python3 "$peer" --n-layer $L --n-head $H --n-embd $C --block-size $T --vocab-size $V \
      --micro-batch $B --threads $threads --steps $steps --warmup $warm --dtype $dtype 2>/dev/null \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])'
}
for r in $(seq 1 "$rounds"); do
  if (( r % 2 )); then o=$(run_ours); t=$(run_torch); first=macrobatch; else t=$(run_torch); o=$(run_ours); first=torch; fi
  echo "round $r ($first first): macrobatch $o tokens/s, torch $t tokens/s, ratio $(python3 -c "print(f'{$o/$t:.3f}')")"
  ours+=("$o"); theirs+=("$t")
done
goal=${GOAL:-$([ "$dtype" = f32 ] && echo 1.5 || echo 1.25)}
python3 - "${ours[*]}" "${theirs[*]}" "$shape" "$threads" "$dtype" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" "$goal" <<'PY'
import math, statistics, sys
o = [float(x) for x in sys.argv[1].split()]; t = [float(x) for x in sys.argv[2].split()]
shape, threads, dtype, cpu, goal = sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], float(sys.argv[7])
ratios = sorted(a / b for a, b in zip(o, t))
n = len(ratios)
med = statistics.median(ratios)
# Distribution-free interval for the median: [X(j), X(n+1-j)] covers it with
# probability 1 - 2 P(Binomial(n, 1/2) <= j - 1); the largest j with >= 90%.
def coverage(j):
    return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n
j = max([j for j in range(1, n // 2 + 1) if coverage(j) >= 0.9], default=None)
peer = "torch eager" + ("" if dtype == "f32" else " autocast")
print(f"{shape} {dtype} @ {threads} threads on{cpu}: macrobatch median {statistics.median(o):.0f} tokens/s, {peer} {statistics.median(t):.0f} tokens/s")
print(f"ratio over {n} alternating pairs: median {med:.2f}x, min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x", end="")
if j is None:
    print(f"; {n} pairs are too few for a 90% interval (run at least 5)")
    sys.exit(0)
lo, hi = ratios[j - 1], ratios[n - j]
print(f"; {coverage(j):.0%} interval for the median {lo:.2f}x–{hi:.2f}x")
if lo >= goal:
    print(f"goal {goal}x: met (the whole interval is above it)")
elif hi < goal:
    print(f"goal {goal}x: missed (the whole interval is below it)")
else:
    print(f"goal {goal}x: spread too wide to conclude (the interval straddles it); run more rounds on a quieter machine")
PY
