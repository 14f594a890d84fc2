"""Why a bf16 decode step is slow on a GPU: attention backends for one query over a cache
that grows by a row each step (a new key length every call), and a whole eager decode step
of a SmolLM2-135M-shaped model (random weights, built here) under each backend choice.

    python benchmarks/gpu_sdpa.py --tokenizer DIR [--device cuda] [--out FILE]

DIR holds tokenizer.json / tokenizer_config.json (any; the model's weights are random)."""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
CHOICES = {"default": None, "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
           "flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
           "math": [SDPBackend.MATH], "cudnn": [SDPBackend.CUDNN_ATTENTION]}


def backends(name):
    return contextlib.nullcontext() if CHOICES[name] is None else sdpa_kernel(CHOICES[name])


def sdpa_micro(dev, dtype, name, n=64):
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    k = torch.randn(1, 3, 1024, 64, device=dev, dtype=dtype)
    q = torch.randn(1, 9, 1, 64, device=dev, dtype=dtype)
    try:
        with backends(name):
            for L in range(60, 70):
                F.scaled_dot_product_attention(q, k[:, :, :L], k[:, :, :L], enable_gqa=True)
            sync()
            t = time.perf_counter()
            for L in range(100, 100 + n):   # a new key length every call, as decode steps are
                F.scaled_dot_product_attention(q, k[:, :, :L], k[:, :, :L], enable_gqa=True)
            sync()
            return round((time.perf_counter() - t) * 1e6 / n, 1)
    except RuntimeError as e:
        return f"error: {str(e).splitlines()[0][:120]}"


def model_dir(tok: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    d = Path(tempfile.mkdtemp())
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, d / f)
    return d


def step_ms(path, dev, dtype, name, steps=48):
    from helpers.build import pipeline
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    pipe = pipeline(path, devices=[str(dev)], dtype=dtype, max_ctx=1024)
    ids = list(range(100, 140))
    with backends(name):
        pipe.reset()
        pipe.prefill(ids)
        pos, tok = len(ids), 7
        for _ in range(6):
            tok = int(pipe.forward([tok], pos).logits[-1].argmax()); pos += 1
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            tok = int(pipe.forward([tok], pos).logits[-1].argmax()); pos += 1
        sync()
    return round((time.perf_counter() - t) * 1000 / steps, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device(a.device)
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None}
    names = list(CHOICES) if dev.type == "cuda" else ["default", "math"]
    res["sdpa_us_bf16"] = {n: sdpa_micro(dev, torch.bfloat16, n) for n in names}
    res["sdpa_us_fp32"] = {n: sdpa_micro(dev, torch.float32, n) for n in ["default", "math"]}
    print(json.dumps(res), flush=True)
    path = model_dir(Path(a.tokenizer))
    res["step_ms_bf16"] = {n: step_ms(path, dev, torch.bfloat16, n) for n in ["default", "no_cudnn", "math"]}
    print(json.dumps(res), flush=True)
    res["step_ms_fp32"] = {"default": step_ms(path, dev, torch.float32, "default")}
    print(json.dumps(res), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
