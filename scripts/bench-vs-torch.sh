#!/usr/bin/env bash
# Side-by-side: macrobatch vs the PyTorch eager twin (../shared/peers/torch_gpt.py)
# on the same model, batch and threads, alternating rounds on the same machine.
#
#   scripts/bench-vs-torch.sh [tiny|gpt2] [ROUNDS] [THREADS] [f32|bf16]
#
# bf16: macrobatch runs train.precision = "bf16" (bf16 GEMM operands where the
# CPU has AVX512-BF16), the peer runs bf16 autocast (--dtype bf16).
# Needs: python3 with torch (pip install torch numpy). Prints each round and
# the ratio of median tokens/s (ours / torch).
set -euo pipefail
cd "$(dirname "$0")/.."
shape=${1:-tiny}; rounds=${2:-3}; threads=${3:-2}; dtype=${4:-f32}
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
for r in $(seq 1 "$rounds"); do
  o=$(target/release/macrobatch bench --json --no-k-sweep --steps $steps --warmup $warm \
      --set model.n_layer=$L --set model.n_head=$H --set model.n_embd=$C --set model.vocab_size=$V \
      --set model.block_size=$T --set batch.micro=$B --set batch.global=$B --set train.threads=$threads --set train.precision=$dtype \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["step"]["tokens_per_s"])')
  t=$(python3 "$peer" --n-layer $L --n-head $H --n-embd $C --block-size $T --vocab-size $V \
      --micro-batch $B --threads $threads --steps $steps --warmup $warm --dtype $dtype 2>/dev/null \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')
  echo "round $r: macrobatch $o tokens/s, torch $t tokens/s"
  ours+=("$o"); theirs+=("$t")
done
python3 - "${ours[*]}" "${theirs[*]}" "$shape" "$threads" "$dtype" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" <<'PY'
import statistics, sys
o = [float(x) for x in sys.argv[1].split()]; t = [float(x) for x in sys.argv[2].split()]
mo, mt = statistics.median(o), statistics.median(t)
print(f"{sys.argv[3]} {sys.argv[5]} @ {sys.argv[4]} threads on{sys.argv[6]}: macrobatch {mo:.0f} tokens/s, torch eager{'' if sys.argv[5] == 'f32' else ' autocast'} {mt:.0f} tokens/s, ratio {mo/mt:.2f}x")
PY
