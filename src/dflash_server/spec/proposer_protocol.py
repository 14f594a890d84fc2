"""What the engine uses of a speculative proposer (``DFlashProposer``, spec/proposer.py):
the step functions (engine/speculative.py), the batch loop (engine/generate.py), the prefix
cache (engine/prefix.py) and the stats (engine/describe.py) use only these members.
``tests/unit/test_stage_protocol.py`` checks DFlashProposer against it."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Proposer(Protocol):
    method: str             # "dflash" (a draft model, with prompt lookup beside it) or "lookup" (lookup alone)
    pipeline: Any           # the target it drafts for
    draft: Any              # the draft model (in process or a RemoteDraft): health(), close(), cfg
    taps: tuple[int, ...]   # target layers whose outputs feed the draft
    block_size: int         # the draft's block (proposed tokens + 1)
    sizer: Any              # the adaptive block size / tree budget (BlockSizer, TreeSizer), or None
    batch_sizer: Any        # blocks of several sequences verified in one forward (BatchSizer), or None
    tree_budget: int        # DDTree nodes per step (0: chains)
    lookup_depth: int       # prompt-lookup drafts per step where the context repeats (0: off; spec.lookup)
    lookup_store: Any       # finished requests' tokens for lookups across requests (LookupStore), or None
    sampled_verify: str     # "auto" | "exact" | "rejection"
    vocab: torch.Tensor | None  # the draft's own vocabulary (token ids), None: the target's

    def select(self, lane: int) -> None: ...                    # act on this sequence slot's context
    def reset(self) -> None: ...                                # forget the selected slot's context
    def add_context(self, captures: dict[int, torch.Tensor], start: int, n: int | None = None,
                    defer: bool = False) -> None: ...           # tapped outputs of committed positions
    def add_rows(self, captures: dict[int, torch.Tensor], lanes: list[int],
                 positions: list[int]) -> None: ...             # a batched decode step's rows, deferred
    def snapshot(self) -> dict[str, torch.Tensor]: ...          # the slot's context (prefix cache)
    def restore(self, tensors: dict[str, torch.Tensor]) -> None: ...
    def uses_tree(self, pipeline) -> bool: ...                  # steps verify a DDTree
    def batch_verify(self, pipeline) -> bool: ...               # several sequences verify in one forward
    def rejection_sampling(self, sampling) -> bool: ...         # a sampled request verifies by p/q
    def draft_ahead(self, items: list[tuple[int, int, int, int]]) -> None: ...  # several slots' drafts in one pass
    def propose(self, anchor: int, start: int, block: int) -> list[int]: ...
    def propose_tree(self, anchor: int, start: int, block: int, budget: int): ...
    def propose_sampled(self, anchor: int, start: int, block: int, sampling,
                        generator: torch.Generator) -> tuple[list[int], torch.Tensor]: ...
