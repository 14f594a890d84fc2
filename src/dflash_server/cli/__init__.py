"""Command-line entry point: ``dflash-server <command>``."""
from __future__ import annotations

import argparse
import sys

from ..errors import UserError


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (the full usage is one --help away)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import cache, generate, serve, shard_worker, train_draft

    p = _Parser(prog="dflash-server", description="LLM inference server with DFlash speculative decoding")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    generate.add_parser(sub)
    serve.add_parser(sub)
    train_draft.add_parser(sub)
    cache.add_parser(sub)
    shard_worker.add_parser(sub)
    return p


def _tune_openmp(argv: list[str]) -> None:
    """A remote split, a shard worker or the server: set libgomp's spin-wait before torch
    loads it (runtime/openmp.py says why and what was measured)."""
    if any("remote:" in a for a in argv) or "shard-worker" in argv or "serve" in argv:
        from ..runtime.openmp import tune_for_split

        tune_for_split()


def main(argv: list[str] | None = None) -> int:
    _tune_openmp(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"dflash-server: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
