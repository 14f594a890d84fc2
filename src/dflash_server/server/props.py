"""GET /props: what this server runs and can do (model, runtime, placement, speculative
decoding, cache, capabilities, limits, live status)."""
from __future__ import annotations

from .errors import redact_paths
from .middleware import ROUTES
from .reasoning import EFFORT_BUDGETS

PROPS_SCHEMA = 1


def _engine_stats(engine) -> dict | None:
    """``Engine.stats()``: all these endpoints read of the engine (None when it has none,
    or when it fails: introspection must never fail the endpoint)."""
    try:
        return engine.stats() if engine is not None else None
    except Exception:  # noqa: BLE001
        return None


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
    st = _engine_stats(state.engine) or {}
    prompts = state.prompts
    out.update({
        "speculative": st.get("speculative", {"enabled": None}),
        "cache": st.get("cache", {}),
        "capabilities": {
            "chat_template": bool(prompts.template),
            "chat_template_source": "file" if cfg.chat_template is not None else "model",
            "tools": True, "tools_in_template": prompts.template_tools, "tool_format": prompts.tool_format,
            "tool_choice": ["auto", "none", "required", "function"],
            "reasoning": state.think is not None or "<think>" in (prompts.template or ""),
            "reasoning_budget": state.think is not None,
            "reasoning_efforts": {k: v for k, v in EFFORT_BUDGETS.items()},
            "logprobs": True, "max_top_logprobs": 20, "max_n": 8, "max_stop": 4, "streaming": True,
            # grammar-constrained output (llguidance): response_format / text.format /
            # output_config.format, and forced tool calls (tool_choice required / named)
            "structured_output": ["json_object", "json_schema"] if st.get("grammar") else [],
        },
        "queue": {"waiting": state.scheduler.queue_depth, "running": state.scheduler.running},
        "slots": {k: st[k] for k in ("slots_total", "slots_busy", "waiting", "running", "prefilling",
                                     "step_tokens") if k in st},
        "shards": st.get("shards", []),
        "kvflash": st.get("kvflash", {"enabled": False, "stages": []}),
        "pflash": {**st.get("pflash", {"enabled": False}), "sessions": len(state.service.bandit)},
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
    pf = out.get("pflash", {})
    if isinstance(pf.get("drafter"), str):
        pf["drafter"] = redact_paths(pf["drafter"])
    return out

