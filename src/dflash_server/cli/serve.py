"""``dflash-server serve``: the OpenAI- and Anthropic-compatible HTTP server.

The socket opens at once (``/health`` answers 503 while the weights load in a background
thread, then 200). SIGTERM / Ctrl-C: stop accepting, give in-flight requests
``--shutdown-grace`` seconds, cancel the rest, exit 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from ..errors import UserError
from .common import add_model_args, cache_dtypes, positive_int, read_text_file

log = logging.getLogger("dflash_server")
MAX_CONNECTIONS = 2048  # open connections (and their tasks) at once; beyond: 503 (uvicorn limit_concurrency)


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def add_parser(sub) -> None:
    from ..server.config import ServerConfig as C

    p = sub.add_parser("serve", help="serve the OpenAI / Anthropic HTTP API")
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=C.host, help=f"bind address (default {C.host}: this machine only)")
    g.add_argument("--port", type=_non_negative_int, default=C.port, help=f"port (default {C.port})")
    g.add_argument("--model-name", help="model id served in /v1/models (default: the model's file or directory name)")
    g.add_argument("--model-alias", action="append", default=[],
                   help="another model name requests may use (repeatable; '*' accepts any name)")
    g.add_argument("--api-key", help="require this key (Authorization: Bearer KEY or x-api-key: KEY)")
    g.add_argument("--api-key-file", help="read the API key from this file (keeps it out of the process list)")
    g.add_argument("--cors", nargs="?", const="*", help="enable CORS for these comma-separated origins (no value: any)")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names to answer besides loopback ones ('.example.com': and its "
                        "subdomains; '*': any). Bound to loopback, other names are refused (DNS rebinding); "
                        "bound elsewhere, any name is accepted unless this lists them")
    g.add_argument("--chat-template-file", help="Jinja chat template to use instead of the model's own")
    g.add_argument("--default-max-tokens", type=positive_int, default=C.default_max_tokens,
                   help=f"max new tokens when a request sets none (default {C.default_max_tokens}; "
                        "clamped to what fits in the context)")
    for flag, kind, what in (("temperature", float, 0.8), ("top-p", float, 0.95), ("top-k", int, 40),
                             ("min-p", float, 0.05), ("repetition-penalty", float, 1.0)):
        g.add_argument(f"--default-{flag}", type=kind, help=f"{flag} when a request sets none (default: the "
                       f"model's generation_config.json / GGUF metadata, else llama.cpp's {what})")
    g.add_argument("--parallel", default="auto",
                   help="sequence slots: requests generated concurrently, batched into one forward per step "
                        "(continuous batching). 'auto' (default): up to 4, fewer when their KV would not fit "
                        "memory. Each slot holds its own KV (max-ctx tokens, or a KV Flash pool) and, with a "
                        "draft, its own draft context: a request decoding alone speculates, several decode "
                        "in one batched forward")
    g.add_argument("--step-tokens", type=positive_int, default=256,
                   help="tokens one engine step may forward while other requests decode: a long prompt is "
                        "prefilled in pieces of at most this many, between their steps (default 256)")
    g.add_argument("--max-queue", type=_non_negative_int, default=C.max_queue,
                   help="requests that may wait for a sequence slot; beyond: 503 + Retry-After "
                        f"(default {C.max_queue})")
    g.add_argument("--max-body-mb", type=positive_int, default=C.max_body_bytes >> 20,
                   help=f"largest request body in MiB (default {C.max_body_bytes >> 20})")
    g.add_argument("--shutdown-grace", type=float, default=C.shutdown_grace_s,
                   help=f"seconds in-flight requests get on shutdown (default {C.shutdown_grace_s:g})")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.set_defaults(func=run)


def _config(args):
    from ..server.config import ServerConfig
    from ..weights.chat_template import TemplateError, compile_template

    api_key = args.api_key
    if args.api_key_file:
        api_key = read_text_file(args.api_key_file, "--api-key-file", 1 << 20).strip()
    if api_key is not None and not api_key.strip():   # a blank key must not mean "no key" (fail closed)
        raise UserError(f"--api-key-file {args.api_key_file}: the file is empty" if args.api_key_file
                        else "--api-key: the key is empty")
    template = None
    if args.chat_template_file:
        template = read_text_file(args.chat_template_file, "--chat-template-file")
        try:
            compile_template(template)
        except TemplateError as e:
            raise UserError(f"--chat-template-file: {e}") from None
    name = args.model_name or (Path(args.model).name.removesuffix(".gguf") if args.model else "SmolLM2-135M-Instruct")
    cors = tuple(o.strip() for o in args.cors.split(",") if o.strip()) if args.cors else ()
    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    try:
        return ServerConfig(host=args.host, port=args.port, model_name=name, model_aliases=tuple(args.model_alias),
                            api_key=api_key, cors_origins=cors, allowed_hosts=hosts,
                            default_max_tokens=args.default_max_tokens, default_temperature=args.default_temperature,
                            default_top_p=args.default_top_p, default_top_k=args.default_top_k,
                            default_min_p=args.default_min_p,
                            default_repetition_penalty=args.default_repetition_penalty, max_queue=args.max_queue,
                            max_body_bytes=args.max_body_mb << 20, chat_template=template,
                            shutdown_grace_s=args.shutdown_grace)
    except ValueError as e:
        raise UserError(str(e)) from None


def _model_info(args, source, pipeline) -> dict:
    import torch

    from .. import kernels

    cfg = source.config
    return {
        "max_ctx": pipeline.max_ctx,
        "fingerprint": source.fingerprint(),
        "sampling": source.sampling_defaults(),
        "model": {"path": str(source.path), "format": source.format, "family": cfg.family,
                  "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                  "max_position_embeddings": cfg.max_position_embeddings},
        "runtime": {"backend": "torch", "torch": torch.__version__, "dtype": str(pipeline.stages[0].dtype),
                    "quantize": args.quantize, "compile": bool(args.compile), "chunk": args.chunk,
                    "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
                    "kernels": kernels.status(), "parallel": pipeline.lanes,
                    "kv_dtype": cache_dtypes(pipeline), "kv_bytes": pipeline.kv_bytes(),
                    "step_tokens": getattr(args, "step_tokens", None)},
        "placement": [{"device": st.label, "layers": [st.begin, st.end], "remote": st.is_remote}
                      for st in pipeline.stages],
    }


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server.app import create_app
    from ..server.hosts import is_loopback
    from ..server.state import ServerState
    from ..runtime import heap
    from .common import engine_config, load_engine

    config = _config(args)
    engine_cfg = engine_config(args)  # every flag checked before the port is bound
    if args.model and not Path(args.model).exists():
        raise UserError(f"{args.model}: no such file or directory")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(config.host) and config.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this address can use the model "
                    "and read /props and /metrics", config.host)
    state = ServerState(config)
    app = create_app(state, on_shutdown=lambda: state.close(cancel_running=True))
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # first signal: the scheduler finishes what it can within the grace period and
            # then cancels the rest, so every client gets a complete answer or an error
            if not self.should_exit:
                state.begin_shutdown()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                   access_log=args.access_log, timeout_graceful_shutdown=config.shutdown_grace_s + 5,
                                   lifespan="on", server_header=False,
                                   # a backstop for connections that never finish a request
                                   # (uvicorn has no deadline for a request's head): 503 beyond
                                   limit_concurrency=MAX_CONNECTIONS))
    outcome = {"code": 0}

    def load():
        t0 = time.monotonic()
        try:
            source, pipeline, engine = load_engine(engine_cfg, progress=False)
            if args.compile:  # compile now (minutes on a cold cache), not in the first request
                t1 = time.monotonic()
                engine.warm_up()
                log.info("compiled in %.1f s", time.monotonic() - t1)
            heap.settle()
            state.attach(engine, _model_info(args, source, pipeline))
            log.info("model %s ready in %.1f s (%s, context %d, speculative: %s)", config.model_name,
                     time.monotonic() - t0, source.path, pipeline.max_ctx,
                     "yes" if getattr(engine, "proposer", None) is not None else "no")
        except UserError as e:
            print(f"dflash-server: error: {e}", file=sys.stderr)
            state.fail(str(e))
            outcome["code"] = e.exit_code
            server.should_exit = True
        except Exception as e:  # noqa: BLE001 - report and stop; /health says why meanwhile
            log.exception("loading the model failed")
            state.fail(f"{type(e).__name__}: {e}")
            outcome["code"] = 1
            server.should_exit = True

    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then re-raises the signal to the
    # handler that was installed before it: make that one a no-op so a clean stop exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    threading.Thread(target=load, name="dflash-load", daemon=True).start()
    server.run()
    state.close(cancel_running=True)
    if outcome["code"] == 0 and server.started is False and state.status != "failed":
        return 1  # could not bind (uvicorn logged why)
    return outcome["code"]
