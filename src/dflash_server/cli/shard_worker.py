"""``dflash-server shard-worker``: serve a group of target layers to a server over IPC."""
from __future__ import annotations

import argparse
import logging
import os
import re

from ..engine.config import address_problem
from ..errors import UserError

SECRET_ENV = "DFLASH_SHARD_SECRET"
_LOOPBACK = re.compile(r"^tcp://(127\.\d+\.\d+\.\d+|localhost|\[::1\]):\d+$")


def add_parser(sub) -> None:
    p = sub.add_parser("shard-worker", help="serve target layers to a server (mixed-backend or multi-host split)",
                       description="Serve a group of target layers to a dflash-server over ZeroMQ. The server "
                                   "sends the model path, layer ranges and devices when it connects.")
    p.add_argument("--bind", default="tcp://127.0.0.1:5701",
                   help="ZeroMQ address: ipc:///path.sock or tcp://host:port (default loopback)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow binding a non-loopback tcp address (other hosts can then connect)")
    p.add_argument("--secret-file", help=f"file holding the shared secret (else ${SECRET_ENV})")
    p.add_argument("--model", help="load the weights from this path instead of the path the server sends "
                                   "(same files, e.g. on another host)")
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # set by a spawning server
    p.set_defaults(func=run)


def read_secret(path: str | None) -> bytes:
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise UserError(f"--secret-file {path}: {e.strerror}") from None
    else:
        secret = os.environ.get(SECRET_ENV, "").strip().encode()
    if len(secret) < 16:
        raise UserError(f"a shared secret of at least 16 bytes is required (--secret-file or ${SECRET_ENV})")
    return secret


def run(args) -> int:
    from ..pflash.remote import ScorerOps
    from ..runtime.shard_worker import ShardWorker
    from ..spec.remote_draft import DraftOps

    if args.bind.startswith("tcp://") and not _LOOPBACK.match(args.bind) and not args.allow_remote:
        raise UserError(f"--bind {args.bind}: not a loopback address; add --allow-remote to accept other hosts")
    if why := address_problem(args.bind):
        raise UserError(f"--bind {args.bind}: {why}")
    secret = read_secret(args.secret_file)
    logging.basicConfig(level=logging.INFO, format="shard-worker %(levelname)s %(message)s")
    import zmq

    try:
        ShardWorker(secret, args.model, providers=(DraftOps(), ScorerOps()), settle_heap=True).serve(args.bind, args.parent_pid)
    except zmq.ZMQError as e:
        raise UserError(f"--bind {args.bind}: {e}") from None
    except KeyboardInterrupt:
        pass
    return 0
