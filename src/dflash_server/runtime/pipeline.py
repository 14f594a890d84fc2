"""TargetPipeline: the target model as a chain of stages (any split is invisible above)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..errors import Cancelled
from .placement import ShardSpec, split_local_remote
from .stage import LocalStage, StageOutput
from .stage_protocol import Stage


SCORE_TAIL = 32  # prompt tokens whose queries pick the resident KV chunks (score policy)


@dataclass
class PipelineOutput:
    logits: torch.Tensor | None                      # (T or 1, V) fp32
    captures: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, T, H)


class TargetPipeline:
    def __init__(self, stages: list[Stage], source):
        self.stages = stages
        self.source = source
        self.config = source.config
        self.tokenizer = source.tokenizer
        self.max_ctx = stages[0].max_ctx

    @property
    def length(self) -> int:
        return self.stages[-1].length

    @property
    def lanes(self) -> int:
        """Sequence slots: independent sequence states (continuous batching)."""
        return min(st.num_lanes for st in self.stages)

    def select(self, lane: int) -> None:
        """Make ``lane`` the sequence slot that single-sequence operations (forward, prefill,
        reset, checkpoint, snapshots) act on."""
        for st in self.stages:
            st.select(lane)

    def forward_rows(self, tokens: list[int], lanes: list[int], positions: list[int],
                     capture: tuple[int, ...] = (), trees: dict[int, tuple[int, ...]] | None = None) -> PipelineOutput:
        """Decode rows of sequences, each in its own slot: ``tokens[b]`` at ``positions[b]``
        of slot ``lanes[b]`` (where ``supports_ragged``, a slot may take several rows at
        consecutive positions: a verify block; where ``supports_tree_rows``, ``trees`` {slot:
        parents} makes a slot's rows a DDTree verify, see LocalStage.forward_rows). Returns the
        rows' logits (B, V) fp32 and the outputs (1, B, H) of the ``capture`` layers."""
        out = self.run_rows(torch.tensor([list(tokens)], dtype=torch.long), lanes, positions, capture, trees=trees)
        return PipelineOutput(out.logits, out.captures)

    def run_rows(self, x: torch.Tensor, lanes: list[int], positions: list[int], capture: tuple[int, ...] = (),
                 carry: dict | None = None, trees: dict[int, tuple[int, ...]] | None = None) -> StageOutput:
        """``forward_rows`` on any input: token ids (1, B) where the first stage embeds, else
        the previous stage's hidden rows and ``carry`` (a shard worker's stages). Returns the
        last stage's output with every stage's captures."""
        caps: dict[int, torch.Tensor] = {}
        for st in self.stages:
            out = st.forward_rows(x, lanes, positions, capture, **({"carry": carry} if carry else {}),
                                  **({"trees": trees} if trees else {}))
            caps.update(out.captures)
            x, carry = out.hidden, out.carry
        return StageOutput(out.hidden, out.head_logits, caps, out.carry)

    @property
    def device(self) -> torch.device:
        return self.stages[-1].device

    @property
    def max_forward(self) -> int:
        """Most positions one forward may write (a KV Flash pool bounds it)."""
        out = self.max_ctx
        for st in self.stages:
            p = st.pager
            if p is not None:
                out = min(out, p.chunk * p.max_new_chunks)
        return out

    def kvflash_stats(self) -> list[dict]:
        return [s for st in self.stages if (s := st.kvflash_stats()) is not None]

    def kv_bytes(self) -> int:
        return sum(st.kv_bytes() for st in self.stages)

    @property
    def epoch(self) -> int:
        """Changes whenever a stage lost its state (a shard worker restarted): snapshots
        taken before are gone."""
        return sum(st.epoch for st in self.stages)

    def health(self) -> dict:
        """{"status": "ok"} or "degraded" with the failing stage's error."""
        for st in self.stages:
            h = st.health()
            if h["status"] != "ok":
                return {"status": "degraded", "error": h.get("error"), "stage": st.label}
        return {"status": "ok"}

    def close(self) -> None:
        """Stop shard workers (idempotent)."""
        for st in self.stages:
            st.close()

    @property
    def max_spec_rows(self) -> int:
        """The most rows a verify block (chain or tree) may write: a KV Flash pool's chunk
        (its one spare chunk covers one new chunk per speculative forward)."""
        return min(st.max_spec_rows for st in self.stages)

    def spec_room(self, pos: int) -> int:
        """The most positions a speculative forward (chain or tree) of a sequence at ``pos``
        may commit: ``max_spec_rows``, and with KV Flash's score policy no further than where
        plain decoding would re-select or evict next (kv_pager.score_room), so a drafted
        sequence's paging equals its plain decoding's. (A function of ``pos`` and the pools'
        configuration, the same for every slot: callers need not select the sequence.)"""
        return min([self.max_spec_rows] + [st.spec_room(pos) for st in self.stages])

    @property
    def supports_ragged(self) -> bool:
        """Whether ``forward_rows`` takes several rows of a slot at consecutive positions and
        slots holding a checkpoint (several sequences' verify blocks in one forward)."""
        return all(st.can_ragged for st in self.stages)

    @property
    def supports_tree_rows(self) -> bool:
        """Whether ``forward_rows`` takes DDTree verifies among other slots' rows (``trees``)."""
        return self.supports_ragged and all(st.can_tree_rows for st in self.stages)

    @property
    def supports_tree(self) -> bool:
        """Whether DDTree verify (``forward(tree=...)``, ``rollback_tree``) runs here: one
        sequence per stage forward everywhere (a shard worker included)."""
        return all(st.can_tree for st in self.stages)

    def forward(self, ids, start: int, *, logits: str = "last", capture: tuple[int, ...] = (),
                tree: tuple[int, ...] | None = None, observe: bool = True) -> PipelineOutput:
        """Run ids (list or (1, T) tensor) at positions [start, start+T) through every stage
        (``tree``: the rows form a DDTree; ``observe``: False keeps KV Flash's score policy out
        of it; see Stage.forward)."""
        if not torch.is_tensor(ids):
            ids = torch.tensor([list(ids)], dtype=torch.long)
        if ids.shape[0] != self.stages[0].batch:  # one prompt for a whole batch
            ids = ids.expand(self.stages[0].batch, -1)
        out = self.run(ids, start, logits=logits, capture=capture, tree=tree, observe=observe)
        return PipelineOutput(out.logits, out.captures)

    def run(self, x: torch.Tensor, start: int, *, logits: str = "last", capture: tuple[int, ...] = (),
            carry: dict | None = None, tree: tuple[int, ...] | None = None, observe: bool = True) -> StageOutput:
        """``forward`` on any input: token ids (1, T) where the first stage embeds, else the
        previous stage's hidden state and ``carry`` (a shard worker's stages). Returns the
        last stage's output (hidden state, logits in the head's dtype, carry) with every
        stage's captures."""
        caps: dict[int, torch.Tensor] = {}
        for st in self.stages:
            # the per-layer inputs of Gemma 4 E2B / E4B travel between in-process stages
            out = st.forward(x, start, logits=logits, capture=capture, **({"carry": carry} if carry else {}),
                             **({"tree": tree} if tree is not None else {}), observe=observe)
            caps.update(out.captures)
            x, carry = out.hidden, out.carry
        return StageOutput(out.hidden, out.head_logits, caps, out.carry)

    def prefill(self, ids: list[int], start: int = 0, chunk: int = 512,
                capture: tuple[int, ...] = (), cancelled=None) -> PipelineOutput:
        """Chunked prefill; returns the last position's logits and all captured rows.
        ``cancelled`` (a callable) is polled before every chunk: when it says so, raises
        ``Cancelled`` and leaves the state half-written (the next request resets it)."""
        return drain(self.prefill_steps(ids, start, chunk, capture), cancelled)

    def prefill_steps(self, ids: list[int], start: int = 0, chunk: int = 512, capture: tuple[int, ...] = ()):
        """``prefill`` one forward at a time: a generator that yields before each forward
        (the caller may run other work, e.g. other sequences' decode steps, and must
        ``select`` this sequence's slot again before resuming), takes an optional token
        budget for the next forward by ``send`` (None: ``chunk``), and returns the
        ``PipelineOutput`` (``StopIteration.value``)."""
        if not ids:
            raise ValueError("prefill needs at least one token")
        chunk = max(1, min(chunk, self.max_forward))
        caps: dict[int, list[torch.Tensor]] = {}
        # KV Flash score policy: the prompt's last tokens run as their own forward so that their
        # queries can re-select which chunks are resident (e.g. page back the one a question
        # refers to); if anything moved, that forward is redone on the new residency, unobserved
        # (its rows were observed by the re-selection). The body before them runs unobserved
        # (KvPool.prepare): however it is cut into forwards, the policy starts the tail from the
        # same state
        tail = min(SCORE_TAIL, len(ids) - 1, self.max_forward) if self._scoring() else 0  # (not the chunk's)
        body = ids[:len(ids) - tail]
        out, off = None, 0
        while off < len(body):
            budget = yield
            n = self._piece(start + off, min(chunk, max(1, budget or chunk), len(body) - off))
            out = self.forward(body[off:off + n], start + off, logits="last", capture=capture, observe=False)
            for k, v in out.captures.items():
                caps.setdefault(k, []).append(v)
            off += n
        if tail > 0:
            yield
            pos = start + len(body)
            self.checkpoint()
            out = self.forward(ids[len(body):], pos, logits="last", capture=capture)
            if any([st.reselect() for st in self.stages]):
                self.rollback(pos)
                out = self.forward(ids[len(body):], pos, logits="last", capture=capture, observe=False)
            else:
                self.commit()
            for k, v in out.captures.items():
                caps.setdefault(k, []).append(v)
        return PipelineOutput(out.logits, {k: torch.cat(v, dim=1) for k, v in caps.items()})

    def _piece(self, pos: int, n: int) -> int:
        """Length of the prefill forward at ``pos`` (at most ``n``; see KvPager.piece)."""
        for st in self.stages:
            p = st.pager
            if p is not None:
                n = p.piece(pos, n)
        return n

    def _scoring(self) -> bool:
        return any(st.scoring for st in self.stages)

    def compile_decode(self) -> None:
        for st in self.stages:
            st.compile_decode()

    def use_cuda_graphs(self) -> dict[str, str | None]:
        """CUDA graphs for the decode steps of the GPU stages, here and in shard workers:
        {stage: why not, or None where they are on}."""
        out: dict[str, str | None] = {}
        for st in self.stages:
            out.update(st.cuda_graphs())
        return out

    def cuda_graph_stats(self) -> dict[str, dict | None]:
        """Per GPU stage of this process: graphs recorded and replayed, or None where they
        are off (never on, or turned off by a failed recording)."""
        return {st.label: None if st._graphs is None else {"recorded": st._graphs.recorded,
                                                           "replays": st._graphs.replays}
                for st in self.stages if not st.is_remote and st.device.type == "cuda"}

    def embed(self, ids: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """Target token embeddings (the draft borrows them): (1, T) -> (1, T, H). ``raw``:
        the embedding rows themselves, without a family's scale (Gemma's sqrt(hidden))."""
        emb = self.stages[0].embed
        with torch.inference_mode():
            ids = ids.to(self.stages[0].device)
            return torch.nn.functional.embedding(ids, emb.weight) if raw else emb(ids)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stages[-1].project(hidden)

    # state operations fan out to every stage
    def reset(self):
        for st in self.stages:
            st.reset()

    def checkpoint(self):
        for st in self.stages:
            st.checkpoint()

    def rollback(self, length: int):
        for st in self.stages:
            st.rollback(length)

    def rollback_tree(self, path: list[int]):
        for st in self.stages:
            st.rollback_tree(path)

    def commit(self):
        for st in self.stages:
            st.commit()

    def snapshot_save(self, slot: int):
        for st in self.stages:
            st.snapshot_save(slot)

    def snapshot_restore(self, slot: int):
        for st in self.stages:
            st.snapshot_restore(slot)

    def snapshot_free(self, slot: int):
        for st in self.stages:
            st.snapshot_free(slot)

    def snapshot_nbytes(self, slot: int) -> int:
        return sum(st.snapshot_nbytes(slot) for st in self.stages)

    def snapshot_export(self, slot: int) -> dict[str, torch.Tensor]:
        out = {}
        for k, st in enumerate(self.stages):
            out.update({f"ls{k}.{name}": t for name, t in st.snapshot_export(slot).items()})
        return out

    def snapshot_import(self, slot: int, tensors: dict[str, torch.Tensor]):
        for k, st in enumerate(self.stages):
            prefix = f"ls{k}."
            st.snapshot_import(slot, {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)})


def drain(steps, cancelled=None):
    """Run a step generator (``prefill_steps``) to its end and return its value; ``cancelled``
    is polled before each step (raises ``Cancelled``; the generator is closed)."""
    try:
        while True:
            next(steps)
            if cancelled is not None and cancelled():
                raise Cancelled()
    except StopIteration as done:
        return done.value
    finally:
        steps.close()


def build_pipeline(source, shards: list[ShardSpec], *, dtype: torch.dtype, max_ctx: int,
                   quantize: str | tuple[str, str] = "dense", progress: bool = True,
                   batch: int = 1, remote=None, threads: int | None = None, kvflash=None,
                   lanes: int = 1, embeds: bool = True, kv_dtype: str = "auto") -> TargetPipeline:
    """One LocalStage per local shard (each reads only its own layers' weights), then one
    RemoteStage for the ``remote:`` shards, served by a shard worker (``remote``: RemoteOptions).
    ``lanes``: sequence slots (continuous batching; local stages only). ``embeds=False``: the
    first stage takes the previous stage's hidden state (a shard worker's pipeline); the stage
    holding the model's last layer has the final norm and LM head. ``kv_dtype``: the KV cache's
    element type on every stage ("auto", "f32", "f16", "bf16")."""
    local, far = split_local_remote(shards)
    bar = tqdm(total=sum(s.num_layers for s in local), desc="loading weights", unit="layer",
               disable=None if progress else True, leave=False)  # None: only on a terminal
    stages = []
    try:
        for k, sh in enumerate(local):
            stages.append(LocalStage(source, sh.begin, sh.end, sh.device, dtype, max_ctx, is_first=embeds and k == 0,
                                     is_last=not far and sh.end == source.config.num_layers, quantize=quantize,
                                     on_layer=bar.update, batch=batch, kvflash=kvflash, lanes=lanes,
                                     kv_dtype=kv_dtype))
    finally:
        bar.close()
    if far:
        from .remote import RemoteOptions, RemoteStage


        if batch != 1:
            raise ValueError("a remote shard runs batch 1")
        q = (quantize, quantize) if isinstance(quantize, str) else quantize
        stages.append(RemoteStage(source.path, [(s.device, s.begin, s.end) for s in far], dtype=dtype,
                                  max_ctx=max_ctx, quantize=q, home=local[-1].device,
                                  options=remote or RemoteOptions(), fingerprint=source.fingerprint(mtime=False),
                                  threads=threads, kvflash=kvflash, lanes=lanes, kv_dtype=kv_dtype))
    return TargetPipeline(stages, source)
