"""Command-line entry point: ``dflash-server <command>``."""
from __future__ import annotations

import argparse
import sys

from ..errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from . import generate

    p = argparse.ArgumentParser(prog="dflash-server", description="LLM inference server with DFlash speculative decoding")
    sub = p.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"dflash-server: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
