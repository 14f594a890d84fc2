"""What the HTTP server uses of an engine: ``Engine`` (generate.py) implements it, and so do
the tests' scripted engines; the server reads these members directly (no probing with
``hasattr``/``getattr``). ``tests/unit/test_engine_protocol.py`` checks both."""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class ServingEngine(Protocol):
    tokenizer: Any          # the model's tokenizer (encode / decode / chat template)
    pipeline: Any           # .max_ctx: the context size
    scheduler: Any          # the step loop's bookkeeping (lanes, waiting, running)
    proposer: Any           # the DFlash proposer, or None (plain decoding)
    compressor: Any         # PFlash's prefill compressor, or None
    compress_policy: Any    # PFlash's PFlashPolicy, or None (the server's default)
    grammars: Any           # a GrammarCompiler (check / lark_text), or None: no constrained output

    @property
    def has_work(self) -> bool: ...
    def submit(self, req, on_event: Callable | None = None, cancelled: Callable[[], bool] | None = None,
               tag: Any = None): ...                      # a sequence handle (result / error once ended)
    def step(self) -> list: ...                           # the sequences that ended in this step
    def occupancy(self) -> tuple[int, int, int]: ...      # (waiting, holding a slot, slots)
    def abort(self, e: BaseException) -> list: ...        # fail everything held; returns it
    def generate(self, req, on_event: Callable | None = None, cancelled: Callable[[], bool] | None = None): ...
    def stats(self) -> dict | None: ...                   # /props, /slots, /metrics (None: nothing to report)
    def health(self) -> dict: ...                         # {"status": "ok"} or "degraded" with the error
    def close(self) -> None: ...                          # persist caches, stop workers (idempotent)
