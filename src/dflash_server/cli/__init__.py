"""Command-line entry point: ``dflash-server <command>``."""
from __future__ import annotations

import argparse
import os
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


# A local + remote split on one host alternates two processes on the same cores. OpenMP
# (libgomp) spins ~300k iterations after each parallel region by default, so the idle
# process steals cores from the busy one: measured on 2 cores (benchmarks/split.py), the
# remote split ran at 0.54x of unsplit by default and 0.88x with 3000, while unsplit
# itself did not change measurably (74.7 vs 73.4 tok/s). libgomp reads the variable when
# torch loads it, so this must happen before the first torch import.
OPENMP_SPIN = "3000"


def _tune_openmp(argv: list[str]) -> None:
    if "torch" not in sys.modules and (any("remote:" in a for a in argv) or "shard-worker" in argv):
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN)


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
