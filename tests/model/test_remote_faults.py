"""Shard-worker faults: a killed or stalled worker fails the request with ShardError, is
restarted, and the next request is correct; nothing leaks (processes, shared memory)."""
import os
import signal
import time

import pytest

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.errors import ShardError
from dflash_server.runtime.ipc_shm import shm_dir
from dflash_server.runtime.remote import RemoteOptions
from helpers.build import pipeline, prompt_ids


def shm_files():
    return {f for f in os.listdir(shm_dir()) if f.startswith("dflash-shm-")}


def wait_ok(stage, timeout=120):
    deadline = time.monotonic() + timeout
    while stage.health()["status"] != "ok":
        assert time.monotonic() < deadline, stage.health()
        time.sleep(0.1)


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_worker_fault_fails_one_request_then_recovers(tiny_dir, fault):
    shm_before = shm_files()
    pipe = pipeline(tiny_dir("qwen3_5"), devices=["cpu", "remote:cpu"], remote=RemoteOptions(timeout_s=2.0))
    stage = pipe.stages[-1]
    eng = Engine(pipe, prefix_slots=4)
    ids = tuple(prompt_ids(pipe, 24))
    ref = eng.generate(GenerationRequest(ids, max_tokens=12, ignore_eos=True)).token_ids
    old = stage.proc.proc
    seen = []

    def on_event(ev):
        seen.append(ev)
        if len(seen) == 3:
            os.kill(old.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

    t0 = time.monotonic()
    with pytest.raises(ShardError, match="exited" if fault == "kill" else "did not answer"):
        eng.generate(GenerationRequest(ids, max_tokens=12, ignore_eos=True), on_event=on_event)
    assert time.monotonic() - t0 < 15
    assert pipe.health()["status"] == "degraded"
    assert old.poll() is not None  # the failed worker is gone (a stalled one killed)
    wait_ok(stage)
    assert pipe.health() == {"status": "ok"} and stage.link.restarts == 1
    # the restarted worker lost its snapshots: the cache forgets them, output is unchanged
    again = eng.generate(GenerationRequest(ids, max_tokens=12, ignore_eos=True))
    assert again.token_ids == ref
    new = stage.proc.proc
    assert new.pid != old.pid and new.poll() is None
    eng.close()
    assert new.poll() is not None and stage.proc.dir is None
    assert shm_files() <= shm_before  # nothing new (an orphan of a killed server may be swept)


def test_failed_start_is_a_clear_error(tiny_dir, tmp_path):
    bad_python = tmp_path / "python"
    bad_python.write_text("#!/bin/sh\nexit 3\n")
    bad_python.chmod(0o755)
    with pytest.raises(ShardError, match="exited"):
        pipeline(tiny_dir("llama"), devices=["cpu", "remote:cpu"],
                 remote=RemoteOptions(python=str(bad_python), start_timeout_s=30))


def test_worker_exits_when_the_server_dies(tiny_dir, tmp_path):
    """A worker whose parent vanished (server SIGKILLed) exits by itself."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, %r)\n"
            "from helpers.build import pipeline\n"
            "p = pipeline(%r, devices=['cpu', 'remote:cpu'])\n"
            "print(p.stages[-1].proc.proc.pid, flush=True)\n"
            "import time; time.sleep(600)\n") % (os.path.dirname(os.path.dirname(__file__)), str(tiny_dir("llama")))
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    worker_pid = int(server.stdout.readline())
    os.kill(worker_pid, 0)
    server.kill()
    server.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(worker_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the orphaned worker is still running")
