"""The interface every pipeline stage implements: an in-process ``LocalStage`` (stage.py) or
a ``RemoteStage`` (remote.py) whose layers run in a shard worker. ``TargetPipeline``,
``engine/describe.py`` and the CLI use only these members (no probing with ``hasattr``);
``tests/unit/test_stage_protocol.py`` checks both classes against it."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Stage(Protocol):
    # placement: global layers [begin, end), where results are delivered, its limits
    begin: int
    end: int
    device: torch.device
    dtype: torch.dtype
    max_ctx: int
    is_first: bool
    is_last: bool
    batch: int          # sequences run in lockstep (training-data sampling); 1 when serving
    label: str          # "cpu", "cuda:0", "remote:cpu", ...
    is_remote: bool     # layers in a shard worker (a process that may fail and restart)
    num_lanes: int      # sequence slots
    lane: int           # the selected slot

    @property
    def length(self) -> int: ...               # cached positions of the selected slot
    @property
    def epoch(self) -> int: ...                # changes when the stage lost its state (a restart)
    @property
    def pager(self): ...                       # the selected slot's KV Flash page table (local), else None
    @property
    def scoring(self) -> bool: ...             # a KV Flash pool under the score policy
    @property
    def can_tree(self) -> bool: ...            # forward(tree=...) / rollback_tree run here
    @property
    def can_ragged(self) -> bool: ...          # forward_rows: several rows of a slot, checkpointed slots
    @property
    def can_tree_rows(self) -> bool: ...       # forward_rows(trees=...): a slot's DDTree among other rows
    @property
    def max_spec_rows(self) -> int: ...        # most rows of one speculative forward
    def spec_room(self, pos: int) -> int: ...  # the pools' limit on what a speculative forward at pos commits

    def select(self, lane: int) -> None: ...
    def forward(self, x: torch.Tensor, start: int, *, logits: str = "last", capture: tuple[int, ...] = (),
                carry: dict | None = None, tree: tuple[int, ...] | None = None, observe: bool = True): ...
    def forward_rows(self, x: torch.Tensor, lanes: list[int], positions: list[int],
                     capture: tuple[int, ...] = (), carry: dict | None = None,
                     trees: dict[int, tuple[int, ...]] | None = None): ...
    def project(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def compile_decode(self) -> None: ...
    def cuda_graphs(self) -> dict[str, str | None]: ...  # CUDA graphs on where they can be: {GPU stage: why not}
    # state of the selected slot
    def reset(self) -> None: ...
    def checkpoint(self) -> None: ...
    def rollback(self, length: int) -> None: ...
    def rollback_tree(self, path: list[int]) -> None: ...
    def commit(self) -> None: ...
    def reselect(self) -> bool: ...
    def snapshot_save(self, slot: int) -> None: ...
    def snapshot_restore(self, slot: int) -> None: ...
    def snapshot_free(self, slot: int) -> None: ...
    def snapshot_nbytes(self, slot: int) -> int: ...
    def snapshot_export(self, slot: int) -> dict[str, torch.Tensor]: ...
    def snapshot_import(self, slot: int, tensors: dict[str, torch.Tensor]) -> None: ...
    # accounting and lifecycle
    def weight_bytes(self) -> int: ...
    def kv_bytes(self) -> int: ...             # attention KV held in this process
    def kvflash_stats(self) -> dict | None: ...
    def health(self) -> dict: ...              # {"status": "ok"} or "degraded" with "error"
    def close(self) -> None: ...
