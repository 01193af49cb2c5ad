#!/usr/bin/env bash
# Startup time and peak memory of a short run on a large memory-mapped token
# file vs the same run on a 1 MB one: the file is mapped, not read, so the two
# differ only by the pages samples touch (the sampler computes large
# epochs' orders index by index, holding none).
#
#   scripts/token-file-memory.sh [SIZE_MB]      (default 1024)
#
# Generates random u16 tokens in a temporary folder (removed at exit) and
# trains a 2-layer, d=64 model with model.vocab_size = 65536 on each file.
# Prints one line per file: startup (process start to the plan printed: config,
# data opened, memory checked), time to step 1, wall time, peak RSS, and the
# number of training sequences.
set -euo pipefail
cd "$(dirname "$0")/.."
mb=${1:-1024}
cargo build --release -q
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
head -c $((mb << 20)) /dev/urandom >"$tmp/big.bin"
head -c $((1 << 20)) "$tmp/big.bin" >"$tmp/small.bin"
grep -m1 'model name' /proc/cpuinfo
for f in small big; do
  # Drop the file from the page cache where allowed, so "big" is a cold start.
  sync
  { echo 1 >/proc/sys/vm/drop_caches; } 2>/dev/null || true
  python3 - "$tmp" "$f" <<'PY'
import os, subprocess, sys, time
tmp, f = sys.argv[1], sys.argv[2]
cmd = ["/usr/bin/time", "-v", "target/release/macrobatch", "train", "--out", f"{tmp}/run-{f}",
       "--set", f"data.path={tmp}/{f}.bin", "--set", "data.format=u16", "--set", "model.vocab_size=65536",
       "--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=2",
       "--set", "train.steps=5", "--set", "train.eval_every=0", "--set", "train.eval_batches=2",
       "--set", "batch.global=1", "--set", "batch.micro=1", "--set", "data.val_fraction=0.001"]
t0 = time.monotonic()
p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
planned = first = None
n_seqs = 0
lines = []
for line in p.stderr:
    lines.append(line)
    now = time.monotonic() - t0
    if planned is None and line.startswith("macrobatch: GPT-2"):
        planned = now
        n_seqs = int(line.split(" train / ")[0].split("| ")[-1])
    if first is None and line.startswith("step 1/"):
        first = now
p.wait()
wall = time.monotonic() - t0
if p.returncode != 0:
    sys.exit("".join(lines))
rss = next(int(l.split(":")[1]) for l in lines if "Maximum resident set size" in l)
size = os.path.getsize(f"{tmp}/{f}.bin")
print(f"{f:5} file {size / 2**20:7.0f} MiB: startup {planned:.3f} s, step 1 at {first:.3f} s, wall {wall:.2f} s, "
      f"peak RSS {rss / 1024:.1f} MiB; {n_seqs} train sequences")
PY
done
