"""RemoteStage: the last group of target layers, served by a shard-worker process.

It implements the LocalStage interface (the pipeline cannot tell them apart) on top of a
WorkerLink, which spawns or attaches to the worker and restarts it after any failure.
``epoch`` changes with every restart, so callers know the worker's sequence state and
snapshots are gone; ``health()`` says "degraded" meanwhile.
"""
from __future__ import annotations

import dataclasses

import torch

from .carry import carry_tensors
from .ipc_codec import DTYPE_NAMES
from .kv_pager import score_room
from .kv_pool import merge_stats
from .stage import StageOutput
from ..errors import ShardError
from .worker_link import SECRET_ENV, RemoteOptions, WorkerLink  # noqa: F401 - re-exported


class RemoteStage:
    is_first, is_last, batch, is_remote = False, True, 1, True
    pager = None   # the worker pages its own pools (KvFlashConfig in the load message)

    def __init__(self, model: str, shards: list[tuple[str, int, int]], *, dtype: torch.dtype, max_ctx: int,
                 quantize: tuple[str, str], home: str, options: RemoteOptions, fingerprint: str | None = None,
                 threads: int | None = None, kvflash=None, lanes: int = 1, kv_dtype: str = "auto"):
        """``shards``: the worker's (device, begin, end) ranges, contiguous, ending at the
        last layer; ``home``: the local device results are delivered to; ``lanes``: sequence
        slots the worker holds (every state operation names the selected one)."""
        self.begin, self.end = shards[0][1], shards[-1][2]
        self.device, self.dtype, self.max_ctx, self.kv_dtype = torch.device(home), dtype, max_ctx, kv_dtype
        self.label = f"remote:{','.join(s[0] for s in shards)}"
        self._load = {"model": str(model), "shards": [list(s) for s in shards], "max_ctx": max_ctx,
                      "dtype": DTYPE_NAMES[dtype],
                      "quantize": list(quantize), "fingerprint": fingerprint, "threads": threads,
                      "kvflash": dataclasses.asdict(kvflash) if kvflash is not None else None, "lanes": lanes,
                      "kv_dtype": kv_dtype}
        self._kvflash_stats: list[dict] = []
        self.num_lanes, self.lane = lanes, 0
        self.lengths = [0] * lanes
        self.link = WorkerLink(options, [("load", self._load)],
                               f"{self.label}, layers {self.begin}-{self.end - 1}")
        # the worker epoch each slot's sequence began in: a restart loses every sequence, so a
        # slot's later operations fail as the worker's fault (not as a bad request to the
        # fresh worker, which holds nothing for it) until the slot starts again
        self.lane_epoch = [self.link.epoch] * lanes

    @property
    def epoch(self) -> int:
        return self.link.epoch

    @property
    def proc(self):
        return self.link.proc

    def health(self) -> dict:
        return self.link.health()

    def close(self) -> None:
        self.link.close()

    @property
    def length(self) -> int:
        return self.lengths[self.lane]

    def _live(self, lanes) -> None:
        """ShardError unless every one of ``lanes`` began its sequence since the last restart."""
        for lane in lanes:
            if self.lane_epoch[lane] != self.link.epoch:
                raise ShardError(f"shard worker ({self.label}) restarted: the sequence in slot {lane} was lost "
                                 f"with it")

    def _fresh(self) -> None:
        """The selected slot's sequence starts (again) on the worker as it is now."""
        self.lane_epoch[self.lane] = self.link.epoch

    def _call(self, op: str, args: dict | None = None, tensors: dict | None = None):
        """One operation on the selected sequence slot."""
        epoch = self.link.epoch
        res, out = self.link.call(op, {**(args or {}), "lane": self.lane}, tensors)
        if self.link.epoch != epoch:  # a restarted worker holds no sequence any more
            self.lengths = [0] * self.num_lanes
        if "length" in res:
            self.lengths[self.lane] = int(res["length"])
        return res, out

    # --- the stage interface ------------------------------------------------------------
    def select(self, lane: int) -> None:
        if not 0 <= lane < self.num_lanes:
            raise ValueError(f"sequence slot {lane} outside [0, {self.num_lanes})")
        self.lane = lane

    def forward_rows(self, x: torch.Tensor, lanes: list[int], positions: list[int],
                     capture: tuple[int, ...] = (), carry: dict | None = None,
                     trees: dict[int, tuple[int, ...]] | None = None) -> StageOutput:
        mine = [c for c in capture if self.begin <= c < self.end]
        args = {"lanes": [int(v) for v in lanes], "positions": [int(v) for v in positions], "capture": mine}
        if trees:   # msgpack maps take string keys here: [slot, parents] pairs
            args["trees"] = [[int(lane), [int(p) for p in tree]] for lane, tree in trees.items()]
        self._live(set(int(v) for v in lanes))
        res, out = self._call("forward_rows", args, {"x": x.to(self.dtype), **carry_tensors(carry)})
        for lane, n in zip(lanes, res.get("lengths", [])):
            self.lengths[lane] = int(n)
        lg = out.get("logits")
        caps = {c: out[f"cap.{c}"].to(self.device) for c in mine if f"cap.{c}" in out}
        return StageOutput(hidden=out["hidden"].to(self.device) if "hidden" in out else None,
                           head_logits=lg.to(self.device) if lg is not None else None, captures=caps)

    def compile_decode(self) -> None:
        if ("compile", {}) not in self.link.setup:
            self.link.setup.append(("compile", {}))  # again after a restart
        self._call("compile")

    def cuda_graphs(self) -> dict[str, str | None]:
        """The worker's GPU stages with CUDA graphs (again after a restart): {remote:label:
        why not, or None}."""
        if ("cuda_graphs", {}) not in self.link.setup:
            self.link.setup.append(("cuda_graphs", {}))
        res, _ = self._call("cuda_graphs")
        got = res.get("stages")
        return {f"remote:{k}": v for k, v in got.items()} if isinstance(got, dict) else {}

    def weight_bytes(self) -> int:
        return int(self.link.setup_results[0].get("weight_bytes", 0)) if self.link.setup_results else 0

    @property
    def scoring(self) -> bool:
        kv = self._load["kvflash"]
        return bool(kv) and kv.get("policy") == "score"

    def kv_bytes(self) -> int:
        return 0   # the KV lives in the worker's process

    @property
    def max_spec_rows(self) -> int:
        kv = self._load["kvflash"]
        return int(kv["chunk"]) if kv else 1 << 30

    def spec_room(self, pos: int) -> int:
        """As LocalStage.spec_room for the worker's pools: their configuration, and the chunks
        they hold as its load reported (unknown: every chunk boundary counts as an eviction)."""
        kv = self._load["kvflash"]
        if not kv or kv.get("policy") != "score":
            return 1 << 30
        res = self.link.setup_results[0] if self.link.setup_results else {}
        capacity = res.get("kvflash_capacity")
        capacity = capacity if isinstance(capacity, int) and not isinstance(capacity, bool) else None
        return score_room(pos, int(kv["chunk"]), int(kv["tau"]), capacity)

    @property
    def can_ragged(self) -> bool:
        """Whether the worker's stages take several rows of a slot in ``forward_rows`` (as
        its load reported; see LocalStage.can_ragged)."""
        res = self.link.setup_results[0] if self.link.setup_results else {}
        return bool(res.get("can_ragged", False))

    @property
    def can_tree_rows(self) -> bool:
        """Whether the worker takes DDTree verifies in ``forward_rows`` (as its load reported)."""
        res = self.link.setup_results[0] if self.link.setup_results else {}
        return bool(res.get("can_tree_rows", False))

    @property
    def can_tree(self) -> bool:
        """Tree verify runs on the worker's stages (protocol 2), KV Flash pools included."""
        return True

    def forward(self, x: torch.Tensor, start: int, *, logits: str = "last",
                capture: tuple[int, ...] = (), carry: dict | None = None,
                tree: tuple[int, ...] | None = None, observe: bool = True) -> StageOutput:
        if x.shape[0] != 1:
            raise ValueError("a remote stage runs batch 1")
        mine = [c for c in capture if self.begin <= c < self.end]
        args = {"start": start, "logits": logits, "capture": mine}
        if not observe:
            args["observe"] = False
        if tree is not None:
            args["tree"] = [int(p) for p in tree]
        self._live([self.lane])
        res, out = self._call("forward", args, {"x": x.to(self.dtype), **carry_tensors(carry)})
        caps = {c: out[f"cap.{c}"].to(self.device) for c in mine if f"cap.{c}" in out}
        if "kvflash" in res:
            self._kvflash_stats = res["kvflash"]
        lg = out.get("logits")
        return StageOutput(hidden=out["hidden"].to(self.device) if "hidden" in out else None,
                           head_logits=lg.to(self.device) if lg is not None else None, captures=caps)

    def kvflash_stats(self) -> dict | None:
        """KV Flash counters of the worker's stages, as of the last forward (summed)."""
        return merge_stats(self._kvflash_stats) if self._kvflash_stats else None

    def reselect(self) -> bool:
        if not self._load["kvflash"]:
            return False
        self._live([self.lane])
        return bool(self._call("reselect")[0]["changed"])

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        _, out = self._call("project", tensors={"hidden": hidden.to(self.dtype)})
        return out["logits"].to(self.device)

    def reset(self) -> None:
        self._call("reset")
        self._fresh()

    def checkpoint(self) -> None:
        self._live([self.lane])
        self._call("checkpoint")

    def rollback(self, length: int) -> None:
        self._live([self.lane])
        self._call("rollback", {"length": int(length)})

    def rollback_tree(self, path: list[int]) -> None:
        self._live([self.lane])
        self._call("rollback_tree", {"path": [int(r) for r in path]})

    def commit(self) -> None:
        self._live([self.lane])
        self._call("commit")

    def snapshot_save(self, slot: int) -> None:
        self._live([self.lane])
        self._call("snapshot_save", {"slot": int(slot)})

    def snapshot_restore(self, slot: int) -> None:
        self._call("snapshot_restore", {"slot": int(slot)})
        self._fresh()

    def snapshot_free(self, slot: int) -> None:
        if not self.link.ok:
            return  # the worker lost every snapshot when it failed
        self._call("snapshot_free", {"slot": int(slot)})

    def snapshot_nbytes(self, slot: int) -> int:
        return int(self._call("snapshot_nbytes", {"slot": int(slot)})[0]["nbytes"])

    def snapshot_export(self, slot: int) -> dict[str, torch.Tensor]:
        return self._call("snapshot_export", {"slot": int(slot)})[1]

    def snapshot_import(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        self._call("snapshot_import", {"slot": int(slot)}, tensors)
