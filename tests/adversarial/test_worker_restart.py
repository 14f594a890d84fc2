"""Hostile review (2026-11-27). A worker restart that fails with anything but ShardError (mkdtemp/Popen OSError: a full
/tmp, EMFILE, EAGAIN; a TypeError from a bad handshake reply) kills the background restart
thread and leaves the link 'degraded' for good: it is never retried, every later request
gets 503 until the server itself is restarted."""
import os
import signal
import tempfile
import time

import pytest

from dflash_server.errors import ShardError
from dflash_server.runtime.remote import RemoteOptions
from helpers.build import pipeline, prompt_ids


def test_a_restart_that_fails_transiently_is_retried(tiny_dir, tmp_path, monkeypatch):
    pipe = pipeline(tiny_dir("llama"), devices=["cpu", "remote:cpu"], remote=RemoteOptions(timeout_s=5.0))
    stage = pipe.stages[-1]
    ids = prompt_ids(pipe, 8)
    try:
        pipe.reset()
        pipe.forward(ids, 0)
        old = stage.proc.proc
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # the restart's mkdtemp fails once
        os.kill(old.pid, signal.SIGKILL)
        old.wait()
        with pytest.raises(ShardError):
            pipe.reset()
            pipe.forward(ids, 0)
        time.sleep(1)
        monkeypatch.undo()  # the transient condition is over
        deadline = time.monotonic() + 60
        while True:
            try:
                pipe.reset()
                pipe.forward(ids, 0)
                break
            except ShardError:
                assert time.monotonic() < deadline, stage.health()  # now: 'degraded' for ever
                time.sleep(0.5)
        assert stage.health()["status"] == "ok"
    finally:
        pipe.close()


def test_sequences_of_other_slots_fail_as_the_workers_fault(tiny_dir):
    """With several sequence slots, a worker death failed the request whose forward hit it
    (503), but a sequence decoding in another slot then failed with a ValueError ("forward at
    N leaves a gap after cached length 0"), answered as a 400. Each slot now remembers the
    worker epoch its sequence began in."""
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.server.generation import engine_error

    pipe = pipeline(tiny_dir("llama"), devices=["cpu", "remote:cpu"], remote=RemoteOptions(timeout_s=5.0), lanes=2)
    stage = pipe.stages[-1]
    eng = Engine(pipe)
    try:
        a_ids, b_ids = tuple(prompt_ids(pipe, 20)), tuple(prompt_ids(pipe, 30, seed=1))
        ref = eng.generate(GenerationRequest(a_ids, max_tokens=12, ignore_eos=True)).token_ids
        a = eng.submit(GenerationRequest(a_ids, max_tokens=12, ignore_eos=True))
        while len(a.out.tokens) < 3:
            eng.step()
        old = stage.proc.proc
        os.kill(old.pid, signal.SIGKILL)
        old.wait()
        b = eng.submit(GenerationRequest(b_ids, max_tokens=12, ignore_eos=True))
        while not (a.done and b.done):
            eng.step()
        assert isinstance(b.error, ShardError)
        assert isinstance(a.error, ShardError), repr(a.error)
        assert engine_error(a.error).status == 503
        assert eng.generate(GenerationRequest(a_ids, max_tokens=12, ignore_eos=True)).token_ids == ref
    finally:
        eng.close()


def test_a_draft_worker_restart_fails_its_sequences_as_its_fault(tiny_dir, tmp_path):
    """The same for a draft in its own worker: a restart loses every slot's draft context, so
    a sequence in flight fails with a ShardError (503) instead of the fresh worker's ValueError
    (a 400); a new request afterwards is served."""
    import json

    import torch
    from safetensors.torch import save_file

    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.server.generation import engine_error
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.spec.remote_draft import RemoteDraft

    from helpers.build import random_draft

    path = tiny_dir("llama")
    pipe = pipeline(path, max_ctx=256, lanes=2)
    local = random_draft(pipe, layers=1)
    (tmp_path / "config.json").write_text(json.dumps(local.cfg.to_dict()))
    save_file(local.zlab_state_dict(), str(tmp_path / "model.safetensors"))
    rd = RemoteDraft(tmp_path, device="cpu", home="cpu", dtype=torch.float32, max_ctx=pipe.max_ctx,
                     options=RemoteOptions(timeout_s=10))
    eng = Engine(pipe, proposer=DFlashProposer(rd, pipe))
    try:
        ids, other = tuple(prompt_ids(pipe, 12)), tuple(prompt_ids(pipe, 17, seed=1))
        a = eng.submit(GenerationRequest(ids, max_tokens=24, ignore_eos=True))
        while len(a.out.tokens) < 3:
            eng.step()
        old = rd.link.proc.proc
        os.kill(old.pid, signal.SIGKILL)
        old.wait()
        b = eng.submit(GenerationRequest(other, max_tokens=24, ignore_eos=True))   # meets the dead worker
        while not (a.done and b.done):
            eng.step()
        for s in (a, b):
            assert isinstance(s.error, ShardError), repr(s.error)
            assert engine_error(s.error).status == 503
        assert len(eng.generate(GenerationRequest(ids, max_tokens=8, ignore_eos=True)).token_ids) == 8
    finally:
        eng.close()
        rd.close()
