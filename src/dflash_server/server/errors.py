"""HTTP errors in each API's own JSON shape.

Handlers raise ``APIError``; the app turns it into ``{"error": {...}}`` (OpenAI) or
``{"type": "error", "error": {...}}`` (Anthropic) depending on which API the path belongs to.
Inside a started SSE stream the same payload goes out as an error event instead.
"""
from __future__ import annotations

import re

from pydantic import ValidationError

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: APIError, anthropic: bool) -> dict:
    oa_type, an_type = _TYPES.get(err.status, _TYPES[500] if err.status >= 500 else _TYPES[400])
    if anthropic:
        return {"type": "error", "error": {"type": an_type, "message": err.message}}
    return {"error": {"message": err.message, "type": oa_type, "param": err.param,
                      "code": err.code or str(err.status)}}


def from_validation(e: ValidationError, limit: int = 5) -> APIError:
    """A 400 naming the offending fields; never echoes (possibly huge) input values."""
    parts, first = [], None
    for err in e.errors(include_url=False, include_input=False)[:limit]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        first = first or loc or None
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    more = e.error_count() - limit
    if more > 0:
        parts.append(f"(+{more} more)")
    return APIError(400, "invalid request: " + "; ".join(parts), param=first)


_IPC = re.compile(r"ipc://[^\s'\"]+")
_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s'\"/,;:()]+/)*([^\s'\"/,;:()]*)")


def redact_paths(text: str | None) -> str | None:
    """File and socket paths out of a message for answers anyone may read (a path tells
    where the model and its worker live): ``/srv/models/m.gguf`` -> ``.../m.gguf``."""
    if text is None:
        return None
    text = _IPC.sub("ipc://...", text)
    return _PATH.sub(lambda m: ".../" + m.group(1) if m.group(1) else "...", text)
