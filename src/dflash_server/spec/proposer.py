"""DFlashProposer: drafts a block for the target pipeline with a DFlash draft.

Glue between the draft (which owns only its layers and context cache) and the target
pipeline (which lends its embedding and LM head). Drafts are always greedy: with a one-hot
draft, matching against target-sampled tokens is exactly lossless.
"""
from __future__ import annotations

import logging

import torch

from .. import kernels

from .batch_sizer import BatchSizer
from .block_sizer import BlockSizer
from .ddtree import DraftTree, build_tree
from .draft import DFlashDraft
from .lookup import MAX_DEPTH as LOOKUP_MAX_DEPTH
from .tree_sizer import TreeSizer

MAX_VERIFY_ROWS = 64  # rows of one verify forward (the native attention step's limit)
# deferred context rows that ride along with a block's draft pass (more: appended on their own first)
ONE_PASS_CONTEXT_ROWS = 64
MAX_TREE_BUDGET = MAX_VERIFY_ROWS - 1  # nodes: with the anchor, a verify of at most MAX_VERIFY_ROWS
log = logging.getLogger("dflash_server")


def truncate(q: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Rows of probabilities (T, R) cut as a sampler cuts: the top_k best, then the fewest
    best whose mass reaches top_p, then those under min_p x the best; renormalized."""
    R = q.shape[-1]
    if 0 < top_k < R:
        kth = torch.topk(q, top_k, dim=-1).values[:, -1:]
        q = torch.where(q >= kth, q, torch.zeros_like(q))
    if top_p < 1.0:
        vals, order = q.sort(dim=-1, descending=True)
        vals = vals.masked_fill(vals.cumsum(-1) - vals >= top_p * vals.sum(-1, keepdim=True), 0.0)
        q = torch.zeros_like(q).scatter_(-1, order, vals)
    if min_p > 0.0:
        q = q.masked_fill(q < min_p * q.max(-1, keepdim=True).values, 0.0)
    return q / q.sum(-1, keepdim=True)


class DFlashProposer:
    method = "dflash"

    def __init__(self, draft: DFlashDraft, pipeline, block_size: int | None = None, fast_head: bool | None = None,
                 adaptive: bool = False, sampled_verify: str = "auto", tree_budget: int = 0, lookup: int = 0,
                 batched: bool = True):
        """``block_size``: verify block (default: the trained one); with ``adaptive`` the
        largest one, and each step picks the block expected to commit the most tokens per
        second (``BlockSizer``; 1 = a plain decode step).
        ``fast_head``: give the draft its own int4 copy of the LM head (CPU only). Draft
        logits only pick proposals, so rounding there cannot change the output, and the
        weight-only head costs about half the int8 one per row (the draft projects B-1 rows
        every step). Default: on when the target runs on CPU. ``tree_budget`` > 0: verify a
        DDTree of that many drafted nodes each step instead of the argmax chain (spec.ddtree;
        where the pipeline supports tree verify). A draft with ``vocab_ids``
        always gets its own head, made of those rows only (int4 where ``fast_head``).
        ``lookup`` > 0: where the context repeats its last few tokens, a step verifies up to
        that many tokens copied from the earlier occurrence instead of drafting
        (spec.lookup; with DDTrees the copied chain is grafted onto the step's tree).
        ``batched``: several running sequences verify their blocks in one forward where the
        stages can (``batch_verify``); else
        they decode plain rows together, each feeding its draft context."""
        cfg = pipeline.config
        self.batched = batched
        draft.check_target(cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
        trained = draft.cfg.block_size
        self.block_size = block_size or min(trained, MAX_VERIFY_ROWS)   # (a draft trained on longer blocks)
        if not 2 <= self.block_size <= MAX_VERIFY_ROWS:
            raise ValueError(f"block size must be in [2, {MAX_VERIFY_ROWS}] (a verify of at most "
                             f"{MAX_VERIFY_ROWS} rows), got {self.block_size}")
        if self.block_size > trained:
            log.warning("block size %d is larger than the draft's trained block (%d): positions past %d are "
                        "drafted out of distribution and rarely accepted", self.block_size, trained, trained)
        if sampled_verify not in ("auto", "rejection", "exact"):
            raise ValueError(f"sampled_verify must be auto, rejection or exact, got {sampled_verify!r}")
        # sampled requests: "rejection" draws drafts from the draft's distribution and keeps
        # them by rejection sampling (more accepted); "exact" drafts the argmax and keeps a
        # draft where it equals the target's own sample (one draw per token from the
        # request's RNG: a seeded request repeats plain decoding exactly, whatever the
        # blocks); "auto": exact for seeded requests, rejection otherwise
        self.sampled_verify = sampled_verify
        if not 0 <= tree_budget <= MAX_TREE_BUDGET:
            raise ValueError(f"tree budget must be in [0, {MAX_TREE_BUDGET}], got {tree_budget}")
        self.tree_budget = int(tree_budget)
        if not 0 <= lookup <= LOOKUP_MAX_DEPTH:
            raise ValueError(f"lookup depth must be in [0, {LOOKUP_MAX_DEPTH}], got {lookup}")
        self.lookup_depth = int(lookup)
        self.lookup_store = None   # LookupStore across requests (--lookup-store), set by the loader
        self.draft, self.pipeline = draft, pipeline
        self.selector = draft.selector                       # DFlash 2's candidate selector
        if draft.cfg.dflash2 and self.selector is None:
            raise ValueError("a DFlash 2 draft runs in this process only (its selector walks the target's "
                             "vocabulary): not with --draft-device remote:")
        self.taps = draft.cfg.target_layer_ids
        self.mask_id = draft.cfg.mask_token_id
        # adaptive: the chain's block size, or with trees the tree budget (up to tree_budget)
        self.sizer = None
        if adaptive:
            self.sizer = TreeSizer(self.tree_budget) if self.uses_tree(pipeline) else BlockSizer(self.block_size)
        # several sequences speculating in one forward: their blocks chosen together
        self.batch_sizer = BatchSizer(self.sizer) if self.sizer is not None else None
        self._pending: list[tuple[int, torch.Tensor]] = []   # deferred context: (start, features)
        self._pendings = {0: self._pending}                  # per sequence slot
        self._lane = 0                                       # the selected slot
        self._ahead: dict[tuple, tuple] = {}                 # draft_ahead's results
        self.vocab = draft.vocab_ids                         # None: the whole vocabulary
        if fast_head is None:
            fast_head = pipeline.device.type == "cpu" and pipeline.stages[-1].dtype == torch.bfloat16
        # the token of each row of the draft's own head (None: row i is token i)
        self.head, self.head_ids = None, self.vocab
        if fast_head or self.vocab is not None:
            self.head, self.head_ids = self._own_head(pipeline, self.vocab, fast_head)

    @staticmethod
    def _own_head(pipeline, rows: torch.Tensor | None, int4: bool):
        """(head, row token ids): the draft's own LM head, the target's head matrix (only
        ``rows`` of it when given), int4 when asked and supported. (None, None): use the
        pipeline's head."""
        from ..layers.linear import Linear, int4_supported

        src, cfg = pipeline.source, pipeline.config
        tied = cfg.tie_word_embeddings or not src.has("lm_head.weight")
        w = src.get("model.embed_tokens.weight" if tied else "lm_head.weight")
        last = pipeline.stages[-1]
        if rows is not None:
            if int4 and last.device.type == "cpu":
                # int4 packing wants a multiple of 16 rows: repeat leading tokens (same logits, same token)
                rows = torch.cat([rows, rows[:-len(rows) % 16]]) if len(rows) >= 16 else rows
            w = w[rows]
        w = w.to(last.device, last.dtype)
        head = Linear(w)
        if int4 and int4_supported(w):
            head.quantize_("int4")
        elif rows is None:
            return None, None           # a dense full copy would only duplicate the pipeline's head
        return head, rows

    def select(self, lane: int) -> None:
        """Act on sequence slot ``lane``'s draft context from now on (continuous batching)."""
        self.draft.select(lane)
        self._lane = lane
        self._pending = self._pendings.setdefault(lane, [])

    @torch.inference_mode()
    def draft_ahead(self, items: list[tuple[int, int, int, int]]) -> None:
        """Draft the next blocks of several sequences in one pass: ``items`` (slot, anchor,
        start, block >= 2) each; the draft runs every block's rows together (each attending
        over its own slot's context) and the head projects them in one call. Each
        sequence's ``propose*`` then takes its result instead of a pass of its own; what is
        not taken is dropped at the next call (``draft_ahead([])`` drops it now)."""
        self._ahead = {}
        if len(items) < 2:
            return
        self.flush_lanes([lane for lane, *_ in items])
        sizes = [block for *_, block in items]
        ids = torch.tensor([[t for _, anchor, _, block in items for t in [anchor] + [self.mask_id] * (block - 1)]])
        embeds = self.block_embeds(ids).split(sizes, dim=1)
        hidden = self.draft.draft_hidden_rows([(lane, e, start) for (lane, _, start, _), e in zip(items, embeds)])
        self._lane = items[-1][0]                        # the draft's selected slot now
        self._pending = self._pendings.setdefault(self._lane, [])
        logits = self._project(torch.cat([h[:, 1:] for h in hidden], dim=1)).split([b - 1 for b in sizes])
        for (lane, anchor, start, block), h, lg in zip(items, hidden, logits):
            self._ahead[(lane, anchor, start, block)] = (h[0, 1:], lg)

    def reset(self) -> None:
        self._pending.clear()
        self.draft.reset()

    def snapshot(self) -> dict[str, torch.Tensor]:
        self.flush()
        return self.draft.context_export()

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        self._pending.clear()
        self.draft.context_import(tensors)

    @property
    def context_length(self) -> int:
        self.flush()
        return self.draft.context.length

    def add_context(self, captures: dict[int, torch.Tensor], start: int, n: int | None = None,
                    defer: bool = False) -> None:
        """Append the tapped outputs of committed positions [start, start+n). ``defer``: only
        keep them until the draft next needs its context (plain steps of the adaptive block
        size add one position each; one batched append later is cheaper than many)."""
        feats = self._features(captures)
        if n is not None:
            feats = feats[:, :n]
        if defer and self._defer(self._pending, feats, start):
            return
        self.flush()
        self.draft.append_context(feats, start)

    def add_rows(self, captures: dict[int, torch.Tensor], lanes: list[int], positions: list[int]) -> None:
        """``add_context(..., defer=True)`` of a batched decode step's rows: row b of
        ``captures`` (1, B, H) is position ``positions[b]`` of slot ``lanes[b]``. One
        concatenation for all rows instead of one per row: in a server every tensor op of the
        step loop lets the HTTP thread take the GIL, so fewer of them shorten the step (4 rows
        of the default model: ~24 ops fewer). The selected slot is unchanged."""
        feats = self._features(captures)
        for b, (lane, pos) in enumerate(zip(lanes, positions)):
            row = feats[:, b:b + 1]
            if not self._defer(self._pendings.setdefault(lane, []), row, pos):   # (not after its pending rows)
                selected = self._lane
                self.select(lane)
                self.flush()
                self.draft.append_context(row, pos)
                self.select(selected)

    def _features(self, captures: dict[int, torch.Tensor]) -> torch.Tensor:
        """The tapped outputs as the draft's (1, n, taps*H) input rows, on its device (tapped
        layers may sit on several)."""
        dev = self.draft.device
        return torch.cat([c if c.device == dev else c.to(dev) for c in (captures[t] for t in self.taps)], dim=-1)

    @staticmethod
    def _defer(pending: list, feats: torch.Tensor, start: int) -> bool:
        """Keep ``feats`` (positions from ``start``) in ``pending`` if they continue it."""
        if pending and pending[-1][0] + pending[-1][1].shape[1] != start:
            return False
        pending.append((start, feats))
        return True

    def flush(self) -> None:
        """Append the selected slot's deferred positions to the draft's context."""
        self.flush_lanes([self._lane])

    def flush_lanes(self, lanes: list[int]) -> None:
        """``flush`` of several slots in one draft call (``append_contexts``); the selected
        slot is unchanged."""
        items = []
        for lane in lanes:
            pending = self._pendings.get(lane)
            if pending:
                items.append((lane, pending[0][1] if len(pending) == 1 else
                              torch.cat([f for _, f in pending], dim=1), pending[0][0]))
                pending.clear()
        if items:
            self.draft.append_contexts(items)
            self.draft.select(self._lane)

    def rejection_sampling(self, sampling) -> bool:
        """Whether a request with these SamplingParams verifies by rejection sampling."""
        if sampling.greedy or self.sampled_verify == "exact":
            return False
        return self.sampled_verify == "rejection" or sampling.seed is None

    def _draft_logits(self, anchor: int, start: int, block: int) -> torch.Tensor:
        """(block - 1, rows) logits of the draft's positions after ``anchor``: over the
        vocabulary, or over the draft vocabulary's rows (``head_ids``) when it has one."""
        return self._draft_hidden_logits(anchor, start, block)[1]

    def _draft_hidden_logits(self, anchor: int, start: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._ahead.pop((self._lane, anchor, start, block), None)
        if got is not None:
            return got
        ids = torch.tensor([[anchor] + [self.mask_id] * (block - 1)], dtype=torch.long)
        embeds = self.block_embeds(ids)
        got = self._one_pass(embeds, start)
        if got is not None:
            return got
        self.flush()
        hidden = self.draft.draft_hidden(embeds, start)
        return hidden[0, 1:], self._project(hidden[:, 1:])

    def _one_pass(self, embeds: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The deferred context, the block and the draft's own head in one native call
        (``DFlashDraft.pass_block``), or None where the draft cannot (then nothing changed)."""
        feats = ctx_start = None
        if self._pending:
            n = sum(f.shape[1] for _, f in self._pending)
            if n > ONE_PASS_CONTEXT_ROWS or self._pending[0][0] + n != start:
                self.flush()
            else:
                ctx_start = self._pending[0][0]
                feats = self._pending[0][1] if len(self._pending) == 1 else \
                    torch.cat([f for _, f in self._pending], dim=1)
        last = self.pipeline.stages[-1]
        # the head in the pass where it reads the draft's rows as _project would (its device and dtype)
        head = self.head if last.device == self.draft.device and last.dtype == self.draft.dtype else None
        got = self.draft.pass_block(embeds, start, feats, ctx_start, head)
        if got is None:
            return None
        self._pending.clear()
        hidden, logits = got
        if logits is None:   # (the pipeline's head, or one the pass cannot take)
            return hidden[0, 1:], self._project(hidden[:, 1:])
        return hidden[0, 1:], self._shape(logits)

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft hidden rows (1, n, H) -> (n, rows) logits over the vocabulary, or over the
        draft vocabulary's rows (``head_ids``)."""
        if self.head is not None:
            last = self.pipeline.stages[-1]
            logits = self.head(hidden.to(last.device, last.dtype))
        else:
            logits = self.pipeline.project(hidden)
        return self._shape(logits)

    def _shape(self, logits: torch.Tensor) -> torch.Tensor:
        """A head's (1, n, rows) logits -> (n, vocabulary or draft-vocabulary rows), shaped as
        the draft's config says (a padded head may have more rows than the vocabulary; int4
        padding repeats leading rows)."""
        logits = logits[0, :, :self.pipeline.config.vocab_size if self.vocab is None else len(self.vocab)]
        return self.draft.cfg.shape_logits(logits)

    def _row_ids(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The token id of each logit row (None: row r is token r)."""
        return None if self.head_ids is None else self.head_ids[:logits.shape[-1]]

    def block_embeds(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft's input rows for [anchor, MASK...]: the target's raw embedding rows
        (without a family's own scale, e.g. Gemma's sqrt(hidden)) x input_embedding_scale."""
        emb = self.pipeline.embed(ids, raw=True)
        scale = self.draft.cfg.input_embedding_scale
        return emb if scale == 1.0 else emb * scale

    def uses_tree(self, pipeline) -> bool:
        """Whether steps verify a DDTree: a budget, a DFlash 1 draft and a pipeline that can."""
        return self.tree_budget > 0 and self.selector is None and pipeline.supports_tree

    def batch_verify(self, pipeline) -> bool:
        """Whether several running sequences verify their blocks (or trees) in one target
        forward: the stages take a slot's rows together (KV Flash pools included),
        and its tree where steps verify DDTrees; not where ``batched`` is off."""
        return self.batched and pipeline.supports_ragged and (not self.uses_tree(pipeline) or pipeline.supports_tree_rows)

    @torch.inference_mode()
    def propose_tree(self, anchor: int, start: int, block: int, budget: int) -> DraftTree:
        """The best-first tree of at most ``budget`` nodes over the draft's distributions at
        the ``block - 1`` positions after ``anchor``."""
        if block < 2:
            return build_tree(torch.zeros(0, 1), 0)
        logits = self._draft_logits(anchor, start, block)
        return build_tree(logits, budget, self._row_ids(logits))

    @torch.inference_mode()
    def propose(self, anchor: int, start: int, block: int) -> list[int]:
        """``block - 1`` draft tokens following ``anchor`` (which sits at ``start``): the
        draft's argmax at each position."""
        if block < 2:
            return []
        if self.selector is not None:   # DFlash 2: the candidate selector's walk from the anchor
            hidden, logits = self._draft_hidden_logits(anchor, start, block)
            return self.selector.walk(hidden, logits, self._row_ids(logits), anchor)[0]
        best = kernels.argmax(self._draft_logits(anchor, start, block)).cpu()   # the first index of the max
        return (self.head_ids[best] if self.head_ids is not None else best).tolist()

    @torch.inference_mode()
    def propose_sampled(self, anchor: int, start: int, block: int, sampling,
                        generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """(tokens, q): ``block - 1`` draft tokens, each drawn from the draft's own
        distribution at its position, q = softmax(logits / temperature) truncated by the
        request's top-k / top-p / min-p as the target's p is (so no draft mass lands where p
        has none; the reference truncates q the same way), (block - 1, V) over the target
        vocabulary (zero outside a draft vocabulary). Verification keeps token i with
        probability min(1, p_i / q_i) (see Sequence.commit_draft). ``sampling``: the
        request's SamplingParams."""
        temperature = sampling.temperature
        if block < 2:
            return [], torch.zeros(0, self.pipeline.config.vocab_size)
        V = self.pipeline.config.vocab_size
        if self.selector is not None:   # DFlash 2: q is the walk's distribution over each position's candidates
            hidden, logits = self._draft_hidden_logits(anchor, start, block)
            toks, cands, q_k = self.selector.walk(hidden, logits, self._row_ids(logits), anchor, temperature,
                                                  generator)
            q = torch.zeros(len(toks), V, dtype=q_k.dtype, device=q_k.device)
            return toks, q.scatter_add_(1, cands.to(q_k.device), q_k)
        q_rows = truncate(kernels.softmax_t(self._draft_logits(anchor, start, block), temperature),
                          sampling.top_k, sampling.top_p, sampling.min_p)
        q_rows = q_rows.to(generator.device)
        # inverse CDF, one uniform per position (torch.multinomial: 2.5 ms for 7 x 15k rows on
        # the dev CPU, this: 0.1 ms)
        cdf = q_rows.double().cumsum(-1)
        u = torch.rand((q_rows.shape[0], 1), generator=generator, dtype=torch.float64, device=cdf.device)
        picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_max(q_rows.shape[1] - 1)
        if self.head_ids is None:
            return picks.tolist(), q_rows[:, :V]
        ids = self.head_ids[:q_rows.shape[1]].to(q_rows.device)
        q = torch.zeros(q_rows.shape[0], V, dtype=q_rows.dtype, device=q_rows.device).index_add_(1, ids, q_rows)
        return ids[picks].tolist(), q
