"""LocalStage: a contiguous range of target layers on one device, with its sequence state.

The first stage embeds token ids; the last owns the final norm and the LM head. Between
stages only the residual stream (B, T, H) travels. State is position-addressed: a forward
at ``start`` writes positions ``[start, start+T)``; ``length`` is how far the cache is valid.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..errors import ModelLoadError
from ..layers.attention import SCORE_QUERY_ROWS
from ..layers.context import ForwardContext, runs, tree_depths
from ..layers.linear import Linear
from ..layers.rope import rope_tables
from ..layers.stack import NativeStack
from .kv_pool import KvPool

log = logging.getLogger("dflash_server")


COMPILED_MAX_ROWS = 32  # verify blocks of up to this many positions run the compiled graph (--compile)


def _static_model_guards(entries) -> list[bool]:
    """Which of dynamo's guards the compiled step keeps: not those on the layer modules and
    on module globals. Both are fixed once a stage is built (weights are quantized and
    placed before ``compile_decode``; nothing rebinds a module attribute or global later),
    and checking them was most of the ~0.8 ms dynamo spent per step (~6,000 guards). The
    guards on the step's inputs stay: the hidden state, the state tensors, the context
    (position range, which optional inputs are present)."""
    return [not (e.is_global or e.orig_guard.source.is_unspecialized_nn_module()) for e in entries]


@dataclass
class Lane:
    """One sequence slot's state in a stage: its layer states, valid length, checkpoint and
    (KV Flash) its own pool."""
    states: list
    length: int = 0
    ckpt_length: int | None = None
    pool: KvPool | None = None
    tree: tuple[int, ...] | None = None   # the parents of the last tree forward since the checkpoint


@dataclass
class StageOutput:
    hidden: torch.Tensor | None                  # (1, T, H) residual stream (non-last stages)
    head_logits: torch.Tensor | None = None      # (T or 1, V) on the last stage, in the LM head's dtype
    captures: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> (1, T, H)
    # what the next in-process stage needs beside the hidden state (Gemma 4 E2B / E4B: the
    # per-layer inputs and the KV the shared layers read); empty for other families
    carry: dict = field(default_factory=dict)
    _logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def logits(self) -> torch.Tensor | None:
        """``head_logits`` widened to fp32, on first use (a shard worker sends the head's dtype)."""
        if self._logits is None and self.head_logits is not None:
            self._logits = self.head_logits.float()
        return self._logits


class _Weights:
    """Adapts a ModelSource to the family's Weights protocol for one device/dtype."""

    def __init__(self, source, device, dtype):
        self.source, self.device, self.dtype = source, device, dtype
        self.shapes = source.family.expected_shapes(source.config)

    def has(self, name):
        return self.source.has(name)

    def get(self, name):
        t = self.source.get(name)
        want = next((shape for suffix, shape in self.shapes.items() if name.endswith(suffix)), None)
        if want is not None and tuple(t.shape) != tuple(want):
            raise ModelLoadError(f"{self.source.path}: weight {name} has shape {tuple(t.shape)} but the "
                                 f"model config implies {tuple(want)}")
        if t.is_floating_point():
            t = t.to(self.dtype)
        t = t.to(self.device)
        if self.device.type == "cpu" and t.dim() == 2 and kernels.enabled():
            # the stored blocks, for the native kernels: read when a quantized linear asks
            t.packed = lambda: self.source.packed(name)
        return t


class LocalStage:
    def __init__(self, source, begin: int, end: int, device: str, dtype: torch.dtype, max_ctx: int,
                 *, is_first: bool, is_last: bool, quantize: str | tuple[str, str] = "dense", on_layer=None,
                 batch: int = 1, kvflash=None, lanes: int = 1, kv_dtype: str = "auto"):
        """``quantize``: mode for all linears, or (layers mode, LM head mode); modes are
        "dense", "int8", "int4". ``batch`` > 1 runs that many sequences in lockstep (same
        positions; used to sample training data); snapshots and rollback need batch 1.
        ``kvflash``: a KvFlashConfig to keep attention KV in a bounded pool (KV Flash).
        ``lanes``: sequence slots with independent state (continuous batching). Every
        single-sequence operation (forward, prefill, checkpoint, snapshots) acts on the lane
        chosen by ``select``; ``forward_rows`` runs one decode row in each of several lanes.
        An attention layer's KV of all lanes is one bank tensor (lanes, nkv, ctx, hd), each
        lane's state a view of its row. ``kv_dtype``: the KV cache's element type ("auto",
        "f32", "f16", "bf16": ``layers.attention.cache_dtype``)."""
        cfg = source.config
        self.config, self.begin, self.end = cfg, begin, end
        self.device, self.dtype, self.max_ctx = torch.device(device), dtype, max_ctx
        self.is_first, self.is_last = is_first, is_last
        self.label, self.is_remote = str(self.device), False
        fam, w = source.family, _Weights(source, self.device, dtype)
        self.embed = fam.build_embedding(cfg, w) if is_first else None
        self.layers = []
        for i in range(begin, end):
            self.layers.append(fam.build_layer(cfg, i, w).eval())
            if on_layer:
                on_layer()
        self._share_across_stages(cfg)
        self.final_norm = fam.build_final_norm(cfg, w) if is_last else None
        self.lm_head = fam.build_lm_head(cfg, w) if is_last else None
        layer_mode, head_mode = (quantize, quantize) if isinstance(quantize, str) else quantize
        for mod in self._linears():
            mod.quantize_(head_mode if mod is self.lm_head else layer_mode)
        # sliding-window layers with their own RoPE (Gemma, Laguna) rotate with rope_local
        self.rope, self.rope_local = rope_tables(cfg, max_ctx, self.device, dtype)
        self.batch, self.kv_dtype = batch, kv_dtype
        if lanes < 1 or (lanes > 1 and batch > 1):
            raise ValueError(f"{lanes} sequence slots: need >= 1, and 1 with a lockstep batch")
        # KV Flash: a pool (and page table) per slot, each of the pool size; the most recent
        # chunks stay resident, at least a sliding layer's window of them, so sliding layers
        # attend exactly as with full KV while full layers page
        windows = [w for layer in self.layers if (w := layer.mixer.window)]
        if kvflash is not None and windows:
            kvflash = dataclasses.replace(kvflash, tail_chunks=max(kvflash.tail_chunks,
                                                                   -(-max(windows) // kvflash.chunk) + 1))
        pagers = [kvflash.new_pager(max_ctx, self._kv_budget_tokens(kvflash, lanes)) for _ in range(lanes)] \
            if kvflash is not None else None
        kv_rows = pagers[0].pool_tokens if pagers else max_ctx
        self.kv_pool_tokens = kv_rows if pagers else None   # (auto on a GPU: from free memory)
        # per layer: the KV bank of all lanes (None for recurrent layers: a state per lane)
        self.banks = []
        per_lane: list[list] = [[] for _ in range(lanes)]
        for layer in self.layers:
            st = layer.new_state(kv_rows, self.device, dtype, batch if lanes == 1 else lanes, kv_dtype=kv_dtype)
            self.banks.append(st if st.kind == "kv" else None)
            if lanes == 1:
                per_lane[0].append(st)
            elif st.kind == "kv":
                for i in range(lanes):
                    per_lane[i].append(type(st)(st.k[i:i + 1], st.v[i:i + 1]))
            else:
                for i in range(lanes):
                    per_lane[i].append(layer.new_state(kv_rows, self.device, dtype, 1, kv_dtype=kv_dtype))
        self.lanes = [Lane(states, pool=KvPool(pagers[i], states, self.device, kvflash.tau) if pagers else None)
                      for i, states in enumerate(per_lane)]
        self.lane = 0
        self._decode_fn = None
        self._graphs = None  # DecodeGraphs (use_cuda_graphs)
        self._stack: NativeStack | None | bool = False  # _native_stack(): False until decided
        self._compiled_verify_rows = 0  # verify blocks up to this length run the compiled graph
        self._snapshots: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}

    # --- lanes (sequence slots) ---------------------------------------------------------
    def select(self, lane: int) -> None:
        """Make ``lane`` the one single-sequence operations act on."""
        if not 0 <= lane < len(self.lanes):
            raise ValueError(f"sequence slot {lane} outside [0, {len(self.lanes)})")
        self.lane = lane

    @property
    def num_lanes(self) -> int:
        return len(self.lanes)

    @property
    def states(self) -> list:
        return self.lanes[self.lane].states

    @property
    def length(self) -> int:
        return self.lanes[self.lane].length

    @length.setter
    def length(self, n: int) -> None:
        self.lanes[self.lane].length = n

    @property
    def pool(self) -> KvPool | None:
        return self.lanes[self.lane].pool

    @property
    def _ckpt_length(self) -> int | None:
        return self.lanes[self.lane].ckpt_length

    @_ckpt_length.setter
    def _ckpt_length(self, n: int | None) -> None:
        self.lanes[self.lane].ckpt_length = n

    def compile_decode(self) -> None:
        """Use a torch.compile'd layer loop for single-token steps and for DFlash verify
        blocks of up to ``COMPILED_MAX_ROWS`` positions (fuses the small elementwise ops
        between the matmuls). Prefill and KV Flash pools stay eager.

        Shapes are left to dynamo's automatic dynamism: the first step compiles a static
        graph, the second (another position) one where only the position is symbolic, and
        that one serves every later step. ``dynamic=True`` would make every weight dimension
        symbolic too: thousands of shape guards checked per call and generic kernels, 89
        instead of 108 tok/s on the default model (2-core CPU). On CPU the graph also gets
        inductor's C++ wrapper (the kernel calls leave Python: 117 tok/s; the first compile
        takes ~90 s instead of ~20 s). The graph returns every layer's output, so DFlash's
        plain steps (which capture the draft's taps) use it too, rounding as AR steps do.
        Verify blocks (T > 1 rows under a checkpoint) get graphs of their own the same way:
        a static one at the first drafted step, then, at the second block size, one in which
        T is symbolic too, shared by every later block size (dynamo specialises sizes 0 and
        1, so single-token steps keep theirs). Marking T dynamic up front would save the
        static graph, but T also enters as plain ints (positions, slices). A stage with
        recurrent (Gated DeltaNet) layers verifies eagerly: their block form picks its chunk
        size from T, so every block size would be another graph (dynamo's recompile limit
        was reached within one request)."""
        def run_layers(h, ctx, states):
            caps = []
            for layer, state in zip(self.layers, states):
                h = layer(h, ctx, state)
                caps.append(h)
            return h, caps
        options = {}
        if hasattr(torch.compiler, "skip_guard_on_globals_unsafe"):  # guard filters: torch >= 2.8
            options["guard_filter_fn"] = _static_model_guards
        if self.device.type == "cpu":
            options["cpp_wrapper"] = True
        self._decode_fn = torch.compile(run_layers, dynamic=None, options=options)
        self._graphs = None
        recurrent = any(s.kind == "recurrent" for s in self.states)
        self._compiled_verify_rows = 0 if recurrent else COMPILED_MAX_ROWS

    def use_cuda_graphs(self, record: bool = True) -> str | None:
        """Run decode steps, verify blocks and batched decode rows through CUDA graphs
        (runtime.cuda_graph) where this stage allows; returns why not, or None. ``record=False``: the graphs' step without recording
        (tests on a machine without a GPU)."""
        from .cuda_graph import DecodeGraphs, unsupported

        why = unsupported(self)
        if why is None and record and self.device.type != "cuda":
            why = f"device {self.device}"
        if why is None and self._decode_fn is not None:
            why = "--compile"
        self._graphs = None if why else DecodeGraphs(self, record=record)
        return why

    def cuda_graphs(self) -> dict[str, str | None]:
        """CUDA graphs on a GPU stage (``use_cuda_graphs``): {label: why not, or None}; {} on
        other devices."""
        return {self.label: self.use_cuda_graphs()} if self.device.type == "cuda" else {}

    def _graphed(self, run):
        """``run(graphs)``; a failed recording turns the stage's CUDA graphs off for good, with
        a warning, and returns None (the step then runs eagerly)."""
        try:
            return run(self._graphs)
        except RuntimeError as e:
            log.warning("CUDA graphs off on %s: %s", self.label, str(e).strip().splitlines()[0])
            self._graphs = None
            return None

    def _graph_step(self, x: torch.Tensor, start: int, logits: str, capture) -> StageOutput | None:
        """A step (one token, or a verify block under a checkpoint) through the CUDA graphs."""
        got = self._graphed(lambda g: g.step(x, start, capture))
        if got is None:
            return None
        h, caps, head = got
        self.length = start + x.shape[1]
        out = StageOutput(hidden=h, captures=caps)
        if self.is_last and logits != "none":
            out.head_logits, out.hidden = (head[0, -1:] if logits == "last" else head[0]), None
        return out

    def _graph_rows(self, x: torch.Tensor, lanes: list[int], positions: list[int], capture) -> StageOutput | None:
        """``forward_rows`` through the CUDA graphs, or None (a set of slots with no room)."""
        got = self._graphed(lambda g: g.step_rows(x, lanes, positions, capture))
        if got is None:
            return None
        h, caps, head = got
        for lane, pos in zip(lanes, positions):
            self.lanes[lane].length = pos + 1
        if self.is_last:
            return StageOutput(hidden=None, head_logits=head[0], captures=caps)
        return StageOutput(hidden=h, captures=caps)

    def _linears(self):
        mods = [m for layer in self.layers for m in layer.modules() if isinstance(m, Linear)]
        return mods + ([self.lm_head] if self.lm_head is not None else [])

    def weight_bytes(self) -> int:
        total = sum(m.nbytes() for m in self._linears())
        return total + (sum(p.numel() * p.element_size() for p in self.embed.parameters()) if self.embed else 0)

    # --- compute --------------------------------------------------------------------------
    @torch.inference_mode()
    def _share_across_stages(self, cfg) -> None:
        """KV-shared layers split from their source (Gemma 4 E2B / E4B): on this stage the
        first reader of each kind becomes a mirror (a copy of the source's KV, written from the
        rows the previous stage carries); a source read by layers of a later stage exports its
        rows of each forward (``_exports``: share key -> the layer's position here)."""
        self._exports: dict[str, int] = {}
        if not cfg.num_kv_shared_layers:
            return
        mirrored = set()
        for k, layer in enumerate(self.layers):
            m, src = layer.mixer, cfg.kv_source(layer.index)
            if src is not None and src < self.begin and m.share_key not in mirrored:
                m.kv_role = "mirror"
                mirrored.add(m.share_key)
            if m.kv_role == "store" and any(
                    cfg.kv_source(j) == layer.index for j in range(self.end, cfg.num_layers)):
                self._exports[m.share_key] = k

    def _inputs(self, x: torch.Tensor, ctx: ForwardContext, carry: dict | None) -> torch.Tensor:
        """The stage's input hidden state (the first stage embeds token ids), with the
        per-layer inputs (Gemma 4 E2B / E4B) the embedding made or the previous stage carried
        put in ``ctx``."""
        ctx.carry_kv = dict((carry or {}).get("kv") or {})
        if not self.is_first:
            ctx.per_layer = (carry or {}).get("per_layer")
            cfg = self.config
            if cfg.per_layer_input_size:
                want = (*x.shape[:2], cfg.num_layers, cfg.per_layer_input_size)
                if ctx.per_layer is None or tuple(ctx.per_layer.shape) != want:
                    got = None if ctx.per_layer is None else tuple(ctx.per_layer.shape)
                    raise ValueError(f"per-layer inputs of shape {got}, expected {want}")
            return x.to(self.dtype)
        h = self.embed(x)
        ctx.per_layer = self.embed.per_layer_inputs(x, h)
        return h

    def _carry(self, ctx: ForwardContext, states) -> dict:
        """What the next stage needs beside the hidden state: the per-layer inputs, and the
        K/V rows this forward wrote for KV-shared layers on later stages (with those an
        earlier stage sent through this one)."""
        kv = dict(ctx.carry_kv)
        for key, k in self._exports.items():
            kv[key] = self.layers[k].mixer.read_rows(ctx, states[k])
        out = {} if ctx.per_layer is None else {"per_layer": ctx.per_layer}
        if kv:
            out["kv"] = kv
        return out

    def forward(self, x: torch.Tensor, start: int, *, logits: str = "last",
                capture: tuple[int, ...] = (), carry: dict | None = None,
                tree: tuple[int, ...] | None = None, observe: bool = True) -> StageOutput:
        """x: token ids (1, T) on the first stage, else hidden (1, T, H). Writes state for
        positions [start, start+T) and sets ``length = start + T``. ``logits``: "last",
        "all" or "none" (last stage only). ``capture``: global layer ids whose outputs to return.
        ``tree``: the rows are a DDTree (row t's parent row, -1 for the root) verified after a
        ``checkpoint``; each row attends to the cache and its ancestors at position start +
        its depth; ``rollback_tree`` then keeps one path. ``observe``: False keeps KV Flash's
        score policy out of this forward (a prompt's body; KvPool.prepare)."""
        if start > self.length:
            raise ValueError(f"forward at {start} leaves a gap after cached length {self.length}")
        T = x.shape[1]
        if start + T > self.max_ctx:
            raise ValueError(f"positions up to {start + T} exceed the context size {self.max_ctx}")
        x = x.to(self.device)
        if (self._graphs is not None and tree is None and not carry
                and (T == 1 if self._ckpt_length is None else
                     (not self._graphs.recurrent and T <= self._graphs.max_rows))
                and (out := self._graph_step(x, start, logits, capture)) is not None):
            return out
        if tree is not None:
            tree = tuple(int(p) for p in tree)
            if len(tree) != T or self._ckpt_length is None or self.batch != 1:
                raise ValueError("a tree forward needs one parent per row, a checkpoint and one sequence")
            if start != self._ckpt_length:
                raise ValueError("a tree forward starts at its checkpoint")
            at = torch.tensor(tree_depths(tree)) + start
            cos, sin = self.rope.cos[at], self.rope.sin[at]
            self.lanes[self.lane].tree = tree
        else:
            cos, sin = self.rope.rows(start, T)
        ctx = ForwardContext(start, T, cos, sin, record=self._ckpt_length is not None)
        if tree is not None:
            ctx.tree, ctx.tree_parents = tree, torch.tensor(tree, dtype=torch.long)
        h = self._inputs(x, ctx, carry)
        if self.rope_local is not None:
            ctx.cos_local, ctx.sin_local = (self.rope_local.rows(start, T) if tree is None else
                                            (self.rope_local.cos[at], self.rope_local.sin[at]))
        if self.pool is not None:
            self.pool.prepare(start, start + T, ctx, speculative=self._ckpt_length is not None, observe=observe)
        caps = {}
        if self._decode_fn is not None and ctx.slots is None and tree is None and (
                (T == 1 and not ctx.record) or (ctx.record and T <= self._compiled_verify_rows)):
            # every layer's output comes back (T x 30 vectors of H: nothing next to the
            # weights), so steps with captures (DFlash's plain steps, verify blocks) and without
            # run one graph and round alike; a graph per capture set fused differently
            h, outs = self._decode_fn(h, ctx, self.states)
            caps = {layer.index: o for layer, o in zip(self.layers, outs) if layer.index in capture}
        elif (stack := self._native_stack()) is not None and stack.usable(h, ctx, self.states[0]):
            h, caps = stack.run(h, ctx, self.states, capture)
        else:
            for layer, state in zip(self.layers, self.states):
                h = layer(h, ctx, state)
                if layer.index in capture:
                    caps[layer.index] = h
        self.length = start + T
        if self.pool is not None:
            self.pool.finish(ctx)
        out = StageOutput(hidden=h, captures=caps, carry=self._carry(ctx, self.states))
        if self.is_last and logits != "none":
            hs = h[:, -1:] if logits == "last" else h
            head = self._head(self.final_norm(hs))
            out.head_logits = head[0] if self.batch == 1 else head  # (T, V) or (batch, T, V)
            out.hidden = None
        return out

    @torch.inference_mode()
    def forward_rows(self, x: torch.Tensor, lanes: list[int], positions: list[int],
                     capture: tuple[int, ...] = (), carry: dict | None = None,
                     trees: dict[int, tuple[int, ...]] | None = None) -> StageOutput:
        """Decode rows of several lanes: row b is the token of the sequence in ``lanes[b]`` at
        ``positions[b]`` (at most that lane's length; the lane's length becomes its last
        row's position + 1). x: token ids (1, B) on the first stage, else hidden (1, B, H).
        The last stage returns the rows' logits (B, V). Each row's result equals that
        sequence's own single-row ``forward`` where the ops are row-invariant (the native
        kernels): the matmuls take all rows, attention reads each row's own lane.
        ``capture``: global layer ids whose outputs (1, B, H) to return (a draft's taps).
        Where ``can_ragged``, a lane may take several rows at consecutive positions (a
        speculative verify block next to other sequences' rows, adjacent; row t of a lane
        attends to its rows before t) and may hold a checkpoint (``rollback`` then keeps a
        prefix of the rows). ``trees``: {slot: parents} for slots whose rows are a DDTree
        verify (as ``forward(tree=...)``: the slot's checkpoint at its first row, one parent per
        row, the first row the root; ``rollback_tree`` then keeps one path)."""
        B = x.shape[1]
        if len(lanes) != B or len(positions) != B:
            raise ValueError("forward_rows: one lane and one position per row")
        ragged = len(set(lanes)) != B or any(self.lanes[lane].ckpt_length is not None
                                             for lane in lanes if 0 <= lane < len(self.lanes))
        if ragged and not self.can_ragged:
            raise ValueError("forward_rows: one row per slot and no checkpoint here (one sequence per slot "
                             "takes its rows a sequence at a time)")
        nxt: dict[int, int] = {}
        for b, (lane, pos) in enumerate(zip(lanes, positions)):
            if not 0 <= lane < len(self.lanes):
                raise ValueError(f"sequence slot {lane} outside [0, {len(self.lanes)})")
            st = self.lanes[lane]
            want = nxt.get(lane)
            if (not 0 <= pos <= st.length if want is None else (pos != want or lanes[b - 1] != lane)) \
                    or pos >= self.max_ctx:
                raise ValueError(f"forward_rows: position {pos} does not extend slot {lane} (length {st.length}, "
                                 f"context {self.max_ctx}; a slot's rows adjacent, at consecutive positions)")
            nxt[lane] = pos + 1
        trees = self._row_trees(trees or {}, lanes, positions) if trees else None
        pooled = self.lanes[0].pool is not None
        x = x.to(self.device)
        if self._graphs is not None and not carry and not trees and not pooled and \
                (out := self._graph_rows(x, lanes, positions, capture)):
            return out
        rope_at = list(positions)
        parents = [-1] * B if trees else None
        for b, e in runs(lanes) if trees else ():
            tree = trees.get(lanes[b])
            if tree is not None:   # rows at their depths; parents as rows of this forward
                rope_at[b:e] = [positions[b] + d for d in tree_depths(tree)]
                parents[b:e] = [-1 if p < 0 else b + p for p in tree]
        idx = torch.tensor(rope_at, device=self.device)
        ctx = ForwardContext(0, B, self.rope.cos[idx], self.rope.sin[idx], lanes=tuple(lanes),
                             positions=tuple(positions), row_trees=trees,
                             row_parents=None if parents is None else torch.tensor(parents, dtype=torch.long))
        if self.rope_local is not None:
            ctx.cos_local, ctx.sin_local = self.rope_local.cos[idx], self.rope_local.sin[idx]
        if pooled:
            self._prepare_pools(ctx)
        h = self._inputs(x, ctx, carry)
        caps = {}
        if (stack := self._native_stack()) is not None and stack.rows_usable(h, self.banks[0]):
            h, caps = stack.run(h, ctx, self.banks, capture)
        else:
            for i, layer in enumerate(self.layers):
                bank = self.banks[i]
                h = layer(h, ctx, bank if bank is not None else [self.lanes[lane].states[i] for lane in lanes])
                if layer.index in capture:
                    caps[layer.index] = h
        for lane, pos in zip(lanes, positions):
            self.lanes[lane].length = pos + 1
        for lane, tree in (trees or {}).items():
            self.lanes[lane].tree = tree
        for b, e in ctx.row_pools or ():
            self.lanes[lanes[b]].pool.finish(ctx.block(b, e))
        out = StageOutput(hidden=h, captures=caps, carry=self._carry(ctx, self.banks))
        if self.is_last:
            out.head_logits = self._head(self.final_norm(h))[0]
            out.hidden = None
        return out

    def _prepare_pools(self, ctx: ForwardContext) -> None:
        """KV Flash pools in a rows forward: each slot's pool makes its rows' positions
        resident and fills the slot's block context (``ctx.block``) as for that sequence's own
        block forward (its checkpoint marking the rows speculative); the layers then read each
        row's write slot and visible keys from it (``ctx.rows_args``). With the score policy a
        slot's rows' masses are its rows of ``ctx.rows_mass``, which the rows ops add to as the
        slot's own forward adds to its ``attn_mass`` (the same sums), and each layer hands every
        slot its rows' queries (``keep_row_queries``)."""
        spans = tuple(runs(list(ctx.lanes)))
        scoring = self.lanes[0].pool.scoring
        if scoring:
            ctx.rows_mass = torch.zeros(len(ctx.lanes), self.lanes[0].pool.pager.num_physical, dtype=torch.int64)
        for b, e in spans:
            lane = self.lanes[ctx.lanes[b]]
            start = ctx.positions[b]
            block = ctx.block(b, e)
            lane.pool.prepare(start, start + e - b, block, speculative=lane.ckpt_length is not None)
            if block.attn_mass is not None:
                block.attn_mass = ctx.rows_mass[b:e]
        ctx.row_pools = spans

    def _native_stack(self) -> NativeStack | None:
        """The stage's layers as one native op call (layers.stack), decided at the first
        forward (the layers are quantized by then), or None where they cannot run so."""
        if self._stack is False:
            self._stack = NativeStack.build(self.layers)
        return self._stack

    def _row_trees(self, trees: dict, lanes: list[int], positions: list[int]) -> dict[int, tuple[int, ...]]:
        """``forward_rows``' trees checked: each a slot of this forward holding a checkpoint at
        its first row, one parent per row of the slot, the first row the root."""
        if not self.can_tree:
            raise ValueError("forward_rows: tree verify needs one sequence per slot")
        spans = {lanes[b]: (b, e) for b, e in runs(lanes)}
        out = {}
        for lane, tree in trees.items():
            tree = tuple(int(p) for p in tree)
            if lane not in spans:
                raise ValueError(f"forward_rows: a tree for slot {lane}, which has no rows here")
            b, e = spans[lane]
            if len(tree) != e - b or len(tree) > 64 or tree[0] != -1:
                raise ValueError(f"forward_rows: slot {lane}'s tree needs one parent per row (at most 64), "
                                 "the first row the root")
            tree_depths(tree)   # each parent an earlier row
            if self.lanes[lane].ckpt_length != positions[b]:
                raise ValueError(f"forward_rows: slot {lane}'s tree starts at its checkpoint")
            out[lane] = tree
        return out

    # --- KV Flash ---------------------------------------------------------------------------
    def _kv_budget_tokens(self, kvflash, lanes: int = 1) -> int | None:
        """``--kvflash auto`` on a GPU: the tokens of KV that half the free memory (after a
        1.5 GiB reserve) holds for this stage's attention layers, shared by ``lanes`` pools;
        None elsewhere."""
        if kvflash.pool != "auto" or self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        probe = [layer.new_state(1, "meta", self.dtype, kv_dtype=self.kv_dtype) for layer in self.layers]
        per_token = sum(2 * s.k.numel() * s.k.element_size() for s in probe if s.kind == "kv")
        return max(0, (free - (3 << 29)) // 2) // (per_token * lanes) if per_token else None

    @property
    def pager(self):
        return self.pool.pager if self.pool is not None else None

    @property
    def scoring(self) -> bool:
        return self.pool is not None and self.pool.scoring

    @property
    def epoch(self) -> int:
        return 0   # an in-process stage never loses its state

    def health(self) -> dict:
        return {"status": "ok"}

    def close(self) -> None:
        pass

    def kv_bytes(self) -> int:
        """Bytes of attention KV held on the device (the pools, or the full preallocation), all slots."""
        return sum(s.k.numel() * s.k.element_size() * 2 for lane in self.lanes for s in lane.states if s.kind == "kv")

    def kvflash_stats(self) -> dict | None:
        return dict(self.pool.stats(), device_kv_bytes=self.kv_bytes()) if self.pool is not None else None

    @torch.inference_mode()
    def reselect(self) -> bool:
        """KV Flash score policy: re-page by the latest queries now; True if anything moved."""
        return self.pool is not None and self.pool.scoring and self.pool.reselect(self.length)

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on (already normed) draft hidden states (…, H) -> fp32 logits."""
        return self._head(hidden.to(self.device, self.dtype)).float()

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head, its logits tanh-soft-capped where the model says (Gemma 4)."""
        logits = self.lm_head(h)
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    # --- sequence state -------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self) -> None:
        self.length = 0
        self._ckpt_length = None
        self.lanes[self.lane].tree = None
        if self.pool is not None:
            self.pool.reset()
        for s in self.states:
            if s.kind == "recurrent":
                s.conv.zero_()
                s.ssm.zero_()
                s.discard_checkpoint()

    @torch.inference_mode()
    def checkpoint(self) -> None:
        """Remember the current state so ``rollback`` can return to any position between
        here and wherever later forwards reach. KV needs nothing (crop); recurrent layers
        save their state and record what replay needs."""
        self._ckpt_length = self.length
        self.lanes[self.lane].tree = None
        for s in self.states:
            if s.kind == "recurrent":
                s.checkpoint()

    @torch.inference_mode()
    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions (>= the checkpoint's) and drop the rest;
        ends the checkpoint."""
        if self._ckpt_length is None:
            raise RuntimeError("rollback without checkpoint")
        if not self._ckpt_length <= length <= self.length:
            raise ValueError(f"rollback to {length} outside [{self._ckpt_length}, {self.length}]")
        if self.lanes[self.lane].tree is not None and length != self._ckpt_length:
            raise ValueError("after a tree forward, keep a path with rollback_tree (or roll back to the checkpoint)")
        for s in self.states:
            if s.kind == "recurrent":
                s.rollback_to(length - self._ckpt_length)
        self.length = length
        self._ckpt_length = None
        self.lanes[self.lane].tree = None
        if self.pool is not None:
            self.pool.truncate(length)

    @property
    def max_spec_rows(self) -> int:
        """Rows a speculative forward may write: with a KV Flash pool, one chunk (a verify
        block that enters two new chunks would evict before its rows' positions)."""
        return self.pool.pager.chunk if self.pool is not None else 1 << 30

    def spec_room(self, pos: int) -> int:
        """The pool's limit on what a speculative forward of the selected slot at ``pos`` may
        commit (KvPool.spec_room; unbounded without a pool; Pipeline.spec_room adds
        ``max_spec_rows``)."""
        return self.pool.spec_room(pos) if self.pool is not None else 1 << 30

    @property
    def can_ragged(self) -> bool:
        """Whether ``forward_rows`` takes several rows of one slot and slots holding a
        checkpoint (a batch of speculative verify blocks; attention rolls back by a crop,
        recurrent layers record the block as a single sequence's verify does): one sequence per
        slot. With KV Flash pools each slot's pool pages on its own before the forward
        (``_prepare_pools``, the score policy's masses per slot too)."""
        return self.batch == 1

    @property
    def can_tree(self) -> bool:
        """Whether ``forward(tree=...)`` runs here: one sequence per forward (KV Flash pools
        too: the rows' key lists follow the tree, ``rollback_tree`` moves pool slots)."""
        return self.batch == 1

    @property
    def can_tree_rows(self) -> bool:
        """Whether ``forward_rows`` takes a slot's DDTree (``trees``) among other slots' rows."""
        return self.can_tree and self.can_ragged

    @torch.inference_mode()
    def rollback_tree(self, path: list[int]) -> None:
        """After a tree forward: keep the rows of ``path`` (the root, then one accepted child
        after another) as positions checkpoint .. checkpoint + len(path) - 1 and drop the
        rest; ends the checkpoint. KV rows move down to their positions; recurrent layers take
        the state after the path's last row."""
        start = self._ckpt_length
        if start is None:
            raise RuntimeError("rollback without checkpoint")
        n, parents = len(path), self.lanes[self.lane].tree
        if parents is None:
            raise RuntimeError("rollback_tree without a tree forward since the checkpoint")
        if not n or path[0] != 0 or any(not 0 <= b < len(parents) or parents[b] != a for a, b in zip(path, path[1:])):
            raise ValueError(f"tree path {path} is not a path of the last tree's rows")
        rows = torch.tensor(path, device=self.device) + start
        dest = torch.arange(start, start + n, device=self.device)
        if self.pool is not None:  # the rows live in pool slots: move slot to slot
            slot = self.pool.pager.slots(start, start + len(parents))
            rows = torch.tensor([slot[r] for r in path], device=self.device)
            dest = torch.tensor(slot[:n], device=self.device)
        for s in self.states:
            if s.kind == "recurrent":
                s.take_tree_node(path[-1])
            elif s.kind == "kv" and path != list(range(n)):
                s.k[:, :, dest] = s.k[:, :, rows]
                s.v[:, :, dest] = s.v[:, :, rows]
        self.length = start + n
        if self.pool is not None:
            self.pool.keep_path(path)
            self.pool.truncate(self.length)
        self._ckpt_length = None
        self.lanes[self.lane].tree = None

    def commit(self) -> None:
        """Accept everything since the checkpoint."""
        if self._ckpt_length is not None:
            self.rollback(self.length)

    # --- snapshots ------------------------------------------------------------------------
    @staticmethod
    def _kv_from(layer, length: int) -> int:
        """The first KV row a snapshot of ``length`` positions keeps for this layer: a
        sliding-window layer only needs its last window (every later query sees keys past
        ``position - window``; a restored sequence always continues at ``length``)."""
        window = layer.mixer.window
        return max(0, length - window) if window else 0

    def _state_tensors(self, length: int) -> dict[str, torch.Tensor]:
        """Named state of positions [0, length). With KV Flash: the KV rows in position
        order, gathered from the pool and host memory, plus the page table."""
        out = {}
        kv_index = 0
        for layer, s in zip(self.layers, self.states):
            i = layer.index
            if s.kind == "kv" and self.pool is not None:
                out[f"kv_k.{i}"], out[f"kv_v.{i}"] = self.pool.logical_rows(kv_index, length)
                kv_index += 1
            elif s.kind == "kv":
                lo = self._kv_from(layer, length)
                out[f"kv_k.{i}"] = s.k[:, :, lo:length]
                out[f"kv_v.{i}"] = s.v[:, :, lo:length]
            elif s.kind == "recurrent":
                out[f"conv.{i}"], out[f"ssm.{i}"] = s.conv, s.ssm
        if self.pool is not None:
            table, free = self.pool.pager.table()
            out[self._table_key] = torch.tensor(table, dtype=torch.int64).reshape(-1, 2)
            out[self._free_key] = torch.tensor(free, dtype=torch.int64)
            pol, counters, last_q = self.pool.policy_tensors(length)
            out[self._policy_key], out[self._counters_key] = pol, counters
            for k, layer in enumerate(self._attention_layers()):
                out[f"kvflash_q.{layer.index}"] = last_q[k] if last_q else self._no_queries(layer)
        return out

    def _attention_layers(self) -> list:
        return [layer for layer, s in zip(self.layers, self.states) if s.kind == "kv"]

    def _no_queries(self, layer) -> torch.Tensor:
        """The ``kvflash_q`` entry of a pool that has not run a query yet: zero rows."""
        return torch.zeros(self.batch, 0, layer.mixer.nh, layer.mixer.hd, dtype=self.dtype)

    # the layer-id suffix routes these to this stage (snapshot import in a shard worker)
    @property
    def _table_key(self) -> str:
        return f"kvflash_table.{self.begin}"  # (resident chunk, physical chunk), oldest used first

    @property
    def _free_key(self) -> str:
        return f"kvflash_free.{self.begin}"

    @property
    def _policy_key(self) -> str:
        return f"kvflash_policy.{self.begin}"  # (chunk, last use, score) rows

    @property
    def _counters_key(self) -> str:
        return f"kvflash_counters.{self.begin}"  # [policy clock, the next re-selection's position]

    @torch.inference_mode()
    def snapshot_save(self, slot: int) -> None:
        """Copy the state of positions [0, length) into ``slot`` (right-sized)."""
        self._snapshots[slot] = (self.length, {k: v.clone() for k, v in self._state_tensors(self.length).items()})

    @torch.inference_mode()
    def snapshot_restore(self, slot: int) -> None:
        length, tensors = self._snapshots[slot]
        self._load_state(length, tensors)

    def snapshot_nbytes(self, slot: int) -> int:
        return sum(t.numel() * t.element_size() for t in self._snapshots[slot][1].values())

    def snapshot_free(self, slot: int) -> None:
        self._snapshots.pop(slot, None)

    @torch.inference_mode()
    def snapshot_export(self, slot: int) -> dict[str, torch.Tensor]:
        length, tensors = self._snapshots[slot]
        out = {k: v.detach().to("cpu") for k, v in tensors.items()}
        out["length"] = torch.tensor(length, dtype=torch.int64)
        return out

    @torch.inference_mode()
    def snapshot_import(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Validate names, dtypes and shapes against this stage, then store in ``slot``."""
        length = int(tensors["length"])
        if not 0 <= length <= self.max_ctx:
            raise ValueError(f"snapshot length {length} outside context {self.max_ctx}")
        expect = self._state_spec(length)
        if set(expect) != set(tensors) - {"length"}:
            raise ValueError("snapshot tensor names do not match this stage")
        conv = {}
        for k, (shape, dtype) in expect.items():
            t = tensors[k]
            if (shape is not None and tuple(t.shape) != shape) or t.dtype != dtype:
                raise ValueError(f"snapshot tensor {k}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
            conv[k] = t.to(self.device if self.pool is None else "cpu").clone()
        if self.pool is not None:  # the page table must fit this pool (KvPager.adopt checks it all)
            table, free = conv[self._table_key], conv[self._free_key]
            if table.dim() != 2 or table.shape[1] != 2 or free.dim() != 1:
                raise ValueError("snapshot: invalid KV Flash page table")
            pager = self.pool.pager
            pager.check_table(-(-length // pager.chunk), [tuple(r) for r in table.tolist()], free.tolist())
            self.pool.check_policy_tensors(conv[self._policy_key], conv[self._counters_key],
                                           -(-length // pager.chunk))
            rows = None
            for layer in self._attention_layers():
                q = conv[f"kvflash_q.{layer.index}"]
                want = self._no_queries(layer).shape
                if q.dim() != 4 or (q.shape[0], q.shape[2], q.shape[3]) != (want[0], want[2], want[3]) \
                        or q.shape[1] > SCORE_QUERY_ROWS or (rows is not None and q.shape[1] != rows):
                    raise ValueError(f"snapshot tensor kvflash_q.{layer.index}: shape {tuple(q.shape)}")
                rows = q.shape[1]
        self._snapshots[slot] = (length, conv)

    def _state_spec(self, length: int) -> dict[str, tuple[tuple[int, ...] | None, torch.dtype]]:
        """Names -> (shape, dtype) of a snapshot of ``length`` positions (shape None: any)."""
        out = {}
        for layer, s in zip(self.layers, self.states):
            i = layer.index
            if s.kind == "kv":
                rows = length if self.pool is not None else length - self._kv_from(layer, length)
                shape = (s.k.shape[0], s.k.shape[1], rows, s.k.shape[3])
                out[f"kv_k.{i}"], out[f"kv_v.{i}"] = (shape, s.k.dtype), (shape, s.v.dtype)
            elif s.kind == "recurrent":
                out[f"conv.{i}"], out[f"ssm.{i}"] = (tuple(s.conv.shape), s.conv.dtype), (tuple(s.ssm.shape), s.ssm.dtype)
        if self.pool is not None:
            out[self._table_key] = out[self._free_key] = (None, torch.int64)
            out[self._policy_key], out[self._counters_key] = (None, torch.float64), ((2,), torch.int64)
            for layer in self._attention_layers():
                out[f"kvflash_q.{layer.index}"] = (None, self.dtype)
        return out

    def _load_state(self, length: int, tensors: dict[str, torch.Tensor]) -> None:
        if self.pool is not None:
            rows = [(tensors[f"kv_k.{layer.index}"], tensors[f"kv_v.{layer.index}"])
                    for layer, s in zip(self.layers, self.states) if s.kind == "kv"]
            table = [tuple(r) for r in tensors[self._table_key].tolist()]
            policy = (tensors[self._policy_key], tensors[self._counters_key],
                      [tensors[f"kvflash_q.{layer.index}"] for layer in self._attention_layers()])
            self.pool.restore(length, rows, table, tensors[self._free_key].tolist(), policy)
        for layer, s in zip(self.layers, self.states):
            i = layer.index
            if s.kind == "kv" and self.pool is not None:
                continue
            if s.kind == "kv":
                lo = self._kv_from(layer, length)
                s.k[:, :, lo:length].copy_(tensors[f"kv_k.{i}"])
                s.v[:, :, lo:length].copy_(tensors[f"kv_v.{i}"])
            elif s.kind == "recurrent":
                s.conv = tensors[f"conv.{i}"].clone()
                s.ssm = tensors[f"ssm.{i}"].clone()
                s.discard_checkpoint()
        self.length = length
        self._ckpt_length = None
