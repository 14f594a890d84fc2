"""Hostile review (2026-11-28). shard-worker --bind accepts tcp://[::1]:PORT as a loopback address
(its _LOOPBACK pattern and address_problem both pass it), but ZeroMQ sockets refuse IPv6 unless
ZMQ_IPV6 is set: the worker exits with "No such device", and a DEALER connecting to [::1] never
reaches anything."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest


def _free_v6_port():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            return s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")


def test_shard_worker_binds_ipv6_loopback(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef")
    secret.chmod(0o600)
    port = _free_v6_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_server", "shard-worker", "--bind", f"tcp://[::1]:{port}",
                             "--secret-file", str(secret)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert "ready on tcp://[::1]" in line, line + (proc.stdout.read() if proc.poll() is not None else "")
    finally:
        proc.terminate()
        proc.wait(20)


def test_client_socket_takes_ipv6_addresses():
    import zmq

    from dflash_server.runtime.ipc_channel import ShardClient

    port = _free_v6_port()
    client = ShardClient(f"tcp://[::1]:{port}", b"0123456789abcdef", timeout_s=1.0)
    try:
        assert client.sock.getsockopt(zmq.IPV6) == 1, "the DEALER cannot reach tcp://[::1] without ZMQ_IPV6"
    finally:
        client.sock.close(0)
