"""The drafter's forward: per-token scores of a prompt from the attention its last tokens pay.

A ``PromptScorer`` holds an embedding and the first N decoder layers of a model (the
target's own, for ``self:N``, or a drafter model's) and, per call, a KV state sized to the
prompt. It prefills the prompt but the last ``lookahead`` tokens in chunks, then those
tokens in one forward in which every attention layer reports the attention probabilities
of those rows (``ForwardContext.tail_attn``); the score of a token is the running max over
layers and heads, then the mean over the lookahead rows. Nothing after the last scoring
layer runs (no final norm, no LM head): the drafter only has to read the prompt once.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..layers.context import ForwardContext
from ..layers.rope import RotaryTable, rope_tables

LOOKAHEAD = 8


class PromptScorer:
    def __init__(self, embed, layers: list, rope: RotaryTable, rope_local: RotaryTable | None, device, dtype,
                 *, tokenizer, name: str, chunk: int = 512, lookahead: int = LOOKAHEAD, owns_weights: bool = False):
        if not layers:
            raise ValueError("a prompt scorer needs at least one layer")
        if not any(_has_attention(layer) for layer in layers):
            raise ValueError("the scoring layers have no attention layer (a recurrent-only range scores nothing)")
        self.embed, self.layers, self.rope, self.rope_local = embed, layers, rope, rope_local
        self.device, self.dtype = torch.device(device), dtype
        self.tokenizer, self.name = tokenizer, name
        self.chunk, self.lookahead = chunk, lookahead
        self.owns_weights = owns_weights
        self.max_tokens = rope.cos.shape[0]
        self.last_s = 0.0

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_stage(cls, stage, n_layers: int, chunk: int = 512) -> "PromptScorer":
        """``self:N``: the first ``n_layers`` layers of the target's first stage (shared
        weights, no second model in memory)."""
        if not stage.is_first or stage.is_remote:
            raise ValueError("self:N needs the target's first layers in this process")
        if not 1 <= n_layers <= len(stage.layers):
            raise ValueError(f"self:{n_layers}: the first in-process stage has {len(stage.layers)} layers "
                             f"(need 1 <= N <= {len(stage.layers)})")
        cfg = stage.config
        rope, rope_local = stage.rope, stage.rope_local
        longest = max(stage.max_ctx, cfg.max_position_embeddings or 0)
        if longest > stage.max_ctx:  # the drafter reads prompts up to the model's length, past the context
            rope, rope_local = rope_tables(cfg, longest, stage.device, stage.dtype)
        return cls(stage.embed, stage.layers[:n_layers], rope, rope_local, stage.device, stage.dtype,
                   tokenizer=None, name=f"self:{n_layers}", chunk=chunk)

    @classmethod
    def load(cls, path: str, *, device: str, dtype: torch.dtype, max_ctx: int, n_layers: int | None = None,
             quantize: str = "dense", chunk: int = 512) -> "PromptScorer":
        """A drafter model file (HF directory or GGUF): its embedding and first ``n_layers``
        layers (all when None), with its own tokenizer. It reads prompts of up to
        ``max_ctx`` or its own trained length, whichever is longer."""
        from ..layers.linear import Linear
        from ..runtime.stage import _Weights
        from ..weights.loader import open_model

        source = open_model(path)
        cfg = source.config
        n = cfg.num_layers if n_layers is None else n_layers
        if not 1 <= n <= cfg.num_layers:
            raise ValueError(f"the drafter has {cfg.num_layers} layers; cannot score with {n}")
        dev = torch.device(device)
        w = _Weights(source, dev, dtype)
        fam = source.family
        layers = [fam.build_layer(cfg, i, w).eval() for i in range(n)]
        for layer in layers:
            for mod in layer.modules():
                if isinstance(mod, Linear):
                    mod.quantize_(quantize)
        ctx = max(max_ctx, cfg.max_position_embeddings or 0)
        rope, rope_local = rope_tables(cfg, ctx, dev, dtype)
        return cls(fam.build_embedding(cfg, w), layers, rope, rope_local, dev, dtype, tokenizer=source.tokenizer,
                   name=str(path), chunk=chunk, owns_weights=True)

    # --- scoring ------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, ids: list[int]) -> np.ndarray:
        """float64 (n,) scores of the prompt ``ids`` (in this scorer's vocabulary)."""
        t0 = time.perf_counter()
        n = len(ids)
        if n > self.max_tokens:
            raise ValueError(f"the prompt has {n} drafter tokens; the drafter reads at most {self.max_tokens}")
        L = min(self.lookahead, n)
        states = [layer.new_state(n, self.device, self.dtype, 1) for layer in self.layers]
        x = torch.tensor(ids, dtype=torch.long, device=self.device)[None]
        acc = torch.zeros(L, n, dtype=torch.float32, device=self.device)
        body = n - L
        for start in range(0, body, self.chunk):
            self._forward(x[:, start:min(body, start + self.chunk)], start, states, None)
        self._forward(x[:, body:], body, states, acc)
        self.last_s = time.perf_counter() - t0
        return acc.mean(0).double().cpu().numpy()

    def _forward(self, ids: torch.Tensor, start: int, states: list, acc: torch.Tensor | None) -> None:
        T = ids.shape[1]
        cos, sin = self.rope.rows(start, T)
        ctx = ForwardContext(start, T, cos, sin, tail_attn=acc)
        if self.rope_local is not None:
            ctx.cos_local, ctx.sin_local = self.rope_local.rows(start, T)
        h = self.embed(ids)
        ctx.per_layer = self.embed.per_layer_inputs(ids, h)
        for layer, state in zip(self.layers, states):
            h = layer(h, ctx, state)

    def close(self) -> None:
        """(A drafter in a worker stops it; one here has nothing to release.)"""

    def describe(self) -> dict:
        return {"drafter": self.name, "layers": len(self.layers), "lookahead": self.lookahead,
                "max_tokens": self.max_tokens}


def _has_attention(layer) -> bool:
    from ..layers.attention import Attention

    return any(isinstance(m, Attention) for m in layer.modules())
