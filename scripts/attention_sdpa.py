"""PyTorch's scaled_dot_product_attention on CPU, forward and backward, at
the shape crates/nn/examples/attention_bench.rs times ours at (SmolLM2's
attention: 9 query heads, 3 key/value heads, head width 64, one sequence,
causal, f32), with the same timing rule: one warm-up run, then the median
of 5 runs. Prints one line per length: T, forward ms, backward ms.

    python3 scripts/attention_sdpa.py [--threads N] T [T ...]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(f, reps=5):
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lens", type=int, nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    h, kv, d = 9, 3, 64
    for t in a.lens:
        q = torch.rand(1, h, t, d) - 0.5
        k = torch.rand(1, kv, t, d) - 0.5
        v = torch.rand(1, kv, t, d) - 0.5
        dy = torch.rand(1, h, t, d) - 0.5
        for x in (q, k, v):
            x.requires_grad_(True)

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def bwd():
            # The backward alone: the graph is kept, gradients overwritten.
            for x in (q, k, v):
                x.grad = None
            y.backward(dy, retain_graph=True)

        print(f"{t} {median_ms(fwd):.1f} {median_ms(bwd):.1f}", flush=True)


if __name__ == "__main__":
    main()
