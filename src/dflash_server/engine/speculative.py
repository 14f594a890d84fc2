"""DFlash speculative decoding: one step of one sequence.

Each step: the proposer drafts ``B-1`` tokens after the anchor in one pass; the target
verifies ``[anchor, drafts]`` in one forward (capturing the tapped layers). Greedy: the
draft proposes its argmax and drafts are accepted while they equal the target's argmax, so
the output is plain decoding's token for token. Sampled: the draft draws each token from
its own distribution q, and position by position the target keeps it with probability
min(1, p/q) (p: the request's sampling distribution) or draws from the residual
max(0, p - q) and stops, so every token is distributed exactly as plain sampling's. A
seeded request instead drafts the argmax and keeps drafts equal to the target's own sample
(one draw per token, so it repeats plain decoding exactly whatever the block sizes; see
DFlashProposer.sampled_verify). Rejected positions are rolled back (KV crop; recurrent state replay) and the
committed positions' features extend the draft's context.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..spec.ddtree import chain_tree, graft
from ..spec.lookup import LookupStore, LookupUse

if TYPE_CHECKING:
    from ..spec.ddtree import DraftTree
    from ..spec.proposer_protocol import Proposer


@dataclass
class SpecStats:
    block_size: int
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    committed: int = 0
    plain_steps: int = 0  # steps the adaptive block size ran without drafting (not in tau)
    tree_steps: int = 0   # steps that verified a DDTree (their "proposed" counts its nodes)
    lookup_steps: int = 0  # steps that verified prompt-lookup drafts (spec.lookup) instead of the draft's
    histogram: list[int] = field(default_factory=list)  # [k] = steps that accepted exactly k drafts

    def __post_init__(self):
        if not self.histogram:
            self.histogram = [0] * self.block_size

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:                     # a plain decode step (adaptive block size 1)
            self.plain_steps += 1
            return
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        self.committed += accepted + 1
        if accepted >= len(self.histogram):   # (a lookup may verify more drafts than the draft's block)
            self.histogram += [0] * (accepted + 1 - len(self.histogram))
        self.histogram[accepted] += 1

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verify step (tau), bonus token included."""
        return self.committed / self.steps if self.steps else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def position_acceptance(self) -> list[float]:
        """[k] = fraction of steps whose draft k+1 was accepted."""
        n = max(1, self.steps)
        return [sum(self.histogram[k + 1:]) / n for k in range(self.block_size - 1)]

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "steps": self.steps, "proposed": self.proposed,
                "accepted": self.accepted, "plain_steps": self.plain_steps, "tree_steps": self.tree_steps,
                "lookup_steps": self.lookup_steps,
                "mean_tree_nodes": round(self.proposed / self.steps, 3) if self.tree_steps and self.steps else 0.0,
                "mean_block_size": round(1 + self.proposed / self.steps, 3) if self.steps else 0.0,
                "acceptance_length": round(self.acceptance_length, 4),
                "accept_rate": round(self.accept_rate, 4), "accept_histogram": list(self.histogram),
                "position_acceptance": [round(x, 4) for x in self.position_acceptance()]}


def spec_begin(proposer: Proposer, seq) -> None:
    """Start ``seq``'s speculation statistics (its first step), or point the adaptive block
    size at its request (sequences take turns in the step loop)."""
    sizer = proposer.sizer
    if seq.spec is None:
        seq.spec = SpecStats(proposer.block_size)
        if sizer is not None:
            sizer.begin_request("greedy" if seq.sampler.params.greedy else "sampled", key=seq.id)
    elif sizer is not None:
        sizer.select(seq.id)


def spec_end(proposer: Proposer, seq) -> None:
    if proposer.sizer is not None:
        proposer.sizer.end_request(seq.id)
    store = proposer.lookup_store
    if store is not None and seq.error is None and seq.req.speculate and seq.out.tokens:
        store.add(list(seq.prompt) + list(seq.out.tokens))   # (finished or stopped: what later requests may copy)


@dataclass
class RowsVerify:
    """One sequence's verify step (alone, or its part of a batched one): its anchor, then a
    chain of drafts (``q``: their distributions where kept by rejection sampling) or a
    DDTree's nodes; no drafts: a plain decode row. ``size``: what the sizer learns it under
    (the chain's block, the tree's budget)."""
    seq: object
    drafts: list[int]
    q: torch.Tensor | None = None
    tree: DraftTree | None = None
    size: int = 1
    lookup: bool = False   # the drafts are a prompt lookup's (spec.lookup), not the draft's
    looked: tuple[int, ...] = ()   # a tree's grafted prompt-lookup chain (its tokens), if any

    @property
    def rows(self) -> int:
        return 1 + len(self.drafts)

    def accept(self, logits) -> tuple[list[int], bool]:
        """Commit the target's tokens (``logits``: the rows' logits); returns (the rows kept:
        the chain's accepted prefix or the tree's path, whether the sequence finished)."""
        seq = self.seq
        if self.tree is None:
            acc, done = accept_block(seq, logits, self.drafts, self.q)
            return list(range(acc + 1)), done
        path, done, children = [0], seq.commit(logits[0]), self.tree.children()
        while not done and (nxt := children[path[-1]].get(seq.last)) is not None:
            path.append(nxt)
            done = seq.commit(logits[nxt])
        return path, done

    def keep(self, pipe, proposer: Proposer, kept: list[int], captures: dict) -> None:
        """Keep ``kept`` rows in the target's caches (the slot selected) and append their
        captured features to the draft context."""
        pos = self.seq.pos
        if self.tree is not None:
            pipe.rollback_tree(kept)
            rows = torch.tensor(kept)
            proposer.add_context({k: v.index_select(1, rows.to(v.device)) for k, v in captures.items()},
                                 pos, len(kept), defer=True)
            return
        if self.rows > 1:
            pipe.rollback(pos + len(kept))
        # the features wait for the next draft pass, which takes them with its block (one call)
        proposer.add_context(captures, pos, len(kept), defer=True)

    def record(self, kept: list[int], done: bool) -> None:
        """Count the step in the sequence's statistics (and its lookups' record)."""
        spec = self.seq.spec
        spec.record(self.rows - 1, len(kept) - 1)
        spec.tree_steps += self.tree is not None
        if self.lookup:
            spec.lookup_steps += 1
            self.seq.lookup.learn(len(kept) - 1)
        elif self.looked:   # a tree with a lookup chain: the lookup paid for the chain's tokens on the path
            spec.lookup_steps += 1
            path = [self.tree.tokens[r - 1] for r in kept[1:]]
            self.seq.lookup.learn(next((i for i, (a, b) in enumerate(zip(path, self.looked)) if a != b),
                                       min(len(path), len(self.looked))))

    def learned(self, kept: list[int], done: bool) -> int | None:
        """What the sizer observed (None: the sequence ended, acceptance not observed): the
        chain's accepted drafts, the tree's committed tokens."""
        if done:
            return None
        return len(kept) - 1 if self.tree is None else len(kept)


def speculative_step(pipe, proposer: Proposer, seq) -> str | None:
    """One draft + verify step of ``seq`` (anchor ``seq.last`` at ``seq.pos``, already
    emitted, not yet in the target cache; its slot selected). Returns the finish reason when
    the sequence ends here, None to go on. ``seq.on_commit(length, logits)`` is called with
    the committed length and the logits that predicted the newest (not yet cached) token."""
    if proposer.uses_tree(pipe):
        return tree_step(pipe, proposer, seq)
    sizer = proposer.sizer
    spec_begin(proposer, seq)
    anchor, pos = seq.last, seq.pos
    room = block_room(pipe, seq)
    look = lookup_drafts(proposer, seq, room)
    if look:
        block = 1 + len(look)
    else:
        block = min(sizer.choose() if sizer is not None else proposer.block_size, room)
    if block < 1:
        return "length"
    t0 = time.perf_counter()
    v = RowsVerify(seq, look, size=block, lookup=True) if look else \
        RowsVerify(seq, *draft_block(proposer, seq, block), size=block)
    if block > 1:                               # a plain step (block 1) has nothing to roll back
        pipe.checkpoint()
    verify = pipe.forward([anchor] + v.drafts, pos, logits="all", capture=proposer.taps)
    kept, done = v.accept(verify.logits)        # positions pos .. pos + len(kept) - 1 are committed
    v.keep(pipe, proposer, kept, verify.captures)
    v.record(kept, done)
    if sizer is not None and not look:          # (the sizer learns the draft's acceptance and costs)
        sizer.observe(block, v.learned(kept, done), time.perf_counter() - t0)
    if done:
        return seq.out.finish
    seq.pos = pos + len(kept)
    if seq.on_commit is not None:
        seq.on_commit(seq.pos, verify.logits[kept[-1]])
    return None


def block_room(pipe, seq) -> int:
    """The most rows ``seq``'s next verify block may take: its tokens left, the context's
    room after its position (a block of B rows commits up to B tokens, the last at pos + B,
    which must lie inside the context as plain decoding's last token does), the pipeline's
    limit on a speculative forward at its position (Pipeline.spec_room)."""
    return min(seq.req.max_tokens - len(seq.out.tokens), pipe.max_ctx - seq.pos - 1, pipe.spec_room(seq.pos))


def lookup_drafts(proposer: Proposer, seq, room: int) -> list[int]:
    """``seq``'s prompt-lookup drafts for its next step (spec.lookup): up to the proposer's
    lookup depth (within ``room - 1``) tokens that followed the latest earlier occurrence of
    its last few tokens; [] when lookups are off, the request does not speculate, nothing
    matches or its lookups stopped paying. Verified by exact match, like greedy drafts."""
    depth = min(proposer.lookup_depth, room - 1)
    if depth < 1 or not seq.req.speculate:
        return []
    if seq.lookup is None:
        seq.lookup = LookupUse()
    use, store = seq.lookup, proposer.lookup_store
    from_store = store is not None and use.pays("store")
    if not use.paying and not from_store:
        return []
    use.index.sync(seq.prompt, seq.out.tokens)
    use.source = "own"
    drafts = use.index.propose(depth) if use.paying else []
    if not drafts and from_store:   # none in its own context: earlier requests'
        use.source = "store"
        drafts = store.propose(use.index.tokens[-LookupStore.N_MAX:], depth)
    return drafts


def draft_block(proposer: Proposer, seq, block: int) -> tuple[list[int], torch.Tensor | None]:
    """(drafts, q): the ``block - 1`` draft tokens after ``seq``'s anchor (its draft slot
    selected). Greedy: the draft's argmax, kept where it equals the target's; sampled:
    tokens drawn from the draft's distribution q, kept by rejection sampling against the
    target's p (q None where drafts are kept by equality)."""
    if proposer.rejection_sampling(seq.req.sampling):
        return proposer.propose_sampled(seq.last, seq.pos, block, seq.req.sampling, seq.sampler.generator)
    return proposer.propose(seq.last, seq.pos, block), None


def accept_block(seq, logits, drafts: list[int], q) -> tuple[int, bool]:
    """Commit the target's tokens of a verify block ``[anchor] + drafts`` (``logits``: its
    rows' logits): token i, then on while draft i was kept. Returns (drafts accepted,
    whether the sequence finished)."""
    block = len(drafts) + 1
    acc, done = 0, False
    for i in range(block):
        if q is not None and i < block - 1 and not seq.think.would_force():
            done, kept = seq.commit_draft(logits[i], drafts[i], q[i])
        else:
            done = seq.commit(logits[i])
            kept = i < block - 1 and drafts[i] == seq.last
        if done or i == block - 1 or not kept:
            break
        acc += 1
    return acc, done


def batch_blocks(pipe, proposer: Proposer, seqs: list) -> list[int]:
    """The verify block of each of ``seqs`` for one batched step (1: a plain decode row):
    the batch sizer's joint choice, or the proposer's block, within each sequence's tokens
    left and the context's room."""
    caps = [max(1, min(proposer.block_size if s.req.speculate else 1, block_room(pipe, s))) for s in seqs]
    if proposer.batch_sizer is None:
        return caps
    return proposer.batch_sizer.choose([s.id for s in seqs], caps)


def tree_step(pipe, proposer: Proposer, seq) -> str | None:
    """One DDTree step (spec.ddtree): draft once, build the best-first tree, verify
    ``[anchor, nodes]`` in one tree-masked forward, then walk from the root committing the
    target's token at each node (``seq.commit``: greedy, or one seeded draw per token) while
    it is a child of that node. The path's rows stay in the caches (KV moved down, recurrent
    state of its last row); the token that left the tree is the next anchor. The budget is
    the proposer's, or the adaptive sizer's choice (0: a plain decode step). With prompt
    lookup on, where the context repeats, the lookup's chain is grafted onto the tree as a
    path from the root (``ddtree.graft``; on its own where the budget is 0), as a chain step
    verifies it instead of the draft's block; the sizer learns only from steps without."""
    sizer = proposer.sizer
    spec_begin(proposer, seq)
    anchor, pos = seq.last, seq.pos
    # depth: at most the draft's block, the tokens left, the room in the context and what a
    # speculative forward here may commit (Pipeline.spec_room)
    room = min(seq.req.max_tokens - len(seq.out.tokens), pipe.max_ctx - pos - 1, pipe.spec_room(pos))
    block = min(proposer.block_size, room)
    if block < 1:
        return "length"
    chosen = sizer.choose() if sizer is not None else proposer.tree_budget
    budget = min(chosen, pipe.max_ctx - pos - 1, pipe.max_spec_rows - 1) if block > 1 else 0
    look = lookup_drafts(proposer, seq, min(room, pipe.max_spec_rows - budget))
    t0 = time.perf_counter()
    if budget == 0 and not look:   # a plain step: nothing to roll back, its features wait for the next draft
        out = pipe.forward([anchor], pos, logits="all", capture=proposer.taps)
        done = seq.commit(out.logits[0])
        proposer.add_context(out.captures, pos, 1, defer=True)
        seq.spec.record(0, 0)
        path, logits = [0], out.logits[0]
    else:
        tree = proposer.propose_tree(anchor, pos, block, budget) if budget > 0 else chain_tree([])
        if look:
            tree = graft(tree, look)[0]
        pipe.checkpoint()
        verify = pipe.forward([anchor] + tree.tokens, pos, logits="all", capture=proposer.taps, tree=tree.parents)
        v = RowsVerify(seq, tree.tokens, tree=tree, size=budget, looked=tuple(look))
        path, done = v.accept(verify.logits)
        v.keep(pipe, proposer, path, verify.captures)
        v.record(path, done)
        logits = verify.logits[path[-1]]
    if sizer is not None and not look:
        sizer.observe(chosen, None if done else len(path), time.perf_counter() - t0)
    if done:
        return seq.out.finish
    seq.pos = pos + len(path)
    if seq.on_commit is not None:
        seq.on_commit(seq.pos, logits)
    return None


def speculative_rows(pipe, proposer: Proposer, seqs: list, select) -> list[tuple]:
    """One batched step of several sequences (continuous batching): the drafting ones draft
    in one draft pass, every sequence's rows (a chain block, a DDTree where the proposer
    verifies trees, or a plain decode row) are verified in one ``forward_rows`` (a slot's rows
    at consecutive positions, its slot checkpointed), then each sequence commits and keeps its
    rows on its own, as ``speculative_step`` / ``tree_step`` do alone. Sizes: the batch
    sizer's joint choice (``batch_blocks``, ``tree_budgets``).
    ``select(seq)`` points the pipeline and the draft at ``seq``'s slot. Needs
    ``proposer.batch_verify(pipe)``. Returns (seq, outcome) per sequence: None to go on, a
    finish reason, or the exception that failed it (a failed forward fails every sequence in
    it)."""
    out_of: list[tuple] = []
    for seq in seqs:
        select(seq)
        spec_begin(proposer, seq)
    trees = proposer.uses_tree(pipe)
    if trees:
        depths, sizes = tree_budgets(pipe, proposer, seqs)
        ahead = [(s.lane, s.last, s.pos, d) for s, d, b in zip(seqs, depths, sizes) if b > 0]
    else:   # (no prompt lookups in a batch: spec.lookup)
        sizes = depths = batch_blocks(pipe, proposer, seqs)
        ahead = [(s.lane, s.last, s.pos, b) for s, b in zip(seqs, sizes) if b > 1]
    t0 = time.perf_counter()
    try:             # one draft pass for every drafting sequence
        proposer.draft_ahead(ahead)
    except Exception:  # noqa: BLE001 - each sequence then drafts on its own (and fails alone)
        proposer.draft_ahead([])
    batch: list[RowsVerify] = []
    for seq, depth, size in zip(seqs, depths, sizes):
        select(seq)
        try:
            if not trees:
                drafts, q = draft_block(proposer, seq, size)
                v = RowsVerify(seq, drafts, q, size=size)
            else:
                tree = proposer.propose_tree(seq.last, seq.pos, depth, size) if size > 0 else None
                v = RowsVerify(seq, tree.tokens, tree=tree, size=size) if tree is not None and tree.tokens \
                    else RowsVerify(seq, [], size=0)
            if v.rows > 1:
                pipe.checkpoint()
        except Exception as e:  # noqa: BLE001 - this sequence fails, the others go on
            out_of.append((seq, e))
            continue
        batch.append(v)
    proposer.draft_ahead([])
    if not batch:
        return out_of
    tokens, lanes, positions, parents = [], [], [], {}
    for v in batch:
        tokens += [v.seq.last] + v.drafts
        lanes += [v.seq.lane] * v.rows
        positions += range(v.seq.pos, v.seq.pos + v.rows)
        if v.tree is not None:
            parents[v.seq.lane] = tuple(v.tree.parents)
    try:
        verify = pipe.forward_rows(tokens, lanes, positions, capture=proposer.taps,
                                   **({"trees": parents} if parents else {}))
    except Exception as e:  # noqa: BLE001 - the rows of this forward fail
        for v in batch:
            _drop_checkpoint(pipe, select, v.seq, v.rows > 1)
            out_of.append((v.seq, e))
        return out_of
    sizer, row = proposer.sizer, 0
    for v in batch:
        seq, n = v.seq, v.rows
        logits = verify.logits[row:row + n]
        caps = {c: x[:, row:row + n] for c, x in verify.captures.items()}
        row += n
        select(seq)
        try:
            kept, done = v.accept(logits)
        except Exception as e:  # noqa: BLE001 - e.g. its grammar's: this sequence fails
            _drop_checkpoint(pipe, select, seq, n > 1)
            out_of.append((seq, e))
            continue
        try:
            v.keep(pipe, proposer, kept, caps)
            v.record(kept, done)
            if sizer is not None:
                sizer.select(seq.id)
                sizer.learn(v.size, v.learned(kept, done))
            if done:
                out_of.append((seq, seq.out.finish))
                continue
            seq.pos += len(kept)
            if seq.on_commit is not None:
                seq.on_commit(seq.pos, logits[kept[-1]])
        except Exception as e:  # noqa: BLE001
            out_of.append((seq, e))
            continue
        out_of.append((seq, None))
    if proposer.batch_sizer is not None:   # the whole step: drafts, forward, commits, context
        proposer.batch_sizer.observe(row, time.perf_counter() - t0, len(seqs))
    return out_of


def tree_budgets(pipe, proposer: Proposer, seqs: list) -> tuple[list[int], list[int]]:
    """(depths, budgets) of ``seqs``' DDTrees for one batched step: each tree at most the
    draft's block deep (within the tokens left), budget 0 (a plain decode row) where it
    cannot draft; the batch sizer's joint choice (adaptive), else the proposer's budget."""
    depths, caps = [], []
    for s in seqs:
        depth = max(1, min(proposer.block_size, s.req.max_tokens - len(s.out.tokens), pipe.max_ctx - s.pos - 1,
                           pipe.spec_room(s.pos)))
        room = min(proposer.tree_budget, pipe.max_ctx - s.pos - 1, pipe.max_spec_rows - 1)
        depths.append(depth)
        caps.append(max(0, room) if s.req.speculate and depth > 1 else 0)
    if proposer.batch_sizer is None:
        return depths, caps
    return depths, [b - 1 for b in proposer.batch_sizer.choose([s.id for s in seqs], [c + 1 for c in caps])]


def _drop_checkpoint(pipe, select, seq, checkpointed: bool) -> None:
    """After a failure: back to the position before ``seq``'s block (its slot is freed next)."""
    if checkpointed:
        try:
            select(seq)
            pipe.rollback(seq.pos)
        except Exception:  # noqa: BLE001 - the sequence fails anyway; its slot resets on reuse
            pass
