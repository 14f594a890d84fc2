"""The DFlash draft in a shard-worker process (``--draft-device remote:<device>``).

``DraftOps`` adds the draft operations to a worker; ``RemoteDraft`` is the client and
quacks like ``DFlashDraft`` for the proposer (config, context length, append, draft
hidden states, context export / import, the draft vocabulary). Target captures go to the
worker as they are committed; the draft hidden states come back for the LM head. A worker
failure fails the request (ShardError) and the worker restarts; the proposer re-fills the
context on the next request (prefix-cache hits restore it from the snapshot the server
holds).
"""
from __future__ import annotations

import torch

from ..errors import ShardError
from ..runtime.ipc_codec import DTYPE_NAMES, DTYPES
from ..runtime.worker_link import RemoteOptions, WorkerLink
from .config import DraftConfig
from .draft import DFlashDraft, check_vocab_ids


MAX_LANES = 256  # sequence slots a draft worker keeps contexts for (as the shard worker)


class DraftOps:
    """Worker side: holds one DFlashDraft (a context per sequence slot)."""

    def __init__(self):
        self.draft: DFlashDraft | None = None
        self.key = None

    def _need(self, a=None) -> DFlashDraft:
        """The draft, pointed at the request's sequence slot (``lane``, default 0)."""
        if self.draft is None:
            raise ValueError("no draft loaded (send draft_load first)")
        lane = (a or {}).get("lane", 0)
        if not isinstance(lane, int) or isinstance(lane, bool) or not 0 <= lane < MAX_LANES:
            raise ValueError(f"argument 'lane' must be an integer in [0, {MAX_LANES}), got {lane!r}")
        self.draft.select(lane)
        return self.draft

    def op_draft_load(self, a, t):
        dtype = DTYPES[a["dtype"]]
        quantize = a.get("quantize", "dense")
        key = (a["path"], a["device"], a["dtype"], int(a["max_ctx"]), quantize)
        if key != self.key:
            self.draft, self.key = None, None
            self.draft = DFlashDraft.load(a["path"], device=a["device"], dtype=dtype, max_ctx=int(a["max_ctx"]),
                                          quantize=quantize)
            self.key = key
        for lane in list(self.draft.contexts):
            self.draft.select(lane)
            self.draft.reset()
        self.draft.select(0)
        return {"config": self.draft.cfg.to_dict(), "nbytes": self.draft.nbytes()}, {}

    def op_draft_vocab(self, a, t):
        ids = self._need().vocab_ids
        return {}, ({} if ids is None else {"vocab_ids": ids})

    def op_draft_reset(self, a, t):
        self._need(a).reset()
        return {"context_length": 0}, {}

    def op_draft_append(self, a, t):
        d = self._need(a)
        d.append_context(t["features"], int(a["start"]))
        return {"context_length": d.context.length}, {}

    def op_draft_hidden(self, a, t):
        return {}, {"hidden": self._need(a).draft_hidden(t["embeds"], int(a["start"]))}

    def op_draft_export(self, a, t):
        return {}, self._need(a).context_export()

    def op_draft_import(self, a, t):
        d = self._need(a)
        d.context_import(t)
        return {"context_length": d.context.length}, {}


class _Context:
    length = 0


class RemoteDraft:
    selector = None   # DFlash 2's selector walks the target's vocabulary: in-process drafts only

    def __init__(self, path, *, device: str, home: str, dtype: torch.dtype, max_ctx: int, options: RemoteOptions,
                 quantize: str = "dense"):
        """``device``: the worker's device for the draft; ``home``: where results land."""
        self.device, self.dtype, self.quantize = torch.device(home), dtype, quantize
        self.lane, self.contexts = 0, {0: _Context()}  # per sequence slot: its context length
        self.context = self.contexts[0]
        self.link = WorkerLink(options, [("draft_load", {"path": str(path), "device": device,
                                                          "dtype": DTYPE_NAMES[dtype], "max_ctx": max_ctx,
                                                          "quantize": quantize})],
                               f"draft on remote:{device}")
        self.lane_epoch = {0: self.link.epoch}   # the worker epoch each slot's context began in (_live)
        res = self.link.setup_results[0]
        self.cfg = DraftConfig.from_dict(res["config"])
        self._nbytes = int(res["nbytes"])
        ids = self.link.call("draft_vocab")[1].get("vocab_ids")
        self.vocab_ids = check_vocab_ids(ids)   # the proposer projects onto these rows locally

    check_target = DFlashDraft.check_target

    def select(self, lane: int) -> None:
        if not 0 <= lane < MAX_LANES:
            raise ValueError(f"sequence slot {lane} outside [0, {MAX_LANES})")
        self.lane = lane
        self.context = self.contexts.setdefault(lane, _Context())
        self.lane_epoch.setdefault(lane, self.link.epoch)

    def _call(self, op, args=None, tensors=None):
        epoch = self.link.epoch
        res, out = self.link.call(op, {**(args or {}), "lane": self.lane}, tensors)
        if self.link.epoch != epoch:   # the worker restarted: every slot's context is gone
            for c in self.contexts.values():
                c.length = 0
        if "context_length" in res:
            self.context.length = int(res["context_length"])
        return res, out

    def _live(self) -> None:
        """A restart of the worker loses every slot's context: the selected slot's sequence
        then fails as the worker's fault (ShardError, a 503), not as a bad request to the
        fresh worker, until the slot starts again (reset or import)."""
        if self.lane_epoch.get(self.lane, self.link.epoch) != self.link.epoch:
            raise ShardError(f"the draft worker restarted: the draft context of slot {self.lane} was lost with it")

    def _fresh(self) -> None:
        self.lane_epoch[self.lane] = self.link.epoch

    def nbytes(self) -> int:
        return self._nbytes

    def reset(self) -> None:
        self._call("draft_reset")
        self._fresh()

    def append_context(self, features: torch.Tensor, start: int) -> None:
        self._live()
        self._call("draft_append", {"start": int(start)}, {"features": features.to(self.dtype)})

    def append_contexts(self, items: list[tuple[int, torch.Tensor, int]]) -> None:
        """One worker call per slot (DFlashDraft.append_contexts batches them in process)."""
        for lane, features, start in items:
            self.select(lane)
            self.append_context(features, start)

    def draft_hidden(self, block_embeds: torch.Tensor, start: int) -> torch.Tensor:
        self._live()
        return self._call("draft_hidden", {"start": int(start)}, {"embeds": block_embeds.to(self.dtype)})[1]["hidden"]\
            .to(self.device)

    def pass_block(self, block_embeds, start, features=None, ctx_start=None, head=None):
        """No one-call pass over the link (DFlashDraft.pass_block): the proposer appends the
        context, then drafts, as two calls."""
        return None

    batches_blocks = False   # one worker call per block (DFlashDraft.draft_hidden_rows's loop)

    def draft_hidden_rows(self, blocks: list[tuple[int | None, torch.Tensor, int]]) -> list[torch.Tensor]:
        out = []
        for lane, embeds, start in blocks:
            if lane is not None:
                self.select(lane)
            out.append(self.draft_hidden(embeds, start))
        return out

    def context_export(self) -> dict[str, torch.Tensor]:
        self._live()
        return self._call("draft_export")[1]

    def context_import(self, tensors: dict[str, torch.Tensor]) -> None:
        self._call("draft_import", tensors=tensors)
        self._fresh()

    def health(self) -> dict:
        return self.link.health()

    def close(self) -> None:
        self.link.close()
