#!/usr/bin/env python3
"""The best BLAS rates on this machine, for comparison with `macrobatch bench`'s
GEMM table: f32 GEMM through numpy (its bundled OpenBLAS) and PyTorch (MKL on
x86), and bf16 GEMM through PyTorch (oneDNN: AVX512-BF16 / AMX where present),
on the GPT shapes, m×k×n, row-major. Median GFLOP/s of interleaved calls.

    OPENBLAS_NUM_THREADS=2 python3 scripts/blas-rates.py [THREADS]

Needs: pip install numpy torch.
"""
import statistics
import sys
import time

import numpy as np
import torch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
shapes = [(1024, 256, 768), (1024, 256, 1024), (1024, 1024, 256), (4096, 768, 2304), (4096, 768, 3072),
          (4096, 3072, 768), (1024, 768, 50304)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"{cpu}, {threads} threads, numpy {np.__version__}, torch {torch.__version__}")
print(f"{'m×k×n':>16} {'numpy f32':>10} {'torch f32':>10} {'torch bf16':>11}")
for m, k, n in shapes:
    a = np.random.rand(m, k).astype(np.float32)
    b = np.random.rand(k, n).astype(np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ta16, tb16 = ta.bfloat16(), tb.bfloat16()
    rates = {"np": [], "torch": [], "bf16": []}
    flops = 2 * m * k * n
    for _ in range(5 if m * k * n > 1 << 30 else 15):
        for name, f in (("np", lambda: a @ b), ("torch", lambda: ta @ tb), ("bf16", lambda: ta16 @ tb16)):
            t = time.perf_counter()
            f()
            rates[name].append(flops / (time.perf_counter() - t) / 1e9)
    med = {k_: statistics.median(v) for k_, v in rates.items()}
    print(f"{m}×{k}×{n:>6} {med['np']:>10.0f} {med['torch']:>10.0f} {med['bf16']:>11.0f}")
