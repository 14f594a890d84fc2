"""DDTree: a tree of drafts from one DFlash pass, verified in one target forward.

The draft gives a distribution per position after the anchor (depths 1..L). Instead of its
argmax chain, a best-first search builds the ``budget`` most likely paths' nodes (Ringel and
Romano, "Accelerating Speculative Decoding with Block Diffusion Draft Trees", the
``build_ddtree_tree`` heap search): from the root push the first child (depth 1, rank 0);
pop the entry of highest cumulative log-probability, make its node, then push its next
sibling (same parent, next rank at that depth) and its first child (next depth, rank 0).
The product of per-position draft probabilities is the surrogate for a path's chance of
being accepted. Nodes are numbered in the order they are made, so a parent always precedes
its children (what the tree-masked forward and the native attention step require).

The target verifies ``[anchor, nodes...]`` with each row seeing the cached prefix and its
ancestors at position start + depth (``Pipeline.forward(tree=...)``); the walk then follows
the target's own choices from the root while they are children of the current node. Every
emitted token is the target's choice given the tokens before it, so the output is plain
decoding's whatever the tree (greedy, and seeded sampling with one draw per token).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: list[int]        # the node tokens (rows 1..n of the verify; row 0 is the anchor)
    parents: tuple[int, ...]  # parent row of each verify row, -1 for the anchor
    depth: int               # the deepest node's depth

    def children(self) -> list[dict[int, int]]:
        """Per verify row: child token -> child row."""
        out: list[dict[int, int]] = [{} for _ in self.parents]
        for row, (tok, p) in enumerate(zip(self.tokens, self.parents[1:]), start=1):
            out[p].setdefault(tok, row)
        return out


def build_tree(logits: torch.Tensor, budget: int, row_ids: torch.Tensor | None = None) -> DraftTree:
    """The ``budget``-node best-first tree of ``logits`` (L, V): the draft's logits at depths
    1..L. ``row_ids``: the token of each logit column when the draft has its own vocabulary."""
    L = logits.shape[0]
    if L < 1 or budget < 1:
        return DraftTree([], (-1,), 0)
    k = min(budget, logits.shape[-1])
    logp, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    logp, ids = logp.cpu(), ids.cpu()   # (the draft may run on a GPU; its vocabulary map stays on the CPU)
    if row_ids is not None:
        ids = row_ids.cpu()[ids]
    logp, ids = logp.tolist(), ids.tolist()
    tokens: list[int] = []
    parents: list[int] = [-1]
    depth_of = [0]
    # entries: (-score, tie, parent row, depth, rank); the tie counter keeps pops deterministic
    heap = [(-logp[0][0], 0, 0, 1, 0)]
    tie = 1
    while heap and len(tokens) < budget:
        neg, _, parent, d, rank = heapq.heappop(heap)
        tokens.append(ids[d - 1][rank])
        parents.append(parent)
        depth_of.append(d)
        row = len(tokens)
        if rank + 1 < k:  # the next sibling: same parent, next rank at this depth
            heapq.heappush(heap, (neg + logp[d - 1][rank] - logp[d - 1][rank + 1], tie, parent, d, rank + 1))
            tie += 1
        if d < L:         # the first child: one deeper, best rank
            heapq.heappush(heap, (neg - logp[d][0], tie, row, d + 1, 0))
            tie += 1
    return DraftTree(tokens, tuple(parents), max(depth_of))


def graft(tree: DraftTree, chain: list[int], limit: int | None = None) -> tuple[DraftTree, int]:
    """``tree`` with ``chain`` (e.g. a prompt lookup's drafts) as a path from the root: where
    the tree already holds the chain's next token under the current node it follows that node,
    else it appends one (at most ``limit`` new nodes, None: no limit; appended after every
    existing one, so a parent still precedes its children). Returns (the tree, nodes added)."""
    tokens, parents, children = list(tree.tokens), list(tree.parents), tree.children()
    row, depth, added = 0, 0, 0
    for tok in chain:
        nxt = children[row].get(tok)
        if nxt is None:
            if limit is not None and added >= limit:
                break
            tokens.append(tok)
            parents.append(row)
            children.append({})
            nxt = children[row][tok] = len(tokens)
            added += 1
        row, depth = nxt, depth + 1
    return DraftTree(tokens, tuple(parents), max(tree.depth, depth)), added


def chain_tree(tokens: list[int]) -> DraftTree:
    """A chain as a tree (each node the child of the one before)."""
    return DraftTree(list(tokens), (-1,) + tuple(range(len(tokens))), len(tokens))
