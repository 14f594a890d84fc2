"""``dflash-server generate``: one prompt in, text out (streamed) or one JSON object."""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import UserError
from ..runtime import heap
from .common import add_model_args, engine_config, load_engine, positive_int, read_text_file, utf8_text


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", type=utf8_text, help="raw prompt text (no chat template)")
    src.add_argument("--chat", type=utf8_text, help="user message; the model's chat template is applied")
    src.add_argument("--chat-file", help="--chat read from a file (UTF-8), e.g. a long document and a question")
    p.add_argument("--system", type=utf8_text, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..engine.generate import GenerationRequest
    from ..engine.sampling import SamplingParams

    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    except ValueError as e:
        raise UserError(str(e)) from None
    source, pipeline, engine = load_engine(engine_config(args), progress=not args.json)
    if args.compile:  # compile in a throwaway generation, so the timings below are decode, not compiling
        import time

        print("dflash-server: compiling (minutes on a cold cache) ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        engine.warm_up()
        print(f"dflash-server: compiled in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    heap.settle()
    tok = source.tokenizer
    query = None
    if args.prompt is not None:
        ids = tok.encode(args.prompt)
    else:
        if args.chat_file is not None:
            query = read_text_file(args.chat_file, "--chat-file").replace("\r\n", "\n")  # (as text mode read it)
        else:
            query = args.chat if args.chat is not None else "What is the capital of France?"
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": query})
        try:
            ids = tok.encode_chat(messages)
        except ValueError as e:
            raise UserError(str(e)) from None
    keep = engine.compress_policy.decide(len(ids))
    try:
        req = GenerationRequest(tuple(ids), sampling, args.max_tokens, ignore_eos=args.ignore_eos,
                                stop=tuple(args.stop), compress=keep, compress_query=query)
    except ValueError as e:
        raise UserError(str(e)) from None

    def stream(ev):
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()

    try:
        res = engine.generate(req, on_event=None if args.json else stream)
    except ValueError as e:
        raise UserError(str(e)) from None
    finally:
        engine.close()
    if args.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "prompt_tokens": res.prompt_tokens,
                          "completion_tokens": res.completion_tokens, "finish_reason": res.finish_reason,
                          "timings": res.timings(), "spec": res.extra.get("spec"),
                          "pflash": res.extra.get("pflash"), "cuda_graphs": pipeline.cuda_graph_stats() or None}))
    else:
        sys.stdout.write("\n")
        t = res.timings()
        spec = res.extra.get("spec")
        tau = f", acceptance length {spec['acceptance_length']:.2f}" if spec else ""
        pf = res.extra.get("pflash")
        if pf:
            tau += (f", prompt compressed to {pf['compressed_tokens']} tokens (drafter {pf['drafter_s']:.2f} s)")
        print(f"[{res.prompt_tokens} prompt tokens, {res.completion_tokens} generated; prefill "
              f"{t['prefill_tokens_per_s']} tok/s, decode {t['decode_tokens_per_s']} tok/s{tau}]", file=sys.stderr)
    return 0
