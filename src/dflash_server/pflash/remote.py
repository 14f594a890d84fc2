"""A prefill drafter in a shard-worker process (``--prefill-drafter-device remote:<device>``).

``ScorerOps`` adds two operations to a worker: ``pflash_load`` (a drafter file on the
worker's device) and ``pflash_score`` (drafter ids in, per-token scores out).
``RemoteScorer`` is the client; it quacks like ``PromptScorer`` for the Compressor and
keeps the drafter's tokenizer here (re-tokenizing is this side's job). A worker failure
fails the request (the Compressor names it) and the worker restarts for the next one.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..runtime.ipc_codec import DTYPE_NAMES, DTYPES
from ..runtime.worker_link import RemoteOptions, WorkerLink
from .scorer import PromptScorer


class ScorerOps:
    """Worker side: holds one PromptScorer."""

    def __init__(self):
        self.scorer: PromptScorer | None = None
        self.key = None

    def op_pflash_load(self, a, t):
        n_layers = a.get("n_layers")
        key = (a["path"], a["device"], a["dtype"], int(a["max_ctx"]), n_layers, a.get("quantize", "dense"))
        if key != self.key:   # (a load that fails leaves the drafter loaded before in place)
            self.scorer = PromptScorer.load(a["path"], device=a["device"], dtype=DTYPES[a["dtype"]],
                                            max_ctx=int(a["max_ctx"]), n_layers=n_layers,
                                            quantize=a.get("quantize", "dense"), chunk=int(a.get("chunk", 512)))
            self.key = key
        return {"max_tokens": self.scorer.max_tokens, "layers": len(self.scorer.layers)}, {}

    def op_pflash_score(self, a, t):
        if self.scorer is None:
            raise ValueError("no prefill drafter loaded (send pflash_load first)")
        ids = t.get("ids")
        if ids is None or ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("pflash_score needs 'ids': a non-empty 1-D int64 tensor")
        vocab = self.scorer.embed.weight.shape[0]
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"pflash_score: token ids must be in [0, {vocab})")
        scores = self.scorer.score(ids.tolist())
        return {"drafter_s": self.scorer.last_s}, {"scores": torch.from_numpy(scores)}


class RemoteScorer:
    def __init__(self, path: str, *, device: str, dtype: torch.dtype, max_ctx: int, options: RemoteOptions,
                 n_layers: int | None = None, quantize: str = "dense", chunk: int = 512):
        from ..weights.loader import open_model

        self.tokenizer = open_model(path).tokenizer   # the weights stay unread here
        self.name = f"{path} (remote:{device})"
        self.link = WorkerLink(options, [("pflash_load", {"path": str(path), "device": device,
                                                           "dtype": DTYPE_NAMES[dtype], "max_ctx": int(max_ctx),
                                                           "n_layers": n_layers, "quantize": quantize,
                                                           "chunk": int(chunk)})],
                               f"prefill drafter on remote:{device}")
        res = self.link.setup_results[0]
        self.max_tokens = int(res["max_tokens"])
        self.layers = [None] * int(res["layers"])  # counted in stats; the layers live in the worker
        self.last_s = 0.0

    def score(self, ids: list[int]) -> np.ndarray:
        if len(ids) > self.max_tokens:
            raise ValueError(f"the prompt has {len(ids)} drafter tokens; the drafter reads at most {self.max_tokens}")
        t0 = time.perf_counter()
        res, out = self.link.call("pflash_score", {}, {"ids": torch.tensor(ids, dtype=torch.int64)})
        self.last_s = time.perf_counter() - t0
        return out["scores"].numpy().astype(np.float64)

    def health(self) -> dict:
        return self.link.health()

    def close(self) -> None:
        self.link.close()
