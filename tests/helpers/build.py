"""Build our pipeline/engine for tests."""
from __future__ import annotations

import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.weights.loader import open_model


def pipeline(path, stages: int = 1, split=None, dtype=torch.float32, max_ctx: int = 512, quantize="dense",
             devices=None, remote=None, lanes: int = 1, kv_dtype: str = "auto", kvflash=None):
    """``devices`` (e.g. ["cpu", "remote:cpu"]) overrides ``stages``; ``remote``: RemoteOptions;
    ``kvflash``: a KvFlashConfig."""
    src = open_model(path)
    shards = plan_placement(src.config.num_layers, devices or ["cpu"] * stages, split,
                            together=src.config.kv_groups() if split is None else ())
    return build_pipeline(src, shards, dtype=dtype, max_ctx=max_ctx, quantize=quantize, progress=False,
                          remote=remote, lanes=lanes, kv_dtype=kv_dtype, kvflash=kvflash)


def greedy(pipe, prompt_ids, max_tokens=16, chunk=512, **kw) -> list[int]:
    req = GenerationRequest(tuple(prompt_ids), max_tokens=max_tokens, ignore_eos=True, **kw)
    return Engine(pipe, chunk=chunk).generate(req).token_ids


def prompt_ids(pipe, n: int, seed: int = 0) -> list[int]:
    """n token ids of real text (tokenized), padded with random ids if the text is short."""
    text = ("The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
            "def f(x):\n    return x * 2  # double\n") * 8
    ids = pipe.tokenizer.encode(text)[:n]
    g = torch.Generator().manual_seed(seed)
    while len(ids) < n:
        ids.append(int(torch.randint(0, 1000, (1,), generator=g)))
    return ids


def start_slots(pipes, prompts) -> tuple[list[int], list[int]]:
    """Prefill ``prompts[i]`` into slot i of each pipeline; (positions, the first pipeline's
    greedy next token per slot)."""
    toks = []
    for p in pipes:
        for lane, ids in enumerate(prompts):
            p.select(lane)
            p.reset()
            last = p.forward(ids, 0, logits="last")
            if p is pipes[0]:
                toks.append(int(last.logits[-1].argmax()))
    return [len(ids) for ids in prompts], toks


def random_draft(pipe, layers: int = 2, block: int = 4):
    """A small DFlash draft with seeded random weights tapping target layers 0 and 1 (fp32, on
    the CPU): for tests where what the draft proposes does not matter, or is overridden."""
    from dflash_server.spec.config import DraftConfig
    from dflash_server.spec.draft import DFlashDraft

    c = pipe.config
    cfg = DraftConfig(hidden_size=c.hidden_size, intermediate_size=96, num_layers=layers, num_heads=4, num_kv_heads=2,
                      head_dim=16, block_size=block, mask_token_id=5, target_layer_ids=(0, 1),
                      num_target_layers=c.num_layers)
    return DFlashDraft(cfg, DFlashDraft.random_tensors(cfg, 3, 0.05), "cpu", torch.float32, pipe.max_ctx)
