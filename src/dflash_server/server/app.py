"""The FastAPI application: routes, error shapes, and the middleware stack."""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from anyio import to_thread
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import protocol_anthropic, protocol_completions, protocol_openai, protocol_responses
from .errors import APIError, error_body, is_anthropic_path, redact_paths
from .metrics import CONTENT_TYPE_LATEST
from .middleware import Gate
from .props import props, slots
from .schemas_common import Model
from .schemas_openai import Message, hf_messages
from .sse import ClientGone

log = logging.getLogger("dflash_server")


class TokenizeRequest(Model):
    content: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special: bool | None = None


class DetokenizeRequest(Model):
    tokens: list[int]


def _error_response(err: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(err, is_anthropic_path(path)), status_code=err.status, headers=err.headers)


def _chat_page() -> tuple[bytes, dict[str, str]]:
    """The chat page (``static/chat.html``) and its headers: a content security policy that
    allows its own inline script (by hash) and requests to this origin only."""
    import base64
    import hashlib
    import re
    from importlib import resources

    html = resources.files(__package__).joinpath("static/chat.html").read_bytes()
    script = re.search(rb"<script>(.*?)</script>", html, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; connect-src 'self'; "
           "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                  "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


CHAT_PAGE, CHAT_PAGE_HEADERS = _chat_page()


def create_app(state, on_shutdown=None):
    """ASGI app over ``state`` (a ServerState); ``on_shutdown`` runs after the server
    stopped taking requests (in-flight ones have finished or were cancelled)."""
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    api = FastAPI(title="dflash-server", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @api.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc, request.url.path)

    @api.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = "unknown route" if exc.status_code == 404 else str(exc.detail)
        resp = _error_response(APIError(exc.status_code, f"{msg}: {request.method} {request.url.path}"),
                               request.url.path)
        if exc.headers and "allow" in {k.lower() for k in exc.headers}:   # a 405 names the methods
            resp.headers["Allow"] = next(v for k, v in exc.headers.items() if k.lower() == "allow")
        return resp

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # a bug, not a bad request: JSON in the API's shape (the Gate logs the traceback)
        return _error_response(APIError(500, f"internal server error ({type(exc).__name__})"), request.url.path)

    @api.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _error_response(APIError(400, "invalid request"), request.url.path)

    # --- generation --------------------------------------------------------------------------
    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        return await protocol_openai.handle(state, request)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await protocol_completions.handle(state, request)

    @api.post("/v1/responses")
    async def responses(request: Request):
        return await protocol_responses.handle(state, request)

    @api.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])  # one route: a 405 names both
    async def stored_response(request: Request, response_id: str):
        if request.method == "DELETE":
            return await protocol_responses.delete(state, response_id)
        return await protocol_responses.get(state, response_id)

    @api.post("/v1/messages")
    async def messages(request: Request):
        return await protocol_anthropic.handle(state, request)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await protocol_anthropic.count_tokens(state, request)

    # --- tokens --------------------------------------------------------------------------------
    @api.post("/tokenize")
    async def tokenize(request: Request):
        body = await state.parse(request, TokenizeRequest)
        if body.messages:
            ids = (await state.render_chat(hf_messages(body.messages))).ids
        else:
            text = body.content if body.content is not None else (body.prompt or "")
            ids = await state.encode(text, add_bos=body.add_special)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.service.max_ctx}

    @api.post("/detokenize")
    async def detokenize(request: Request):
        body = await state.parse(request, DetokenizeRequest, prompt_sized=False)  # ids, not text

        def decode(ids: list[int]) -> str:  # millions of ids fit in a body: off the event loop
            vocab = state.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
            return state.tokenizer.decode_long(ids)  # in pieces: /health stays responsive
        text = await to_thread.run_sync(decode, body.tokens)
        return {"content": text, "prompt": text}

    # --- introspection -------------------------------------------------------------------------
    def model_card(name: str | None = None):
        return {"id": name or state.config.model_name, "object": "model", "created": created, "owned_by": "dflash-server",
                "context_length": state.info.get("max_ctx"), "max_model_len": state.info.get("max_ctx")}

    @api.get("/v1/models")
    async def models(request: Request):
        out = {"object": "list", "data": [model_card()]}
        if "client_version" in request.query_params:  # Codex asks for its own model catalogue
            out["models"] = [codex_card()]
        return out

    def codex_card():
        levels = [{"effort": e, "description": f"{e} reasoning"} for e in ("low", "medium", "high")]
        return {"slug": state.config.model_name, "display_name": state.config.model_name,
                "description": "served by dflash-server", "default_reasoning_level": "medium",
                "supported_reasoning_levels": levels, "shell_type": "shell_command", "visibility": "list",
                "supported_in_api": True, "priority": 1, "context_window": state.info.get("max_ctx"),
                "supports_reasoning_summaries": False, "supports_parallel_tool_calls": True}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if not model_id or not state.config.accepts_model(model_id):   # (a --model-alias name too)
            raise APIError(404, f"model {model_id!r} not found", param="model", code="model_not_found")
        return model_card(model_id)

    @api.api_route("/", methods=["GET", "HEAD"])
    async def chat_page():
        # public: the page holds no secret (the key is typed into it and stays in the tab);
        # its one inline script is the only script the policy lets run
        return Response(CHAT_PAGE, media_type="text/html; charset=utf-8", headers=CHAT_PAGE_HEADERS)

    @api.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        # public (no API key): nothing here names a file or socket path
        code = {"ready": 200, "loading": 503}.get(state.status, 500)
        body = {"status": "ok" if code == 200 else state.status}
        if state.error:
            body["error"] = redact_paths(state.error)
        if code == 200 and state.engine is not None:
            h = state.engine.health()
            if h.get("status") != "ok":  # a shard worker is restarting: requests fail meanwhile
                code, body = 503, {"status": "degraded", "error": redact_paths(h.get("error"))}
        return JSONResponse(body, status_code=code)

    @api.get("/props")
    async def get_props():
        return props(state)

    @api.get("/slots")
    async def get_slots():
        return slots(state)

    @api.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    asgi = Gate(api, state)
    if state.config.cors_origins:
        asgi = CORSMiddleware(asgi, allow_origins=list(state.config.cors_origins), allow_methods=["GET", "POST", "DELETE"],
                              allow_headers=["*"], max_age=600)
    return asgi
