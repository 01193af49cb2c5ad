#!/usr/bin/env python3
"""Reference models made by transformers itself, without downloads, for the
families' conformance tests.

Usage:
  python3 scripts/hf_reference.py make KIND DIR
      KIND: qwen2 (Qwen2ForCausalLM: q/k/v biases, GQA, untied head,
            rope θ = 1e6), qwen2_windows (the same with
            use_sliding_window: a window of 8 keys on layer 1 only, by
            max_window_layers = 1), qwen3 (Qwen3ForCausalLM: per-head q/k RMSNorm,
            heads of width 32 where hidden / heads is 16, GQA, untied
            head, rope θ = 1e6), mistral (MistralForCausalLM: a sliding
            window of 8 keys over the 40 positions, GQA, untied head),
            phi3 (Phi3ForCausalLM: fused qkv_proj and gate_up_proj in the
            file, a sliding window of 8 keys, GQA, untied head), gemma2
            (Gemma2ForCausalLM, eager attention: GeGLU, (1 + w) norms
            with post norms, √C embedding scale, layer 0 with a window of 8
            keys and layer 1 without, scores scaled by 24^-½ with heads of
            16, attention and final soft caps of 2 and 5 — tight enough
            that they bite — tied head) or
            llama3 (LlamaForCausalLM with Llama 3 RoPE
            scaling: rope_type "llama3", factor 8, low/high frequency
            factors 1 and 4, original context 32 — so the head's
            frequencies fall in all three of its bands), mixtral
            (MixtralForCausalLM: 4 experts of width 96, top 2,
            renormalised), qwen2_moe (Qwen2MoeForCausalLM: 4 experts of
            width 48, top 2 not renormalised, a shared expert of width 80
            with its sigmoid gate, q/k/v biases) or qwen3_moe
            (Qwen3MoeForCausalLM: 4 experts of width 48, top 2
            renormalised, per-head q/k norms, heads of 32).
      Builds the model from a config with random weights (torch seed 0;
      biases and norms drawn too, so none is trivially 0 or 1), writes it
      with save_pretrained to DIR/model (f32 safetensors), and writes
      DIR/reference.json: {"input_ids": [[...]], "logits": [...] (T*V,
      row-major), "prompt": [...], "greedy": [...] (tokens greedy
      generation appends)}.
  python3 scripts/hf_reference.py check DIR REFERENCE_JSON
      Loads DIR (a model folder macrobatch wrote) with
      AutoModelForCausalLM and compares its logits on the reference's
      input_ids with the reference's. Tolerance: max |difference| <= 1e-4
      of the largest |logit| (both f32, different summation orders: ~1e-6
      measured; a wrong name, transpose, bias or RoPE band moves logits by
      ~1e-1). Exits 0 when they agree, 1 otherwise.
Needs: torch, transformers.
"""
import json
import os
import sys

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

TOL = 1e-4
VOCAB = 97


def make(kind: str, out: str) -> None:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    if kind == "qwen2":
        cfg = Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
        model = Qwen2ForCausalLM(cfg)
    elif kind == "qwen2_windows":
        cfg = Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=True,
                          sliding_window=8, max_window_layers=1, **common)
        assert cfg.layer_types == ["full_attention", "sliding_attention"], cfg.layer_types
        model = Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, head_dim=32, **common)
        model = Qwen3ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = MistralConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, sliding_window=8, **common)
        model = MistralForCausalLM(cfg)
    elif kind == "phi3":
        cfg = Phi3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, sliding_window=8,
                         original_max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
        model = Phi3ForCausalLM(cfg)
    elif kind == "gemma2":
        gemma = dict(common, tie_word_embeddings=True)
        cfg = Gemma2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, head_dim=16,
                           query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
                           final_logit_softcapping=5.0, pad_token_id=0, bos_token_id=2, eos_token_id=1,
                           attn_implementation="eager", **gemma)
        model = Gemma2ForCausalLM(cfg)
    elif kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        cfg = LlamaConfig(rope_parameters=rope, **common)
        model = LlamaForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = MixtralConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_local_experts=4,
                            num_experts_per_tok=2, **common)
        model = MixtralForCausalLM(cfg)
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                             norm_topk_prob=False, **common)
        model = Qwen2MoeForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, head_dim=32,
                             **common)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        sys.exit(f"unknown KIND {kind}: qwen2, qwen2_windows, qwen3, mistral, phi3, gemma2, llama3, mixtral, qwen2_moe or qwen3_moe")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                # Gemma's gains are 1 + w: w drawn around 0, the same gains.
                p.normal_(0.0 if kind == "gemma2" else 1.0, 0.2)
            else:
                p.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, 40), generator=g)
    with torch.no_grad():
        logits = model(ids).logits[0]
        prompt = ids[:, :6]
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = {
        "input_ids": ids.tolist(),
        "logits": logits.flatten().tolist(),
        "prompt": prompt[0].tolist(),
        "greedy": greedy[0, prompt.shape[1] :].tolist(),
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f)


def check(model_dir: str, ref_path: str) -> int:
    with open(ref_path) as f:
        ref = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        got = model(torch.tensor(ref["input_ids"])).logits[0].flatten()
    want = torch.tensor(ref["logits"])
    err = ((got - want).abs().max() / want.abs().max()).item()
    ok = err <= TOL
    print(f"{type(model).__name__} from {model_dir}: max |difference| {err:.2e} of the largest logit (tolerance {TOL:.0e}) {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        sys.exit(check(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
