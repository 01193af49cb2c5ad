"""Replays a macrobatch LoRA run in PyTorch + PEFT and compares the loss of
every optimizer step.

    macrobatch train CONFIG --init-from MODEL.gguf --out RUN --dump-steps RUN/dump
    python3 scripts/lora_vs_peft.py RUN MODEL.gguf [--atol 5e-4] [--rtol 1e-3]
    python3 scripts/lora_vs_peft.py RUN BASE_DIR   # a Hugging Face folder instead

With train.frozen_dtype = "nf4" the peer must start from the same
dequantised base: scripts/nf4-vs-peft.sh writes it out (with
train.save_base the run's model.safetensors is the base dequantised) and
replays on it.

The peer: transformers' LlamaForCausalLM loaded from the same GGUF (float32),
PEFT LoRA adapters with the same r, alpha and targets, set to macrobatch's
initial adapter values (RUN/dump/initial_trainable.safetensors), the same
micro-batches in the same order (RUN/dump/steps.jsonl), the loss summed over
each micro-batch and divided by the target tokens of the whole step (the
batch contract), torch.optim.AdamW with the run's betas/eps/weight decay,
clip_grad_norm_ and the same warmup + decay schedule, stepped once per
optimizer step. Prints both curves; exits 1 when a step's losses differ by
more than atol + rtol·|loss|.

Tolerance: at step 1 (same parameters) the losses differ only by the
forward's f32 rounding — 30 layers summed in another order (our GEMM vs
MKL): 4e-5 relative, as for the plain model's logits. Training at lr 1e-3
then lets those differences grow (AdamW divides each gradient by its own
magnitude, so rounding in tiny gradients becomes step-sized): measured up
to 2.2e-4 absolute over 20 steps on the AMD EPYC dev VM, with losses
falling from 2.7 to 0.001. A wrong normalization, schedule, clip or
optimizer moves step 2's loss by 1e-2 or more.
With train.objective = "dpo" the peer computes TRL's DPOTrainer loss
(loss_type "sigmoid") instead: each micro-batch's rows are (chosen,
rejected) pairs; the policy's summed log probability of each reply's
targets, the reference's with PEFT's adapters disabled (the same model,
no second copy, as ours), loss = -logsigmoid(beta * ((pi_c - ref_c) -
(pi_r - ref_r))), summed over a step's pairs and divided by their number.
The same tolerance argument holds.
Needs torch, transformers, peft, gguf, accelerate.
"""
import argparse
import json
import math
import pathlib
import sys
import tomllib

import torch
from safetensors.torch import load_file
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("run")
ap.add_argument("gguf")
ap.add_argument("--atol", type=float, default=5e-4)
ap.add_argument("--rtol", type=float, default=1e-3)
ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
ap.add_argument("--json", help="write step times and losses to this file")
ap.add_argument(
    "--profile",
    action="store_true",
    help="print where PEFT's steps after the first go, by operator (torch.profiler, self CPU time), "
    "beside `macrobatch bench --init-from`'s kernel families",
)
ap.add_argument(
    "--bf16",
    action="store_true",
    help="run the forward under torch.autocast(bfloat16), for a run with train.precision = \"bf16\": "
    "for speed only, the losses are printed but not compared (each side rounds different ops to bf16)",
)
args = ap.parse_args()
run = pathlib.Path(args.run)
gguf = pathlib.Path(args.gguf)
cfg = tomllib.loads((run / "config.resolved.toml").read_text())
torch.manual_seed(0)
if args.threads > 0:
    torch.set_num_threads(args.threads)
import time

if gguf.suffix == ".gguf":
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
else:
    # A Hugging Face folder: e.g. an NF4 run's base dequantised (its model.safetensors + config.json).
    model = AutoModelForCausalLM.from_pretrained(gguf, dtype=torch.float32)
lora = cfg["lora"]
targets = lora["target_modules"]
if targets == ["all-linear"]:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
peft_cfg = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0, target_modules=targets, bias="none")
model = get_peft_model(model, peft_cfg)
# macrobatch's initial adapters, by name.
init = load_file(run / "dump" / "initial_trainable.safetensors")
named = dict(model.named_parameters())
with torch.no_grad():
    for name, value in init.items():
        peft_name = "base_model.model." + name.replace(".weight", ".default.weight")
        named[peft_name].copy_(value)
trainable = [p for p in model.parameters() if p.requires_grad]
assert sum(p.numel() for p in trainable) == sum(v.numel() for v in init.values()), "adapter sizes differ"

o, s, t = cfg["optim"], cfg["schedule"], cfg["train"]
opt = torch.optim.AdamW(trainable, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"], weight_decay=o["weight_decay"])


def lr_at(i):
    # macrobatch's LrSchedule (engine/src/schedule.rs): warmup i < W uses lr·(i+1)/W.
    w, total, hi, lo = s["warmup_steps"], t["steps"], o["lr"], s["min_lr"]
    if i < w:
        return hi * (i + 1) / w
    progress = min((i - w) / max(total - w, 1), 1.0)
    return {"constant": hi, "linear": hi + (lo - hi) * progress, "cosine": lo + 0.5 * (hi - lo) * (1 + math.cos(math.pi * progress))}[s["kind"]]


dpo = t.get("objective", "lm") == "dpo"
beta = t.get("dpo_beta", 0.1)


def row_logps(logits, y):
    # Summed log probability of each row's targets (padding and prompt are -100).
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none")
    return -ce.sum(dim=1)


def dpo_loss_sum(logits, x, y):
    # TRL DPOTrainer, loss_type="sigmoid": rows are chosen0, rejected0, chosen1, ...
    policy = row_logps(logits, y)
    with torch.no_grad(), model.disable_adapter():
        reference = row_logps(model(input_ids=x).logits, y)
    pi_c, pi_r, ref_c, ref_r = policy[0::2], policy[1::2], reference[0::2], reference[1::2]
    z = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    return -torch.nn.functional.logsigmoid(z).sum()


ours = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
steps = [json.loads(l) for l in (run / "dump" / "steps.jsonl").read_text().splitlines()]
worst, failed = 0.0, 0
times, tokens = [], []
print("step  macrobatch    peft          |diff|")
profiler = None
for i, step in enumerate(steps):
    if args.profile and i == 1:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    for g in opt.param_groups:
        g["lr"] = lr_at(i)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    if dpo:
        n_total = sum(mb["n_seqs"] // 2 for mb in step["micro_batches"])
    else:
        n_total = sum(sum(1 for x in mb["targets"] if x >= 0) for mb in step["micro_batches"])
    loss_sum = 0.0
    for mb in step["micro_batches"]:
        b, T = mb["n_seqs"], mb["seq_len"]
        x = torch.tensor(mb["inputs"]).view(b, T)
        y = torch.tensor(mb["targets"]).view(b, T)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=x).logits
        logits = logits.float()
        if dpo:
            l = dpo_loss_sum(logits, x, y)
        else:
            l = torch.nn.functional.cross_entropy(logits.view(b * T, -1), y.view(-1), ignore_index=-100, reduction="sum")
        (l / n_total).backward()
        loss_sum += l.item()
    if t["grad_clip"] > 0:
        torch.nn.utils.clip_grad_norm_(trainable, t["grad_clip"])
    opt.step()
    times.append(time.perf_counter() - t0)
    tokens.append(sum(mb["n_seqs"] * mb["seq_len"] for mb in step["micro_batches"]))
    peft_loss = loss_sum / n_total
    mb_loss = ours[i]["loss"]
    diff = abs(mb_loss - peft_loss)
    worst = max(worst, diff)
    ok = args.bf16 or diff <= args.atol + args.rtol * abs(peft_loss)
    failed += not ok
    print(f"{i + 1:4d}  {mb_loss:.8f}  {peft_loss:.8f}  {diff:.2e}{'' if ok else '  FAIL'}")
if profiler is not None:
    profiler.__exit__(None, None, None)
    print(f"peft: where steps 2..{len(steps)} went, by operator (self CPU time):")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
print(f"largest difference over {len(steps)} steps: {worst:.2e}; {failed} step(s) outside {args.atol:.0e} + {args.rtol:.0e}·|loss|")
med = sorted(times)[len(times) // 2]
print(f"peft: median {med * 1e3:.0f} ms/step, {sum(tokens) / sum(times):.0f} tokens/s over {len(times)} steps ({torch.get_num_threads()} threads)")
if args.json:
    pathlib.Path(args.json).write_text(json.dumps({"step_s": times, "tokens": tokens, "threads": torch.get_num_threads()}))
sys.exit(0 if failed == 0 else 1)
