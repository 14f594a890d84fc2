"""Model fingerprint for the disk cache: snapshots are only valid for the exact model
configuration that wrote them (weights, dtype, placement, context size, quantization,
chat template, draft)."""
from __future__ import annotations

import hashlib
import json


def fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def text_hash(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:16]
