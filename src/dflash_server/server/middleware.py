"""The ASGI gate in front of every route: request metrics, the Host name (DNS rebinding),
API key, Content-Type of POST bodies (a web page cannot send ``application/json`` to
another origin without a CORS preflight, which this server refuses unless ``--cors``),
body size, and a last line of defence that turns any unhandled exception into a JSON 500."""
from __future__ import annotations

import json
import logging

from .auth import PUBLIC_PATHS, authorized
from .errors import APIError, error_body, is_anthropic_path
from .hosts import HostPolicy

log = logging.getLogger("dflash_server.http")

ROUTES = frozenset({"/", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                    "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/v1/models", "/health", "/props",
                    "/metrics", "/slots"})


async def send_error(send, err: APIError, path: str) -> None:
    body = json.dumps(error_body(err, is_anthropic_path(path))).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def media_type(value: bytes | None) -> str:
    return (value or b"").split(b";", 1)[0].strip().lower().decode("latin-1")


class Gate:
    def __init__(self, app, state):
        self.app, self.state = app, state
        self.hosts = HostPolicy(state.config.host, state.config.allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        for prefix in ("/v1/models/", "/v1/responses/"):
            if path.startswith(prefix) and len(path) > len(prefix):
                route = prefix + "{id}"
        status = {"code": 500, "started": False}

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        cfg = self.state.config
        headers = dict(scope.get("headers") or [])
        try:
            host = headers.get(b"host")
            if not self.hosts.allows(None if host is None else host.decode("latin-1")):
                name = host.decode("latin-1")[:100]
                await send_error(send_wrapped, APIError(403, f"host {name!r} is not allowed; start the server with "
                                                        "--allowed-hosts NAME to accept it"), path)
                return
            # only a real CORS preflight (which browsers send without credentials) skips the key
            preflight = (scope["method"] == "OPTIONS" and bool(cfg.cors_origins) and b"origin" in headers
                         and b"access-control-request-method" in headers)
            if not preflight and path not in PUBLIC_PATHS and not authorized(headers, cfg.api_key):
                await send_error(send_wrapped, APIError(401, "invalid or missing API key"), path)
                return
            if scope["method"] == "POST" and media_type(headers.get(b"content-type")) != "application/json":
                got = media_type(headers.get(b"content-type")) or "none"
                await send_error(send_wrapped, APIError(415, f"Content-Type must be application/json, got {got[:100]} "
                                                        "(with curl: -H 'Content-Type: application/json')"), path)
                return
            length = headers.get(b"content-length")
            if length is not None:
                if not length.isdigit():
                    await send_error(send_wrapped, APIError(400, "bad Content-Length header"), path)
                    return
                if int(length) > cfg.max_body_bytes:
                    await send_error(send_wrapped, APIError(
                        413, f"request body of {int(length)} bytes exceeds the limit of {cfg.max_body_bytes}"), path)
                    return
            await self.app(scope, receive, send_wrapped)
        except Exception:  # noqa: BLE001 - never let a request take the server down
            log.exception("unhandled error on %s", path)
            if not status["started"]:
                await send_error(send_wrapped, APIError(500, "internal server error"), path)
        finally:
            self.state.metrics.requests.labels(route, str(status["code"])).inc()
