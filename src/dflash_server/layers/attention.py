"""Full (optionally sliding-window) attention over a position-addressed KV cache.

The cache is preallocated to the stage's max context: a forward at ``start`` writes rows
``[start, start+T)`` and attends to rows ``[0, start+T)``. Rolling back is therefore just
moving the sequence length back (crop); stale rows past it are overwritten by the next
forward and never read before that.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .context import ForwardContext, runs
from .linear import Linear
from .norms import RMSNorm
from .rope import apply_rope
from .sdpa import sdpa

MASS_ONE = 2.0 ** 32  # the score policy's masses in fixed point: an attention probability of 1


# KV Flash's score policy keeps the latest this many committed rows' queries: the re-selection on a
# prompt's tail scores chunks with them all, those at multiples of tau with fewer (kv_pool.SCORE_DECODE_ROWS)
SCORE_QUERY_ROWS = 32


def pool_step_args(ctx, rows: int, nh: int, hd: int, dtype: torch.dtype, window: int | None = None,
                   layers: int = 0) -> tuple[dict, torch.Tensor | None]:
    """A KV Flash pool on the native attention ops: (their arguments, the queries tensor they
    fill or None). The pool's slots (``ctx.pool_args``), and for the score policy ``mass``
    (``ctx.attn_mass``, which the op adds each row's attention per pool chunk to, over heads,
    at the chunks ``ctx.mass_keys`` gives its keys) and ``q_out`` (every row's rotated queries:
    (1, T, nh, hd), or one per layer, (layers, 1, T, nh, hd), for the stack; the caller appends
    them to ``ctx.last_q``)."""
    args, queries = dict(ctx.pool_args(window)), None
    if ctx.attn_mass is not None:
        args["mass"], args["mass_keys"] = ctx.attn_mass, ctx.mass_keys(window)
    if ctx.last_q is not None:
        shape = (1, rows, nh, hd)
        queries = args["q_out"] = torch.empty(((layers,) if layers else ()) + shape, dtype=dtype)
    return args, queries


def pool_rows_args(ctx, nh: int, hd: int, dtype: torch.dtype, layers: int = 0) -> tuple[dict, torch.Tensor | None]:
    """The score policy's outputs on the native rows ops (KV Flash pools in a rows forward):
    ``mass`` (``ctx.rows_mass``, (rows, pool chunks): a slot's rows are its block's ``attn_mass``,
    summed as its own forward's; ``ctx.rows_args`` carries the keys' chunks) and ``q_out``
    (every row's rotated queries, (rows, nh, hd), or one per layer, (layers, rows, nh, hd), for
    the stack; ``keep_row_queries`` hands each slot's to its block). ({}, None) without the
    score policy."""
    if ctx.rows_mass is None:
        return {}, None
    queries = torch.empty(((layers,) if layers else ()) + (len(ctx.lanes), nh, hd), dtype=dtype)
    return {"mass": ctx.rows_mass, "q_out": queries}, queries


def keep_row_queries(ctx, queries: torch.Tensor) -> None:
    """One layer's rotated queries of a rows forward (rows, nh, hd) into each slot's block
    ``last_q``, as (1, T, nh, hd) as its own forward's."""
    for b, e in ctx.row_pools:
        block = ctx.block(b, e)
        if block.last_q is not None:
            block.last_q.append(queries[b:e][None])
# Prefill chunks (over 64 rows) ending at most here take the native attention step, whose
# rows are computed alike however the prompt is cut into chunks (exact prefix-cache hits, and
# a prompt prefilled beside other sequences, in pieces the step budget sets, equals the same
# prompt alone); past it aten's SDPA, whose rounding depends on the chunk. Until 2026-11-27
# this was 2048 (aten was faster past it: 0-4096 in 512-row chunks 650-681 vs 542-544 tok/s);
# since the attention step's later work the native step is the faster one there too
# (positions 2048-4096, alternating in one process, Zen 4 VM: 417 vs 360, 432 vs 394 tok/s).
# 16384 is where the op's grouped fast path ends.
NATIVE_PREFILL_CTX = 16384
# The KV cache's element type (``--kv-dtype``): "auto" is fp16 on the CPU where the native
# attention reads the cache and the activations are 16-bit (half the bytes a decode step
# reads at long context; keys and values rounded once, when written, as llama.cpp's default
# f16 cache), fp32 on the CPU otherwise (aten's CPU attention is 6-8x slower in 16 bits),
# and the compute dtype on other devices.
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
CPU_NATIVE_CACHE = (torch.float32, torch.float16, torch.bfloat16)


def cache_dtype(choice: str, device, dtype: torch.dtype, native: bool) -> torch.dtype:
    """The KV cache dtype for ``choice`` ("auto" or a KV_DTYPES name)."""
    if choice != "auto":
        if choice not in KV_DTYPES:
            raise ValueError(f"unknown KV cache dtype {choice!r}: one of auto, {', '.join(KV_DTYPES)}")
        return KV_DTYPES[choice]
    if torch.device(device).type == "cpu":
        return torch.float16 if native and dtype != torch.float32 else torch.float32
    return dtype


@dataclass
class KVState:
    k: torch.Tensor  # (batch, num_kv_heads, max_ctx, head_dim)
    v: torch.Tensor

    kind = "kv"


class NoState:
    """A KV-shared layer's state: nothing of its own (it reads its source layer's KV)."""

    kind = "none"


class Attention(nn.Module):
    """Grouped-query attention with the options of the supported families.

    ``q_norm``/``k_norm``: per-head RMSNorm before RoPE (Qwen3, Qwen3.5).
    ``output_gate``: q_proj yields ``[query | gate]`` per head and the output is multiplied
    by ``sigmoid(gate)`` (Qwen3.5 gated attention).
    ``softplus_gate``: a separate projection of the layer input, ``softplus(g(x))``, scales
    the output before the O projection, one value per head (broadcast over the head) or
    per element (Laguna).
    ``kv_role``: "store" leaves this layer's KV for later layers of its kind (``ctx.shared_kv``),
    "reuse" has no K/V projections and attends over that KV (Gemma 4's KV-shared layers);
    "mirror" is a reuse layer whose source is on an earlier stage: it keeps a copy of the
    source's KV, written from the rows the previous stage carried (``ctx.carry_kv``), and
    leaves it for the reuse layers after it on its stage (the stage sets this role).
    """

    def __init__(self, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int,
                 q_bias=None, k_bias=None, v_bias=None, o_bias=None,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                 output_gate: bool = False, window: int | None = None, scale: float | None = None,
                 local_rope: bool = False, softplus_gate: torch.Tensor | None = None, v_norm: bool = False,
                 kv_role: str = ""):
        """``window``: sliding-window attention (a query sees the last ``window`` positions);
        ``local_rope``: rotate with the context's local rotary rows (Gemma's sliding layers);
        ``v_norm``: RMS-normalise each value head without a weight (Gemma 4; eps of the q/k norms)."""
        super().__init__()
        self.local_rope = local_rope
        self.nh, self.nkv, self.hd = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.q_dim = num_heads * head_dim * (2 if output_gate else 1)
        self.kv_dim = num_kv_heads * head_dim
        if kv_role not in ("", "store", "reuse", "mirror"):
            raise ValueError(f"unknown kv_role {kv_role!r}")
        self.kv_role, self.share_key = kv_role, ("sliding" if window is not None else "full")
        # a KV-reusing layer projects only its queries
        self.qkv = Linear(q, q_bias) if kv_role in ("reuse", "mirror") else \
            Linear.fused([q, k, v], [q_bias, k_bias, v_bias])
        self.o = Linear(o, o_bias)
        self.g = None
        if softplus_gate is not None:
            if softplus_gate.shape[0] not in (num_heads, num_heads * head_dim):
                raise ValueError(f"attention gate of {softplus_gate.shape[0]} outputs for {num_heads} heads of "
                                 f"{head_dim}")
            self.g = Linear(softplus_gate)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.v_norm = RMSNorm(torch.ones(head_dim), q_norm.eps if q_norm is not None else 1e-6) if v_norm else None
        self.window = window
        self.scale = scale if scale is not None else head_dim ** -0.5
        # the fused C++ step (RoPE + KV write + attention) for plain attention on the CPU,
        # where the native kernels are on (kernels.attention_step)
        norms_ok = q_norm is None or (k_norm is not None and q_norm.eps == k_norm.eps
                                      and q_norm.weight.shape == k_norm.weight.shape == (head_dim,))
        self.native = (o.device.type == "cpu" and norms_ok and head_dim % 8 == 0 and kv_role not in ("reuse", "mirror")
                       and kernels.enabled() and kernels.load())
        # the per-head q/k norms (Qwen3, Qwen3.5), the output gate (Qwen3.5) and the sliding
        # window (Gemma) as the native step takes them
        self.native_args = {} if q_norm is None or k_norm is None else {
            "q_norm": q_norm.weight, "k_norm": k_norm.weight, "norm_eps": q_norm.eps}
        if output_gate:
            self.native_args["gated"] = True
        if window is not None:
            self.native_args["window"] = int(window)
        if v_norm:
            self.native_args["v_norm"] = True

    def new_state(self, max_ctx: int, device, dtype, batch: int = 1, kv_dtype: str = "auto") -> KVState | NoState:
        if self.kv_role == "reuse":
            return NoState()  # (a mirror keeps its copy of the source's KV: a state like any)
        dtype = cache_dtype(kv_dtype, device, dtype, self.native)
        shape = (batch, self.nkv, max_ctx, self.hd)
        return KVState(torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(shape, device=device, dtype=dtype))

    def native_step_ok(self, x: torch.Tensor, ctx: ForwardContext, state: KVState) -> bool:
        """Whether this block of rows takes the fused native step (decode and verify blocks
        of one sequence, and prefill chunks ending within NATIVE_PREFILL_CTX; position-
        addressed KV or a KV Flash pool, whose score policy the step feeds (``pool_step_args``);
        outside torch.compile: its graph fuses this part itself, and the op's int position
        would make dynamo recompile every step). A prefill chunk on the native step writes the keys, values and outputs
        a decode step of each row would, so there a prefix-cache hit (KV from earlier decode
        steps and shorter chunks) equals a miss (one long chunk) bit for bit; aten's attention
        differs in the last bits, so past NATIVE_PREFILL_CTX a hit can flip a near tie."""
        return (self.native and x.shape[0] == 1
                and (x.shape[1] <= 64 or ctx.start + x.shape[1] <= NATIVE_PREFILL_CTX)
                and (ctx.slots is not None or (ctx.last_q is None and ctx.attn_mass is None))
                and ctx.tail_attn is None and ctx.graph_pos is None
                and state.k.dtype in CPU_NATIVE_CACHE
                and not torch.compiler.is_compiling())

    def native_rows_ok(self, x: torch.Tensor, bank: KVState) -> bool:
        """Whether decode rows of several sequences take the native ``attention_rows``."""
        return (self.native and x.shape[0] == 1 and bank.k.dtype in CPU_NATIVE_CACHE
                and not torch.compiler.is_compiling())

    def _shared(self, ctx: ForwardContext, state):
        """The KV this layer reads: its own (leaving it for the layers that reuse it), or the
        one its source layer left in this forward."""
        if self.kv_role == "mirror":
            rows = ctx.carry_kv.get(self.share_key)
            if rows is None:
                raise RuntimeError("a KV-shared layer's source KV rows did not come with the hidden state")
            self._write_rows(ctx, state, *rows)
        if self.kv_role in ("store", "mirror"):
            ctx.shared_kv[self.share_key] = state
        elif self.kv_role == "reuse":
            state = ctx.shared_kv.get(self.share_key)
            if state is None:
                raise RuntimeError("a KV-shared layer ran without its source layer's KV in the same forward")
        return state

    @staticmethod
    def _write_rows(ctx: ForwardContext, state: KVState, k: torch.Tensor, v: torch.Tensor) -> None:
        """This forward's K/V rows (B, nkv, T, hd: as the source layer stored them) into
        ``state``, where this forward writes: its positions, its KV Flash slots, or each row's
        lane and position."""
        rows = ctx.length if ctx.lanes is None else len(ctx.lanes)
        want = (1 if ctx.lanes is not None else state.k.shape[0], state.k.shape[1], rows, state.k.shape[3])
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"carried K/V rows of shape {tuple(k.shape)} / {tuple(v.shape)}, expected {want}")
        k, v = k.to(state.k.device, state.k.dtype), v.to(state.v.device, state.v.dtype)
        if ctx.lanes is not None:
            for b, (lane, at) in enumerate(zip(ctx.lanes, ctx.row_writes())):
                state.k[lane, :, at], state.v[lane, :, at] = k[0, :, b], v[0, :, b]
        elif ctx.slots is not None:
            state.k.index_copy_(2, ctx.slots, k)
            state.v.index_copy_(2, ctx.slots, v)
        else:
            state.k[:, :, ctx.start:ctx.end], state.v[:, :, ctx.start:ctx.end] = k, v

    @staticmethod
    def read_rows(ctx: ForwardContext, state: KVState) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V rows this forward wrote into ``state`` (B, nkv, T, hd): what a later stage's
        mirror of this layer needs."""
        if ctx.lanes is not None:
            lanes, pos = list(ctx.lanes), ctx.row_writes()
            return state.k[lanes, :, pos].transpose(0, 1)[None], state.v[lanes, :, pos].transpose(0, 1)[None]
        if ctx.slots is not None:
            return state.k[:, :, ctx.slots], state.v[:, :, ctx.slots]
        return state.k[:, :, ctx.start:ctx.end], state.v[:, :, ctx.start:ctx.end]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: KVState) -> torch.Tensor:
        state = self._shared(ctx, state)
        qkv = self.qkv(x)
        if self.native_step_ok(x, ctx, state) and kernels.inference(qkv):
            cos, sin = ctx.rope_f32(self.local_rope)
            args = self.native_args
            if ctx.tree is not None and ctx.slots is None:
                args = {**args, "tree": ctx.tree_parents}
            queries = None
            if ctx.slots is not None:  # KV Flash: write to the pool slots, read the visible ones in
                # logical order (a tree row: the prefix, then its ancestors root first)
                pool, queries = pool_step_args(ctx, x.shape[1], self.nh, self.hd, qkv.dtype, self.window)
                args = {**{k: v for k, v in args.items() if k != "window"}, **pool}
            out = torch.ops.dflash.attention_step(qkv, cos, sin, state.k, state.v, ctx.start, self.nh,
                                                  self.nkv, self.scale, **args)
            if queries is not None:
                ctx.last_q.append(queries)
            return self.o(self._gated(out, x))
        return self.o(self._gated(self._attend(qkv, ctx, state, x.dtype), x))

    def _gated(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The softplus output gate (Laguna) on the attention output (..., nh * hd)."""
        if self.g is None:
            return out
        g = F.softplus(self.g(x).float()).to(out.dtype)
        if g.shape[-1] == self.nh * self.hd:
            return out * g
        return (out.unflatten(-1, (self.nh, self.hd)) * g.unsqueeze(-1)).flatten(-2)

    def forward_rows(self, x: torch.Tensor, ctx: ForwardContext, bank: KVState) -> torch.Tensor:
        """Decode rows of several sequences: row b attends over lane ``ctx.lanes[b]`` of the
        KV bank (lanes, nkv, ctx, hd) at ``ctx.positions[b]``; the projections take all rows."""
        bank = self._shared(ctx, bank)
        qkv = self.qkv(x)
        if self.native_rows_ok(x, bank) and kernels.inference(qkv):
            cos, sin = ctx.rope_f32(self.local_rope)
            args = self.native_args
            score, queries = {}, None
            if ctx.row_pools is not None:   # KV Flash pools: windows are in each row's key list
                args = {k: v for k, v in args.items() if k != "window"}
                score, queries = pool_rows_args(ctx, self.nh, self.hd, qkv.dtype)
            out = torch.ops.dflash.attention_rows(qkv, cos, sin, bank.k, bank.v, ctx.lanes, ctx.positions, self.nh,
                                                  self.nkv, self.scale, **args, **ctx.rows_args(self.window), **score)
            if queries is not None:
                keep_row_queries(ctx, queries)
            return self.o(self._gated(out, x))
        outs, trees = [], ctx.row_trees or {}
        for b, e in runs(list(ctx.lanes)):
            # a tree lane's rows together, every other row alone; with KV Flash pools a slot's
            # rows as its own block forward (the block its pool prepared)
            lane = ctx.lanes[b]
            spans = [(b, e)] if lane in trees or ctx.row_pools is not None else [(r, r + 1) for r in range(b, e)]
            lane_kv = KVState(bank.k[lane:lane + 1], bank.v[lane:lane + 1])
            outs += [self._attend(qkv[:, r:q], ctx.block(r, q), lane_kv, x.dtype) for r, q in spans]
        return self.o(self._gated(torch.cat(outs, dim=1), x))

    def _attend_graph(self, q, k, v, gate, ctx: ForwardContext, state: KVState, dtype: torch.dtype) -> torch.Tensor:
        """A CUDA-graph step's KV write and attention (runtime.cuda_graph): the rows go to the
        cache rows of the position tensor, each query attends over the step's fixed span of
        rows under its mask. A KV head's query heads are taken as rows of one query block (no
        key repeated per head, no GQA support asked of the kernel)."""
        B, T = q.shape[:2]
        g = self.nh // self.nkv
        if ctx.graph_lanes is not None:
            return self._attend_graph_rows(q, k, v, gate, ctx, state, dtype)
        if k is not None:
            state.k.index_copy_(2, ctx.graph_pos, k.transpose(1, 2).to(state.k.dtype))
            state.v.index_copy_(2, ctx.graph_pos, v.transpose(1, 2).to(state.v.dtype))
        keys, values = state.k[:, :, :ctx.graph_span], state.v[:, :, :ctx.graph_span]
        if keys.device.type == "cpu" and keys.dtype != torch.float32:
            keys, values = keys.float(), values.float()
        # (B, T, nh, hd) -> (B, nkv, g * T, hd): a KV head's query heads, each with its T rows
        qg = q.to(keys.dtype).reshape(B, T, self.nkv, g, self.hd).permute(0, 2, 3, 1, 4).reshape(B, self.nkv, g * T, -1)
        mask = ctx.graph_mask(self.window)
        out = sdpa(qg, keys, values, mask if g == 1 else mask.repeat(g, 1), self.scale)
        out = out.reshape(B, self.nkv, g, T, self.hd).permute(0, 3, 1, 2, 4).reshape(B, T, self.nh * self.hd).to(dtype)
        return out if gate is None else out * torch.sigmoid(gate)

    def _attend_graph_rows(self, q, k, v, gate, ctx: ForwardContext, bank: KVState,
                           dtype: torch.dtype) -> torch.Tensor:
        """A CUDA-graph step over decode rows of several slots: row b (of the (1, T) rows)
        writes its K/V into slot ``ctx.graph_lanes[b]`` of the bank (slots, nkv, ctx, hd) at
        its position and attends over that slot's first span rows up to its position; each
        row is a batch of its own for the attention kernel."""
        T, nkv, hd = q.shape[1], self.nkv, self.hd
        C = bank.k.shape[2]
        lanes = ctx.graph_lane_ids
        if k is not None:  # flat rows of the bank: ((slot * nkv + head) * C + position)
            heads = torch.arange(nkv, device=lanes.device)
            rows = ((lanes[:, None] * nkv + heads[None, :]) * C + ctx.graph_pos[:, None]).reshape(-1)
            bank.k.view(-1, hd).index_copy_(0, rows, k.reshape(T * nkv, hd).to(bank.k.dtype))
            bank.v.view(-1, hd).index_copy_(0, rows, v.reshape(T * nkv, hd).to(bank.v.dtype))
        first = ctx.graph_lanes[0]
        if ctx.graph_lanes == tuple(range(first, first + T)):  # consecutive slots: a view
            keys, values = bank.k[first:first + T, :, :ctx.graph_span], bank.v[first:first + T, :, :ctx.graph_span]
        else:
            keys = bank.k[:, :, :ctx.graph_span].index_select(0, lanes)
            values = bank.v[:, :, :ctx.graph_span].index_select(0, lanes)
        if keys.device.type == "cpu" and keys.dtype != torch.float32:
            keys, values = keys.float(), values.float()
        qg = q.to(keys.dtype).reshape(T, nkv, self.nh // nkv, hd)   # (1, T, nh, hd): row b a batch
        mask = ctx.graph_mask(self.window)[:, None, None, :]          # (T, 1, 1, span)
        out = sdpa(qg, keys, values, mask, self.scale).reshape(1, T, self.nh * hd).to(dtype)
        return out if gate is None else out * torch.sigmoid(gate)

    def _tail_attention(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None,
                        acc: torch.Tensor) -> None:
        """acc (L, P) = max(acc, attention probabilities of the last L query rows over the
        P keys, maximised over heads (and the batch))."""
        L, P = acc.shape[0], keys.shape[2]
        B, T = q.shape[:2]
        if T < L:
            raise ValueError(f"tail scoring needs the last {L} rows in one forward, got {T}")
        g = self.nh // self.nkv
        # (B, T, nh, hd) -> (B, nkv, g * L, hd): query heads grouped under their KV head
        qh = q[:, -L:].float().view(B, L, self.nkv, g, self.hd).permute(0, 2, 3, 1, 4).reshape(B, self.nkv, g * L, -1)
        w = (qh @ keys.float().transpose(-1, -2)) * self.scale     # (B, nkv, g * L, P)
        if mask is not None:
            m = mask[-L:]                                          # (L, P)
            w = w.view(B, self.nkv, g, L, P).masked_fill(~m, float("-inf")).view(B, self.nkv, g * L, P)
        w = w.softmax(-1).view(B, self.nkv * g, L, P).amax(dim=(0, 1))
        torch.maximum(acc[:, :P], w, out=acc[:, :P])

    def _attend(self, qkv: torch.Tensor, ctx: ForwardContext, state: KVState, dtype: torch.dtype) -> torch.Tensor:
        """RoPE, KV write and attention of (B, T) rows of the fused projection (aten ops);
        the output before the O projection."""
        B, T, _ = qkv.shape
        gate = None
        cos, sin = ctx.rope(self.local_rope)
        cos, sin = cos[:, None], sin[:, None]
        k = v = None
        if self.kv_role in ("reuse", "mirror"):  # queries only: the keys and values are already in the cache
            q = qkv.view(B, T, self.nh, self.hd)
            if self.q_norm is not None:
                q = self.q_norm(q)
            q = apply_rope(q, cos, sin)
        elif self.output_gate:
            qg = qkv[..., :self.q_dim].view(B, T, self.nh, 2 * self.hd)
            q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(B, T, self.nh * self.hd)
            k = qkv[..., self.q_dim:self.q_dim + self.kv_dim].view(B, T, self.nkv, self.hd)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            # rotate q and k heads together: (B, T, nh + nkv, hd)
            qk = qkv[..., :self.q_dim + self.kv_dim].view(B, T, self.nh + self.nkv, self.hd)
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qk[:, :, :self.nh]), self.k_norm(qk[:, :, self.nh:])], dim=2)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :, :self.nh], qk[:, :, self.nh:]
        if k is not None:
            v = qkv[..., self.q_dim + self.kv_dim:].view(B, T, self.nkv, self.hd)
            if self.v_norm is not None:
                v = self.v_norm(v)
        if ctx.graph_pos is not None:
            return self._attend_graph(q, k, v, gate, ctx, state, dtype)
        if ctx.slots is not None:  # KV Flash: rows live in pool slots (RoPE is already applied)
            if k is not None:
                state.k.index_copy_(2, ctx.slots, k.transpose(1, 2).to(state.k.dtype))
                state.v.index_copy_(2, ctx.slots, v.transpose(1, 2).to(state.v.dtype))
            n, mask = ctx.pool_mask(qkv.device, self.window)
            keys, values = state.k[:, :, :n], state.v[:, :, :n]
        else:
            if k is not None:
                state.k[:, :, ctx.start:ctx.end] = k.transpose(1, 2)
                state.v[:, :, ctx.start:ctx.end] = v.transpose(1, 2)
            keys, values = state.k[:, :, :ctx.end], state.v[:, :, :ctx.end]
            mask = ctx.causal_mask(qkv.device, self.window)
        if keys.device.type == "cpu" and keys.dtype != torch.float32:  # a 16-bit cache: fp32 arithmetic
            keys, values = keys.float(), values.float()
        if ctx.attn_mass is not None and k is not None:
            # KV Flash score policy: how much each slot was attended. The probabilities are
            # computed once, for the output too, each kv head's query heads grouped under it
            # (no repeated keys): measured at 2048 positions, pool 1024, default model, 2 threads,
            # this attention 17.1 -> 11.8 ms a token over the 30 layers, decode 35.7 -> 45.3 tok/s
            g, P = self.nh // self.nkv, keys.shape[2]
            qg = q.transpose(1, 2).to(keys.dtype).reshape(B, self.nkv, g * T, self.hd)  # (B, nkv, g T, hd)
            w = (qg @ keys.transpose(-1, -2)) * self.scale                               # (B, nkv, g T, P)
            if mask is not None:
                w = w.view(B, self.nkv, g, T, P).masked_fill(~mask, float("-inf")).view(B, self.nkv, g * T, P)
            w = w.softmax(-1)
            per_row = w.view(B, self.nkv, g, T, P).double().sum(dim=(0, 1, 2))     # (T, P)
            fixed = (per_row * MASS_ONE).round().long().to(ctx.attn_mass.device)   # (the masses live on the CPU)
            ctx.attn_mass.scatter_add_(1, ctx.slot_mass_keys(self.window)[:, :P], fixed)
            out = (w @ values).view(B, self.nh, T, self.hd)
        else:
            out = sdpa(q.transpose(1, 2).to(keys.dtype), keys, values, mask, self.scale, self.nh != self.nkv)
        if ctx.last_q is not None and k is not None:  # KV Flash re-selection scores chunks against these
            ctx.last_q.append(q.detach())
        if ctx.tail_attn is not None:  # PFlash: what the prompt's last rows attend to
            self._tail_attention(q, keys, mask, ctx.tail_attn)
        out = out.transpose(1, 2).reshape(B, T, self.nh * self.hd).to(dtype)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return out
