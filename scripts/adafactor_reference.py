"""transformers' Adafactor on fixed parameters and gradients, for
crates/engine/tests/adafactor_reference.rs, which runs it and compares our
updates. A 2-D tensor (factored second moment), a 1-D one (per element) and
two matrices with a dimension of 1 (factored by transformers, per element by
us: the same update in exact arithmetic), four steps per case. Prints lines
the test parses:

    case NAME lr relative_step scale_parameter warmup_init beta1 weight_decay clip_threshold
    shape TENSOR d...         (in layout order)
    init TENSOR v...          (parameters before step 1)
    grad STEP TENSOR v...     (the gradient of step STEP, 1-based)
    after STEP TENSOR v...    (parameters after step STEP)

Values are float32 written with Python's shortest round-trip repr.
Usage: python3 scripts/adafactor_reference.py
"""

import torch
from transformers.optimization import Adafactor

CASES = [
    # transformers' constructor defaults: relative step, parameter scale.
    ("defaults", dict(lr=None)),
    ("warmup_init", dict(lr=None, warmup_init=True)),
    # What Hugging Face Trainer passes for optim="adafactor", with a first
    # moment, weight decay and a clip threshold the updates reach.
    (
        "explicit",
        dict(lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9, weight_decay=0.1, clip_threshold=0.5),
    ),
]
SHAPES = {"w": (3, 4), "b": (5,), "row": (1, 6), "col": (4, 1)}


def fmt(t):
    return " ".join(repr(float(x)) for x in t.detach().reshape(-1).tolist())


def main():
    for name, kw in CASES:
        g = torch.Generator().manual_seed(1234)
        params = {k: torch.nn.Parameter(torch.randn(s, generator=g)) for k, s in SHAPES.items()}
        opt = Adafactor(list(params.values()), **kw)
        group = opt.param_groups[0]
        print(
            "case",
            name,
            repr(float(group["lr"] or 0.0)),
            int(group["relative_step"]),
            int(group["scale_parameter"]),
            int(group["warmup_init"]),
            repr(float(group["beta1"])) if group["beta1"] is not None else "none",
            repr(float(group["weight_decay"])),
            repr(float(group["clip_threshold"])),
        )
        for k, p in params.items():
            print("shape", k, *p.shape)
            print("init", k, fmt(p))
        for step in range(1, 5):
            for k, p in params.items():
                p.grad = torch.randn(p.shape, generator=g) * (2.0 if k == "b" else 0.5)
                print("grad", step, k, fmt(p.grad))
            opt.step()
            for k, p in params.items():
                print("after", step, k, fmt(p))


if __name__ == "__main__":
    main()
