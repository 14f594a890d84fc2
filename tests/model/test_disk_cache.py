"""Disk prefix cache: restart == warm, corruption suite (each case a miss + one warning,
never a crash or wrong output), budget, permissions."""
import logging
import os
import stat

import pytest

from dflash_server.cache.disk import DiskCache
from dflash_server.cache.disk_format import SUFFIX
from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.spec.proposer import DFlashProposer
from helpers.build import pipeline

from .test_dflash import random_draft

SYSTEM = "You are a helpful assistant. " * 8


def chat_ids(eng, turns):
    messages = [{"role": "system", "content": SYSTEM}]
    for q, a in turns:
        messages.append({"role": "user", "content": q})
        if a is not None:
            messages.append({"role": "assistant", "content": a})
    return tuple(eng.tokenizer.encode_chat(messages))


def make_engine(path, tmp, family="llama", stages=1, draft=False, fp="fp", slots=4, budget=1 << 30):
    pipe = pipeline(path, stages=stages)
    prop = DFlashProposer(random_draft(pipe, block_size=4, seed=2), pipe) if draft else None
    return Engine(pipe, proposer=prop, prefix_slots=slots, disk_cache=DiskCache(tmp, fp, budget, 0))


def run(eng, ids, n=6):
    return eng.generate(GenerationRequest(ids, max_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("family,stages,draft", [("llama", 1, False), ("qwen3_5", 2, True), ("llama", 2, True),
                                                ("gemma4_e", 2, True), ("laguna", 2, False)])
def test_restart_hits_from_disk_and_equals_warm(tiny_dir, tmp_path, family, stages, draft):
    path = tiny_dir(family)
    a = make_engine(path, tmp_path, family, stages, draft)
    first = run(a, chat_ids(a, [("Hi there", None)]))
    turn2 = chat_ids(a, [("Hi there", first.text), ("And then?", None)])
    warm = run(a, turn2)
    assert warm.cached_tokens > 0 and warm.extra["cache"] == "memory"
    a.close()  # graceful shutdown: everything in memory goes to disk
    files = list((tmp_path / "fp").glob(f"*{SUFFIX}"))
    assert len(files) >= 2
    b = make_engine(path, tmp_path, family, stages, draft)  # "restarted server"
    cold = run(b, turn2)
    # the warm run also saved the end of this prompt's last turn: the restart hits at least as far
    assert cold.extra["cache"] == "disk" and cold.cached_tokens >= warm.cached_tokens
    assert cold.token_ids == warm.token_ids
    if draft:
        assert cold.extra["spec"] == warm.extra["spec"]
    b.close()


def _one_file(tiny_dir, tmp_path):
    eng = make_engine(tiny_dir("llama"), tmp_path)
    ids = chat_ids(eng, [("Question one", "Answer one"), ("Question two", None)])
    ref = run(eng, ids)
    eng.close()
    files = sorted((tmp_path / "fp").glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_size)
    return ids, ref, files[-1]


def _truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(f):
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _flip_header(f):
    data = bytearray(f.read_bytes())
    data[12] ^= 0x55
    f.write_bytes(bytes(data))


def _version(f):
    data = f.read_bytes()
    f.write_bytes(data.replace(b'\\"version\\": 2', b'\\"version\\": 9', 1))


def _foreign(f):
    data = f.read_bytes()
    f.write_bytes(data.replace(b'\\"fingerprint\\": \\"fp\\"', b'\\"fingerprint\\": \\"xx\\"', 1))


@pytest.mark.parametrize("damage", [_truncate, _flip_header, _flip, _version, _foreign])
def test_damaged_file_is_a_miss_with_one_warning(tiny_dir, tmp_path, caplog, damage):
    ids, ref, f = _one_file(tiny_dir, tmp_path)
    damage(f)
    caplog.set_level(logging.WARNING, logger="dflash_server.cache")
    eng = make_engine(tiny_dir("llama"), tmp_path)
    res = run(eng, ids)
    assert res.token_ids == ref.token_ids
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    eng.close()


def test_flipped_tensor_bytes_are_a_miss(tiny_dir, tmp_path):
    """Flipped bytes inside tensor data fail the file's sha256: a miss, the file removed,
    the output that of a fresh prefill, whose own snapshot then replaces the damaged file
    (written on the background writer, so only checked after a flush)."""
    ids, ref, f = _one_file(tiny_dir, tmp_path)
    _flip(f)
    damaged = f.read_bytes()
    eng = make_engine(tiny_dir("llama"), tmp_path)
    res = run(eng, ids)
    assert res.token_ids == ref.token_ids and res.cached_tokens == 0
    assert eng.prefix_cache.disk.counters["errors"] == 1
    eng.close()
    assert f.exists() and f.read_bytes() != damaged
    again = make_engine(tiny_dir("llama"), tmp_path)
    res2 = run(again, ids)
    assert res2.extra["cache"] == "disk" and res2.token_ids == ref.token_ids
    assert again.prefix_cache.disk.counters["errors"] == 0
    again.close()


def test_files_swapped_between_models(tiny_dir, tmp_path, caplog):
    """A snapshot of another model placed in this model's directory (name and fingerprint
    forged to match) has tensors that do not fit: a miss with one warning."""
    llama = make_engine(tiny_dir("llama"), tmp_path / "a")
    ids_l = chat_ids(llama, [("q", "a"), ("q2", None)])
    run(llama, ids_l)
    llama.close()
    qwen_dir = tiny_dir("qwen3_5")
    q = make_engine(qwen_dir, tmp_path / "b", fp="fp")
    src = next((tmp_path / "a" / "fp").glob(f"*{SUFFIX}"))
    # same token ids as the llama prompt would give => same name; the fingerprint matches "fp"
    (tmp_path / "b" / "fp" / src.name).write_bytes(src.read_bytes())
    q.close()
    caplog.set_level(logging.WARNING, logger="dflash_server.cache")
    q2 = make_engine(qwen_dir, tmp_path / "b", fp="fp")
    q2.prefix_cache.boundaries.end_ids = q2.prefix_cache.boundaries.end_ids | set(llama.prefix_cache.boundaries.end_ids)
    ref = Engine(pipeline(qwen_dir)).generate(GenerationRequest(ids_l, max_tokens=4, ignore_eos=True))
    res = q2.generate(GenerationRequest(ids_l, max_tokens=4, ignore_eos=True))
    assert res.token_ids == ref.token_ids
    assert any("does not fit" in r.getMessage() for r in caplog.records)
    q2.close()


def test_budget_evicts_and_never_exceeds(tiny_dir, tmp_path):
    eng = make_engine(tiny_dir("llama"), tmp_path, slots=0, budget=1)
    run(eng, chat_ids(eng, [("a", "b"), ("c", None)]))
    eng.close()
    assert eng.prefix_cache.disk.stats()["bytes"] <= 1
    eng2 = make_engine(tiny_dir("llama"), tmp_path, slots=0, budget=600_000)
    for i in range(6):
        run(eng2, chat_ids(eng2, [(f"question {i}", "x"), ("next", None)]), n=2)
    eng2.prefix_cache.disk.flush()
    st = eng2.prefix_cache.disk.stats()
    assert st["bytes"] <= 600_000 and st["writes"] >= 2 and st["evictions"] >= 1
    on_disk = sum(p.stat().st_size for p in (tmp_path / "fp").glob(f"*{SUFFIX}"))
    assert on_disk == st["bytes"]
    eng2.close()


def test_directory_is_private_and_names_are_hashes(tiny_dir, tmp_path):
    eng = make_engine(tiny_dir("llama"), tmp_path / "cache")
    run(eng, chat_ids(eng, [("../../etc/passwd", "x"), ("y", None)]))
    eng.close()
    for d in (tmp_path / "cache", tmp_path / "cache" / "fp"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for f in (tmp_path / "cache" / "fp").iterdir():
        if f.name == ".dflash-cache":  # the folder's marker
            continue
        assert f.name.endswith(SUFFIX) and all(c in "0123456789abcdef" for c in f.name[: -len(SUFFIX)])


def test_unwritable_disk_is_a_warning_not_a_crash(tiny_dir, tmp_path, caplog, monkeypatch):
    import dflash_server.cache.disk as disk_mod

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk_mod, "write_snapshot", full)
    caplog.set_level(logging.WARNING, logger="dflash_server.cache")
    eng = make_engine(tiny_dir("llama"), tmp_path)
    ids = chat_ids(eng, [("a", "b"), ("c", None)])
    r1 = run(eng, ids)
    eng.close()
    assert any("No space" in r.getMessage() for r in caplog.records)
    assert eng.prefix_cache.disk.stats()["errors"] >= 1
    assert r1.completion_tokens == 6


def test_cache_command_ls_stats_clear(tiny_dir, tmp_path):
    import json
    import subprocess
    import sys

    eng = make_engine(tiny_dir("llama"), tmp_path / "c")
    run(eng, chat_ids(eng, [("a", "b"), ("c", None)]))
    eng.close()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dflash_server", "cache", *args, "--kv-cache-dir",
                               str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    ls = json.loads(cli("ls", "--json").stdout)
    assert len(ls) >= 1 and all(r["valid"] and r["tokens"] > 0 for r in ls)
    stats = json.loads(cli("stats", "--json").stdout)
    assert stats["files"] == len(ls) and stats["models"]["fp"]["files"] == len(ls)
    assert "removed" in cli("clear").stdout
    assert json.loads(cli("ls", "--json").stdout) == []
    bad = cli("ls")
    assert bad.returncode == 0
    missing = subprocess.run([sys.executable, "-m", "dflash_server", "cache", "ls", "--kv-cache-dir",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "no such directory" in missing.stderr


@pytest.mark.parametrize("draft", [False, True])
def test_interval_checkpoints_resume_a_long_answer(tiny_dir, tmp_path, draft):
    """--kv-cache-interval: a long generation leaves disk snapshots every N tokens; after a
    restart, the next turn (which resends the answer) resumes from the latest one inside
    the answer, with the output of a fresh prefill."""
    path = tiny_dir("qwen3_5")

    def engine(interval=0, disk=True):
        pipe = pipeline(path)
        prop = DFlashProposer(random_draft(pipe, block_size=4, seed=2), pipe) if draft else None
        return Engine(pipe, proposer=prop, prefix_slots=0, checkpoint_interval=interval,
                      disk_cache=DiskCache(tmp_path, "fp", 1 << 30, 10 ** 6) if disk else None)
    a = engine(interval=8)
    prompt = chat_ids(a, [("Tell me a long story", None)])
    long = run(a, prompt, n=40)
    a.close()
    files = list((tmp_path / "fp").glob(f"*{SUFFIX}"))
    assert len(files) >= 4  # 40 tokens, every 8 (min_tokens is huge: only checkpoints are written)
    resent = tuple(prompt) + tuple(long.token_ids[:30])
    b = engine()
    hit = run(b, resent, n=8)
    assert hit.extra["cache"] == "disk" and len(prompt) + 24 <= hit.cached_tokens < len(resent)
    fresh = run(engine(disk=False), resent, n=8)
    assert hit.token_ids == fresh.token_ids
    b.close()
