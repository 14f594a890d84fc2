"""API-key check (``Authorization: Bearer KEY`` or ``x-api-key: KEY``), constant time."""
from __future__ import annotations

import hmac

PUBLIC_PATHS = frozenset({"/health", "/"})  # "/": the chat page (static; its calls carry the key)


def presented_key(headers: dict[bytes, bytes]) -> bytes | None:
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, value = auth.partition(b" ")
        if scheme.lower() == b"bearer":
            return value.strip()
    return headers.get(b"x-api-key")


def authorized(headers: dict[bytes, bytes], api_key: str | None) -> bool:
    if api_key is None:
        return True
    got = presented_key(headers)
    # compare_digest on equal-length digests: no timing signal about the key or its length
    return got is not None and hmac.compare_digest(
        hmac.new(b"dflash", got, "sha256").digest(), hmac.new(b"dflash", api_key.encode(), "sha256").digest())
