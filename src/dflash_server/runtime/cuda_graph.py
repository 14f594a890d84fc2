"""CUDA graphs for a stage's decode steps and DFlash verify blocks.

An eager decode step of the default model on an H200 took 15.5 ms for 4.3 ms of GPU work
(882 kernels launched from Python per token, ``benchmarks/gpu_profile.py``): the host is the
bottleneck. A CUDA graph launches a recorded step as one unit. A recorded step may not read
a Python number that changes between calls, and every tensor it touches must stay where it
was at recording. So the graph's step takes the tokens (or hidden states) and their
positions as device tensors: it writes K/V with ``index_copy_`` at those positions, takes the
RoPE rows and the causal mask from them, and attends over a fixed span of the cache (the
smallest power of two of at least ``MIN_SPAN`` rows holding the block, at most the context),
masked past each row's position. One graph per (sequence slot, span, rows), recorded the
first time a step needs it after two eager runs of the same step on a side stream (they
write the rows the replay writes again; recurrent states are put back after them), all in
one memory pool (``record=False`` runs the warm-ups too). Outputs are copied out of
the graph's buffers right after each replay: graphs sharing a pool may use one another's
output memory as scratch, so another graph's replay may overwrite them (inputs and the KV
caches live outside the pool).

Gated DeltaNet layers update their recurrent state in place in a recorded step (on tensors
pinned per slot); their stages record single-token steps outside a checkpoint only.

Used for single-token steps (plain decoding, DFlash's plain steps), for verify blocks of up
to ``MAX_ROWS`` rows under a checkpoint (a block's rows after the checkpoint are dropped by
moving the length back, as in the eager step), and for the rows of several sequence slots
(continuous batching, ``forward_rows``: row b in slot lanes[b] at positions[b], a slot's
verify block as several rows of it; one graph per multiset of slots and span, at most
``MAX_ROW_SETS`` of them, rows ordered by slot); not for DDTree's tree blocks, nor for rows
of several slots on Gated DeltaNet stages. At most ``MAX_GRAPHS`` graphs are kept, the least
recently used dropped first (its memory goes back to the pool for the next recording). On a stage without MoE
layers (their routing is not recorded), with no KV Flash pool, one sequence per slot, nothing carried between stages (Gemma 4's per-layer
inputs and split KV sharing), and without ``--compile``. Elsewhere the step runs eagerly as
before. ``record=False`` runs the graph's step without recording it: how its positions,
masks and spans are tested on a machine without a GPU.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..layers.attention import Attention
from ..layers.context import ForwardContext
from ..layers.gdn import GatedDeltaNet
from ..layers.mlp import SwiGLU

MIN_SPAN = 256  # the smallest span of cache rows a recorded step attends over
MAX_ROWS = 32   # verify blocks up to this many rows are recorded
MAX_ROW_SETS = 64  # sets of sequence slots whose batched decode rows get graphs (others: eager)
# graphs kept at once, least recently used dropped first: each holds its outputs (a verify
# block's logits are rows x vocabulary), and block sizes near a request's end, spans and slots
# multiply the keys
MAX_GRAPHS = 96


def unsupported(stage) -> str | None:
    """Why ``stage``'s decode step cannot be recorded, or None if it can."""
    if stage.batch != 1:
        return "a lockstep batch"
    if any(lane.pool is not None for lane in stage.lanes):
        return "KV Flash pools"
    for layer in stage.layers:
        if not isinstance(layer.mlp, SwiGLU):
            return "mixture-of-experts layers"
        if not isinstance(layer.mixer, (Attention, GatedDeltaNet)):
            return f"{type(layer.mixer).__name__} layers"
        if getattr(layer.mixer, "kv_role", "") == "mirror":
            return "KV-shared layers split from their source"
    if stage._exports or stage.config.per_layer_input_size:
        return "state carried between stages (per-layer inputs, shared KV)"
    return None


@dataclass
class _Graph:
    span: int
    inp: torch.Tensor          # (1, T) token ids, or (1, T, H) hidden states
    pos: torch.Tensor          # (T,) the rows' positions
    rows: torch.Tensor         # (T,) 0..T-1
    lanes: tuple[int, ...] | None  # rows of several slots: each row's slot (ascending)
    ptrs: tuple[int, ...]      # the state tensors' addresses when recorded
    graph: object | None = None
    outs: tuple | None = None  # the recorded step's outputs (h, layer outputs, logits)


class DecodeGraphs:
    def __init__(self, stage, record: bool = True, min_span: int = MIN_SPAN):
        self.stage, self.record, self.min_span = stage, record, min_span
        # Gated DeltaNet layers: single-token steps outside a checkpoint only (their verify
        # blocks record what a rollback replays; batched rows keep a state per slot), on state
        # tensors pinned per slot: a step updates them in place, and a state rebound since
        # (rollback, restore, tree) is copied back into them before the next step
        self.recurrent = any(s.kind == "recurrent" for s in stage.states)
        self.max_rows = 1 if self.recurrent else MAX_ROWS
        self.pins: dict[int, list] = {}
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if record else None
        self.recorded = 0
        self.replays = 0

    def span(self, end: int) -> int:
        """The cache rows a block ending before ``end`` attends over."""
        s = self.min_span
        while s < end:
            s *= 2
        return min(s, self.stage.max_ctx)

    def _states(self, lanes) -> list:
        """What the layers write: the selected slot's states, or (rows of several slots) the
        KV banks of all slots."""
        return self.stage.states if lanes is None else self.stage.banks

    def _ptrs(self, lanes=None) -> tuple[int, ...]:
        return tuple(t.data_ptr() for s in self._states(lanes) if s is not None
                     for t in ((s.k, s.v) if s.kind == "kv" else (s.conv, s.ssm) if s.kind == "recurrent" else ()))

    def _pin(self) -> None:
        """The selected slot's recurrent states on their pinned tensors (the first ones seen)."""
        rec = [s for s in self.stage.states if s.kind == "recurrent"]
        pins = self.pins.setdefault(self.stage.lane, [(s.conv, s.ssm) for s in rec])
        for s, (conv, ssm) in zip(rec, pins):
            if s.conv is not conv:
                conv.copy_(s.conv)
                s.conv = conv
            if s.ssm is not ssm:
                ssm.copy_(s.ssm)
                s.ssm = ssm

    def _step(self, inp: torch.Tensor, pos: torch.Tensor, span: int, lanes: tuple[int, ...] | None = None):
        """The step with its positions as a tensor (what is recorded)."""
        st = self.stage
        ctx = ForwardContext(0, pos.shape[0], st.rope.cos.index_select(0, pos), st.rope.sin.index_select(0, pos))
        ctx.graph_pos, ctx.graph_span = pos, span
        if lanes is not None:
            ctx.graph_lanes = lanes
            ctx.graph_lane_ids = torch.tensor(lanes, device=pos.device)
        if st.rope_local is not None:
            ctx.cos_local = st.rope_local.cos.index_select(0, pos)
            ctx.sin_local = st.rope_local.sin.index_select(0, pos)
        h = st._inputs(inp, ctx, None)
        outs = []
        for layer, state in zip(st.layers, self._states(lanes)):
            h = layer(h, ctx, state)
            outs.append(h)
        logits = st._head(st.final_norm(h)) if st.is_last else None
        return h, outs, logits

    def _new(self, span: int, x: torch.Tensor, pos: torch.Tensor, ptrs: tuple[int, ...], lanes=None) -> _Graph:
        st = self.stage
        rows = torch.arange(x.shape[1], device=st.device)
        g = _Graph(span, torch.empty(x.shape, dtype=torch.long if st.is_first else st.dtype, device=st.device),
                   pos.clone(), rows, lanes, ptrs)
        g.inp.copy_(x)
        # two warm-up runs (on a side stream where recorded): they write the K/V rows the step
        # writes anyway, and advance recurrent states, which are put back after them
        rec = [s for s in self._states(lanes) if s is not None and s.kind == "recurrent"]
        saved = [(s.conv.clone(), s.ssm.clone()) for s in rec]
        side = torch.cuda.Stream(st.device) if self.record else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(st.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _ in range(2):
                self._step(g.inp, g.pos, span, lanes)
        if side is not None:
            torch.cuda.current_stream(st.device).wait_stream(side)
        for s, (conv, ssm) in zip(rec, saved):
            s.conv.copy_(conv)
            s.ssm.copy_(ssm)
        if not self.record:
            return g
        g.graph = torch.cuda.CUDAGraph()
        # (thread_local: another thread's CUDA work, e.g. a disk-cache write, does not break it)
        with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"):
            g.outs = self._step(g.inp, g.pos, span, lanes)
        self.recorded += 1
        return g

    def _get(self, key) -> _Graph | None:
        """The graph of ``key``, now the most recently used."""
        g = self.graphs.pop(key, None)
        if g is not None:
            self.graphs[key] = g
        return g

    def _put(self, key, g: _Graph) -> _Graph:
        self.graphs[key] = g
        while len(self.graphs) > MAX_GRAPHS:
            del self.graphs[next(iter(self.graphs))]
        return g

    def _run(self, g: _Graph):
        if g.graph is None:
            return self._step(g.inp, g.pos, g.span, g.lanes)
        g.graph.replay()
        self.replays += 1
        return g.outs

    def step(self, x: torch.Tensor, start: int, capture=()):
        """T rows at ``start`` (x: (1, T) ids or (1, T, H) hidden, on the stage's device):
        (hidden (1, T, H), {layer id: output} for ``capture``, logits (1, T, V) or None)."""
        T = x.shape[1]
        key = (self.stage.lane, self.span(start + T), T)
        if self.recurrent:
            self._pin()
        ptrs = self._ptrs()
        g = self._get(key)
        if g is None or g.ptrs != ptrs:  # (a state tensor that moved: record again)
            pos = torch.arange(start, start + T, device=self.stage.device)
            g = self._put(key, self._new(key[1], x, pos, ptrs))
        g.inp.copy_(x)
        torch.add(g.rows, start, out=g.pos)
        h, outs, logits = self._run(g)
        caps = {layer.index: o.clone() for layer, o in zip(self.stage.layers, outs) if layer.index in capture}
        return h.clone(), caps, None if logits is None else logits.clone()

    def step_rows(self, x: torch.Tensor, lanes: list[int], positions: list[int], capture=()):
        """Rows of several slots (``LocalStage.forward_rows``: a decode row each, or a slot's
        verify block as several rows at consecutive positions), or None where this multiset
        of slots has no graph and no room for one (the caller runs it eagerly). Rows run
        ordered by slot (a slot's rows in their order: every row's K/V is written before the
        attention, each row masked past its own position); the results come back in the
        caller's order."""
        if self.recurrent:
            return None
        order = sorted(range(len(lanes)), key=lanes.__getitem__)
        key_lanes = tuple(lanes[i] for i in order)
        key = ("rows", key_lanes, self.span(max(positions) + 1))
        ptrs = self._ptrs(key_lanes)
        g = self._get(key)
        if g is None or g.ptrs != ptrs:
            if g is None and sum(k[0] == "rows" for k in self.graphs) >= MAX_ROW_SETS:
                return None
            pos = torch.tensor([positions[i] for i in order], device=self.stage.device)
            g = self._put(key, self._new(key[2], x[:, order], pos, ptrs, key_lanes))
        perm = torch.tensor(order, device=x.device)
        g.inp.copy_(x.index_select(1, perm))
        g.pos.copy_(torch.tensor([positions[i] for i in order]))
        h, outs, logits = self._run(g)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(len(order), device=perm.device)
        caps = {layer.index: o.index_select(1, back) for layer, o in zip(self.stage.layers, outs)
                if layer.index in capture}
        return h.index_select(1, back), caps, None if logits is None else logits.index_select(1, back)
