"""OpenAI (legacy) Completions: POST /v1/completions, raw prompts, no chat template."""
from __future__ import annotations

import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from . import sse
from .errors import APIError, error_body
from .generation import GenOptions, Run, stream_failure
from .logprobs import completion_logprobs
from .schemas_common import stop_list
from .schemas_openai import CompletionRequest


def _usage(groups: list[list[Run]]) -> dict:
    prompt = sum(g[0].result.prompt_tokens for g in groups)
    completion = sum(r.result.completion_tokens for g in groups for r in g)
    cached = sum(g[0].result.cached_tokens for g in groups)
    details = {"cached_tokens": cached}
    compressed = [g[0].result.extra.get("pflash") for g in groups]
    if any(compressed):   # with PFlash: the tokens the target read (the prompts it left whole count in full)
        details["compressed_tokens"] = sum(pf["compressed_tokens"] if pf else g[0].result.prompt_tokens
                                           for pf, g in zip(compressed, groups))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": details}


async def handle(app, request: Request):
    body = await app.parse(request, CompletionRequest)
    app.check_model(body.model)
    body.check_supported()
    n = body.n or 1
    opts = GenOptions(max_tokens=body.max_tokens, sampling=body.sampling(app.sampling_defaults),
                      stop=stop_list(body.stop, 4), logprobs=body.logprobs, ignore_eos=bool(body.ignore_eos),
                      parse_output=False, **body.engine_options())
    prompts = [await app.render_raw(p) for p in body.prompts()]
    for p in prompts:
        app.service.request(p, opts)  # admission for every prompt before anything is queued
    groups: list[list[Run]] = []
    try:
        for p in prompts:
            groups.append(await app.service.start(p, opts, n, label="completion"))
    except APIError:
        for g in groups:
            for r in g:
                r.cancel()
        raise
    runs = [r for g in groups for r in g]
    echo = [(p.text or app.tokenizer.decode(p.ids)) if body.echo else "" for p in prompts for _ in range(n)]
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
    model = body.model or app.config.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        body_iter = _stream(app, groups, runs, echo, cid, created, model, include_usage)
        return await sse.start_stream(request, runs, body_iter)
    lps = await sse.collect(request, runs)
    choices = []
    for i, (run, events) in enumerate(zip(runs, lps)):
        lp = completion_logprobs(events, app.token_texts, len(echo[i])) if body.logprobs is not None else None
        choices.append({"index": i, "text": echo[i] + run.content, "logprobs": lp,
                        "finish_reason": run.finish_reason})
    return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "system_fingerprint": app.fingerprint, "choices": choices, "usage": _usage(groups)})


async def _stream(app, groups, runs: list[Run], echo: list[str], cid, created, model, include_usage):
    base = {"id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": app.fingerprint}

    def chunk(index, text, finish=None, logprobs=None):
        return sse.data({**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": finish}]})

    try:
        for i, run in enumerate(runs):
            offset = len(echo[i])
            if echo[i]:
                yield chunk(i, echo[i])
            async for step in run:
                text = "".join(d.text for d in step.deltas)
                lp = None
                if run.opts.logprobs is not None:
                    lp = completion_logprobs(step.logprobs, app.token_texts, offset)
                    if not text and not step.logprobs:
                        continue
                elif not text:
                    continue
                offset += len(text)
                yield chunk(i, text, logprobs=lp)
            yield chunk(i, "", finish=run.finish_reason)
        if include_usage:
            yield sse.data({**base, "choices": [], "usage": _usage(groups)})
        yield sse.data("[DONE]")
    except Exception as e:  # noqa: BLE001 - every failure becomes an error event
        e = stream_failure(app, e, "completions")
        yield sse.data(error_body(e, anthropic=False))
