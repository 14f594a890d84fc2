"""What the engine reports about its parts (``Engine.stats``): the draft, the prefix
caches, KV Flash, shard workers. The server's ``/props``, ``/slots`` and ``/metrics`` read
these sections and nothing else of the engine."""
from __future__ import annotations


def speculative(proposer) -> dict:
    if proposer is None:
        return {"enabled": False}
    out = {"enabled": True, "method": proposer.method, "block_size": int(proposer.block_size),
           "taps": [int(t) for t in proposer.taps]}
    vocab = proposer.vocab
    out["draft_vocab_size"] = int(vocab.numel()) if vocab is not None else None  # null: the whole vocabulary
    out["adaptive_block_size"] = proposer.sizer is not None
    # how sampled requests verify: rejection sampling, exact match, or auto (exact when seeded)
    out["sampled_verify"] = proposer.sampled_verify
    # DDTree: the node budget of each step's draft tree (0: chains); active where the
    # pipeline can verify trees (one sequence per forward)
    out["ddtree"] = {"budget": int(proposer.tree_budget), "active": bool(proposer.uses_tree(proposer.pipeline))}
    # prompt lookup (spec.lookup): drafts copied where the context repeats, up to this many a step
    out["lookup_depth"] = int(proposer.lookup_depth)
    # lookups across requests (--lookup-store): tokens held, proposals asked and found
    out["lookup_store"] = proposer.lookup_store.to_dict() if proposer.lookup_store is not None else None
    # several running sequences verify their blocks (or trees) in one target forward
    out["batch_verify"] = bool(proposer.batch_verify(proposer.pipeline))
    if proposer.sizer is not None:
        out["block_sizer"] = proposer.sizer.to_dict()
    if proposer.batch_sizer is not None:
        out["batch_sizer"] = proposer.batch_sizer.to_dict()
    return out


def cache(prefix_cache) -> dict:
    index, disk = prefix_cache.index, prefix_cache.disk
    prefix = {"enabled": bool(index.enabled), "slots": len(index.entries)}
    for key in ("max_slots", "max_bytes", "total_bytes", "hits", "misses", "evictions", "tokens_saved"):
        v = getattr(index, key)
        if isinstance(v, int):
            prefix[key] = v
    disk_stats = {"enabled": disk is not None}
    if disk is not None:
        disk_stats.update({k: v for k, v in disk.stats().items() if isinstance(v, (int, str))})
    return {"prefix": prefix, "disk": disk_stats}


def kvflash(pipeline) -> dict:
    """Pool size, residency and paging counters per stage (an empty list: KV Flash off)."""
    stats = pipeline.kvflash_stats()
    return {"enabled": bool(stats), "stages": stats}


def shards(pipeline) -> list[dict]:
    """Live status of shard workers (remote stages): status, pid, restarts, layers."""
    out = []
    for st in pipeline.stages:
        if st.is_remote:
            h = st.health()
            out.append({k: h.get(k) for k in ("status", "error", "restarts", "pid")} | {"layers": [st.begin, st.end]})
    return out


def pflash(compressor, policy) -> dict:
    """PFlash: the policy, the drafter and what it has done (compression ratio, drafter time)."""
    out = {"enabled": compressor is not None}
    if policy is not None:
        out.update(policy.describe())
    if compressor is not None:
        out.update(compressor.stats())
    return out
