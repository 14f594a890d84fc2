"""GET /props: what this server runs and can do (model, runtime, placement, speculative
decoding, cache, capabilities, limits, live status)."""
from __future__ import annotations

from .errors import redact_paths
from .middleware import ROUTES
from .reasoning import EFFORT_BUDGETS

PROPS_SCHEMA = 1


def _speculative(engine) -> dict:
    """What the engine exposes about its draft (attributes read defensively: the engine
    evolves independently of this endpoint)."""
    proposer = getattr(engine, "proposer", None)
    if proposer is None:
        return {"enabled": False}
    out = {"enabled": True, "method": "dflash"}
    for key in ("block_size", "taps"):
        v = getattr(proposer, key, None)
        if isinstance(v, (int, str)) or (isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v)):
            out[key] = list(v) if isinstance(v, tuple) else v
    vocab = getattr(proposer, "vocab", None)
    # tokens the draft can propose (null: the whole vocabulary)
    out["draft_vocab_size"] = int(vocab.numel()) if hasattr(vocab, "numel") else None
    sizer = getattr(proposer, "sizer", None)
    out["adaptive_block_size"] = sizer is not None
    if sizer is not None:
        out["block_sizer"] = sizer.to_dict()
    return out


def _cache(engine) -> dict:
    index = getattr(getattr(engine, "prefix_cache", None), "index", None)
    prefix = {"enabled": bool(getattr(index, "enabled", False))}
    for key in ("max_slots", "max_bytes", "total_bytes", "hits", "misses", "evictions", "tokens_saved"):
        v = getattr(index, key, None)
        if isinstance(v, int):
            prefix[key] = v
    disk = getattr(getattr(engine, "prefix_cache", None), "disk", None)
    disk_stats = {"enabled": disk is not None}
    if disk is not None:
        disk_stats.update({k: v for k, v in disk.stats().items() if isinstance(v, (int, str))})
    return {"prefix": prefix, "disk": disk_stats}


def _kvflash(engine) -> dict:
    """Pool size, residency and paging counters per stage (empty list: KV Flash off)."""
    pipe = getattr(engine, "pipeline", None)
    stats = pipe.kvflash_stats() if hasattr(pipe, "kvflash_stats") else []
    return {"enabled": bool(stats), "stages": stats}


def _shards(engine) -> list[dict]:
    """Live status of shard workers (remote stages): status, pid, restarts."""
    out = []
    for st in getattr(getattr(engine, "pipeline", None), "stages", []):
        if hasattr(st, "health"):
            h = st.health()
            out.append({k: h.get(k) for k in ("status", "error", "restarts", "pid")} |
                       {"layers": [st.begin, st.end]})
    return out


def _engine_stats(engine) -> dict | None:
    stats = getattr(engine, "stats", None)
    try:
        return stats() if stats is not None else None
    except Exception:  # noqa: BLE001 - introspection must never fail the endpoint
        return None


def _slots_summary(engine) -> dict:
    st = _engine_stats(engine)
    if st is None:
        return {}
    return {k: st[k] for k in ("slots_total", "slots_busy", "waiting", "running", "prefilling", "step_tokens")}


def slots(state) -> list[dict]:
    """``GET /slots`` in llama-server's shape (a list, one object per slot: id, n_ctx,
    is_processing, id_task) plus this server's state / token counts."""
    st = _engine_stats(state.engine) if state.status == "ready" else None
    if st is None:
        return []
    n_ctx = state.info.get("max_ctx")
    out = []
    for s in st["slots"]:
        busy = s["state"] != "idle"
        out.append({"id": s["id"], "id_task": s.get("seq", -1) if busy else -1, "n_ctx": n_ctx,
                    "is_processing": busy, "state": s["state"], "n_prompt_tokens": s.get("n_prompt_tokens", 0),
                    "n_decoded": s.get("n_decoded", 0)})
    return out


def props(state) -> dict:
    cfg, info = state.config, state.info
    out = {
        "props_schema": PROPS_SCHEMA,
        "status": state.status,
        "model": {"id": cfg.model_name, "aliases": list(cfg.model_aliases), **info.get("model", {})},
        "runtime": info.get("runtime", {}),
        "placement": info.get("placement", []),
        "limits": {"max_queue": cfg.max_queue, "max_body_bytes": cfg.max_body_bytes,
                   "default_max_tokens": cfg.default_max_tokens, "max_ctx": info.get("max_ctx")},
        # what a request that sets no sampling field gets, and where each value comes from
        "default_generation_settings": {**state.sampling_defaults, "sources": dict(state.sampling_sources),
                                        "max_tokens": cfg.default_max_tokens, "n_ctx": info.get("max_ctx")},
        "api": {"endpoints": sorted(ROUTES), "auth": cfg.api_key is not None, "cors": bool(cfg.cors_origins)},
    }
    if state.status != "ready":
        return _redacted(out, cfg)
    try:
        spec, cache = _speculative(state.engine), _cache(state.engine)
    except Exception:  # noqa: BLE001 - introspection must never fail the endpoint
        spec, cache = {"enabled": None}, {}
    prompts = state.prompts
    out.update({
        "speculative": spec,
        "cache": cache,
        "capabilities": {
            "chat_template": bool(prompts.template),
            "chat_template_source": "file" if cfg.chat_template is not None else "model",
            "tools": True, "tools_in_template": prompts.template_tools, "tool_format": prompts.tool_format,
            "tool_choice": ["auto", "none", "required", "function"],
            "reasoning": state.think is not None or "<think>" in (prompts.template or ""),
            "reasoning_budget": state.think is not None,
            "reasoning_efforts": {k: v for k, v in EFFORT_BUDGETS.items()},
            "logprobs": True, "max_top_logprobs": 20, "max_n": 8, "max_stop": 4, "streaming": True,
        },
        "queue": {"waiting": state.scheduler.queue_depth, "running": state.scheduler.running},
        "slots": _slots_summary(state.engine),
        "shards": _shards(state.engine),
        "kvflash": _kvflash(state.engine),
    })
    return _redacted(out, cfg)


def _redacted(out: dict, cfg) -> dict:
    """Without an API key nobody who reads /props was authenticated: no file or socket
    paths then (with a key, the operator sees them)."""
    if cfg.api_key is not None:
        return out
    model = out.get("model", {})
    if isinstance(model.get("path"), str):
        model["path"] = redact_paths(model["path"])
    disk = out.get("cache", {}).get("disk", {})
    if isinstance(disk.get("dir"), str):
        disk["dir"] = redact_paths(disk["dir"])
    for shard in out.get("shards", []):
        shard["error"] = redact_paths(shard.get("error"))
    return out

