"""The sampling settings a model ships with: ``generation_config.json`` beside a Hugging
Face checkpoint, ``general.sampling.*`` in a GGUF file. Values that are missing, of the
wrong type or out of range are left out (with a warning), never guessed."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger("dflash_server")

# field -> (HF generation_config key, GGUF key, type, low, high)
FIELDS = {
    "temperature": ("temperature", "general.sampling.temp", float, 0.0, 2.0),
    "top_k": ("top_k", "general.sampling.top_k", int, 0, 1_000_000),
    "top_p": ("top_p", "general.sampling.top_p", float, 1e-6, 1.0),
    "min_p": ("min_p", "general.sampling.min_p", float, 0.0, 1.0),
    "repetition_penalty": ("repetition_penalty", "general.sampling.penalty_repeat", float, 1e-6, 10.0),
}


def _valid(value, kind, low, high):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if kind is int and (not float(value).is_integer()):
        return None
    value = kind(value)
    return value if math.isfinite(value) and low <= value <= high else None


def sampling_defaults(path: Path, fmt: str, gguf_meta: dict | None = None) -> dict:
    """{field: value} for the fields the model sets (empty when it sets none)."""
    if fmt == "gguf":
        raw = {f: (gguf_meta or {}).get(spec[1]) for f, spec in FIELDS.items()}
        where = f"{path.name} metadata"
    else:
        cfg_path = Path(path) / "generation_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable (%s); sampling defaults do not come from it", cfg_path.name, e)
            cfg = {}
        cfg = cfg if isinstance(cfg, dict) else {}
        raw = {f: cfg.get(spec[0]) for f, spec in FIELDS.items()}
        where = "generation_config.json"
    out = {}
    for field, value in raw.items():
        if value is None:
            continue
        ok = _valid(value, *FIELDS[field][2:])
        if ok is None:
            log.warning("%s: ignoring %s = %r (not a valid value)", where, field, value)
        else:
            out[field] = ok
    return out
