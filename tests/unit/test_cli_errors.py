"""Bad inputs to the CLI give one clear error line and a non-zero exit, never a traceback."""
import json
import shutil
import subprocess
import sys

import pytest


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dflash_server", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_clean_error(res, needle):
    assert res.returncode != 0
    err = res.stderr.strip()
    assert "Traceback" not in res.stderr, res.stderr
    assert len(err.splitlines()) == 1, err
    assert needle.lower() in err.lower(), err


def gen(model, *extra):
    return run_cli("generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2", *extra)


def test_missing_model(tmp_path):
    assert_clean_error(gen(tmp_path / "nope"), "no such file")


def test_corrupt_gguf(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    assert_clean_error(gen(p), "gguf")
    p.write_bytes(b"not a gguf at all")
    assert_clean_error(gen(p), "gguf")


def test_truncated_gguf(tmp_path):
    from helpers.tiny import smollm2_gguf_path

    data = smollm2_gguf_path().read_bytes()
    p = tmp_path / "trunc.gguf"
    p.write_bytes(data[: len(data) // 2])
    assert_clean_error(gen(p), "truncated")


def _copy_tiny(tiny_dir, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), dst)
    return dst


def test_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_clean_error(gen(tmp_path / "empty"), "config.json")


def test_unknown_architecture(tiny_dir, tmp_path):
    d = _copy_tiny(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["FooForCausalLM"], "foo"
    (d / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(gen(d), "unknown architecture")


def test_shape_mismatch(tiny_dir, tmp_path):
    d = _copy_tiny(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(gen(d), "shape")


def test_truncated_safetensors(tiny_dir, tmp_path):
    d = _copy_tiny(tiny_dir, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_clean_error(gen(d), "truncated")


@pytest.mark.parametrize("devices,split,needle", [
    ("cpu,cpu", "0,1", "> 0"), ("cpu,cpu", "-1,2", "error"), ("cpu,cpu", "1,2,3", "weights"),
    ("cpu,cpu,cpu,cpu,cpu", None, "layer"), ("gpu0", None, "unknown device"),
    ("remote:cpu,cpu", None, "must be local"),
])
def test_bad_placement(tiny_dir, devices, split, needle):
    args = ["--target-devices", devices] + (["--target-layer-split", split] if split else [])
    assert_clean_error(gen(tiny_dir("llama"), *args), needle)


@pytest.mark.parametrize("extra,needle", [
    (["--target-shard-connect", "tcp://127.0.0.1:9"], "need remote: devices"),
    (["--target-devices", "cpu,remote:cpu", "--target-shard-connect", "tcp://127.0.0.1:9"], "shared secret"),
    (["--target-devices", "cpu,remote:cpu", "--shard-timeout", "0"], "shard-timeout"),
    (["--draft", "default", "--draft-device", "remote:gpu"], "unknown device"),
])
def test_bad_shard_flags(tiny_dir, extra, needle, monkeypatch):
    monkeypatch.delenv("DFLASH_SHARD_SECRET", raising=False)
    assert_clean_error(gen(tiny_dir("llama"), *extra), needle)


def test_shard_worker_flags():
    assert_clean_error(run_cli("shard-worker", "--bind", "tcp://0.0.0.0:5701"), "loopback")
    res = subprocess.run([sys.executable, "-m", "dflash_server", "shard-worker"], capture_output=True, text=True,
                         timeout=60, env={k: v for k, v in __import__("os").environ.items()
                                          if k != "DFLASH_SHARD_SECRET"})
    assert_clean_error(res, "shared secret")


def test_connect_to_a_hand_started_worker_over_tcp(tiny_dir, tmp_path):
    """--target-shard-connect: a worker started by hand (tcp, inline frames) == unsplit;
    a wrong secret is refused with one clear line."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple\n")
    worker = subprocess.Popen([sys.executable, "-m", "dflash_server", "shard-worker", "--bind",
                               f"tcp://127.0.0.1:{port}", "--secret-file", str(secret)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "ready" in worker.stdout.readline()
        base = ["--json", "--dtype", "fp32"]
        ref = json.loads(gen(tiny_dir("llama"), *base).stdout)["token_ids"]
        remote = ["--target-devices", "cpu,remote:cpu", "--target-shard-connect", f"tcp://127.0.0.1:{port}",
                  "--shard-secret-file", str(secret)]
        res = gen(tiny_dir("llama"), *base, *remote)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["token_ids"] == ref
        wrong = tmp_path / "wrong"
        wrong.write_text("not the right secret at all")
        res = gen(tiny_dir("llama"), *base, *remote[:-1], str(wrong), "--shard-timeout", "5")
        assert_clean_error(res, "authentication")
        assert worker.poll() is None  # a refused client does not hurt the worker
    finally:
        worker.terminate()
        worker.wait(10)
    assert not os.path.exists(f"/proc/{worker.pid}") or worker.returncode is not None


def test_bad_sampling_flag(tiny_dir):
    assert_clean_error(gen(tiny_dir("llama"), "--top-p", "0"), "top_p")


def test_generate_json_on_tiny_model(tiny_dir):
    res = run_cli("generate", "--model", str(tiny_dir("llama")), "--prompt", "Hello", "--max-tokens", "5",
                  "--ignore-eos", "--json", "--dtype", "fp32")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["completion_tokens"] == 5 == len(out["token_ids"])
    assert out["prompt_tokens"] > 0
    assert set(out["timings"]) >= {"prefill_s", "decode_s", "decode_tokens_per_s"}


def _save_random_draft(tiny_dir, dst):
    from safetensors.torch import save_file

    from dflash_server.spec.config import DraftConfig
    from dflash_server.spec.draft import DFlashDraft

    cfg = DraftConfig(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=16, block_size=4, mask_token_id=5, target_layer_ids=(1, 2), num_target_layers=4)
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(DFlashDraft.random_tensors(cfg, 0, 0.05), str(dst / "model.safetensors"))
    return dst


def test_the_built_in_model_drafts_with_its_shipped_draft_by_default():
    """``generate`` on the built-in model without --draft speculates with the shipped draft
    (beside prompt lookup) and writes exactly what --no-draft writes."""
    base = ["generate", "--prompt", "Write a Python function that returns the sum of a list of numbers.",
            "--max-tokens", "40", "--ignore-eos", "--json"]
    plain = run_cli(*base, "--no-draft")
    drafted = run_cli(*base)
    assert plain.returncode == 0 and drafted.returncode == 0, (plain.stderr, drafted.stderr)
    plain, drafted = json.loads(plain.stdout), json.loads(drafted.stdout)
    assert plain["spec"] is None
    assert drafted["token_ids"] == plain["token_ids"]
    assert drafted["spec"]["block_size"] == 8                        # the shipped draft's trained block
    assert drafted["spec"]["steps"] > drafted["spec"]["lookup_steps"]  # some steps verified the draft's block
    tree = run_cli(*base, "--ddtree-budget", "4")   # --ddtree without --draft: the shipped draft's trees
    assert tree.returncode == 0, tree.stderr
    tree = json.loads(tree.stdout)
    assert tree["token_ids"] == plain["token_ids"] and tree["spec"]["tree_steps"] > 0
    assert_clean_error(run_cli(*base, "--ddtree", "--compile"), "--draft")   # (no shipped draft with --compile)


def test_lookup_store_flag(tiny_dir):
    """--lookup-store N: lossless, reported, refused where no lookups run or N is not a size."""
    base = ["generate", "--model", str(tiny_dir("llama")), "--prompt", "Hello there", "--max-tokens", "12",
            "--ignore-eos", "--json", "--dtype", "fp32"]
    plain = json.loads(run_cli(*base, "--no-draft").stdout)
    res = run_cli(*base, "--lookup", "4", "--lookup-store", "4096")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["token_ids"] == plain["token_ids"]
    for bad in ("-1", "10", "x", "2.5"):
        assert_clean_error(gen(tiny_dir("llama"), "--lookup", "4", "--lookup-store", bad), "lookup-store")
    assert_clean_error(gen(tiny_dir("llama"), "--no-draft", "--lookup-store", "4096"), "--lookup-store")


def test_generate_json_with_draft_is_lossless(tiny_dir, tmp_path):
    draft = _save_random_draft(tiny_dir, tmp_path / "draft")
    base = ["generate", "--model", str(tiny_dir("llama")), "--prompt", "Hello there", "--max-tokens", "12",
            "--ignore-eos", "--json", "--dtype", "fp32"]
    plain = json.loads(run_cli(*base, "--no-draft").stdout)
    looked = json.loads(run_cli(*base).stdout)                       # the default on a CPU: prompt lookup alone
    assert looked["token_ids"] == plain["token_ids"] and looked["spec"]["block_size"] == 1
    res = run_cli(*base, "--draft", str(draft), "--block-size", "3")
    assert res.returncode == 0, res.stderr
    spec = json.loads(res.stdout)
    assert spec["token_ids"] == plain["token_ids"] and plain["spec"] is None
    assert spec["spec"]["steps"] > 0 and spec["spec"]["block_size"] == 3
    assert {"acceptance_length", "accept_rate", "steps"} <= set(spec["spec"])
    auto = run_cli(*base, "--draft", str(draft))                 # default: adaptive block size
    assert auto.returncode == 0, auto.stderr
    auto = json.loads(auto.stdout)
    assert auto["token_ids"] == plain["token_ids"] and auto["spec"]["block_size"] == 4
    assert auto["spec"]["steps"] + auto["spec"]["plain_steps"] > 0
    for bad in ("1", "x"):
        assert_clean_error(gen(tiny_dir("llama"), "--draft", str(draft), "--block-size", bad), "block-size")
    off = run_cli(*base, "--draft", str(draft), "--lookup", "0")     # prompt lookup off: the draft's steps only
    assert off.returncode == 0, off.stderr
    off = json.loads(off.stdout)
    assert off["token_ids"] == plain["token_ids"] and off["spec"]["lookup_steps"] == 0
    assert isinstance(auto["spec"]["lookup_steps"], int)   # reported beside the draft's steps
    for bad in ("-1", "17", "x", "1e3", "2.5"):
        assert_clean_error(gen(tiny_dir("llama"), "--draft", str(draft), "--lookup", bad), "lookup")
    alone = run_cli(*base, "--lookup", "4")                          # lookup alone, no draft model
    assert alone.returncode == 0, alone.stderr
    alone = json.loads(alone.stdout)
    assert alone["token_ids"] == plain["token_ids"] and alone["spec"]["block_size"] == 1
    tree = run_cli(*base, "--draft", str(draft), "--ddtree-budget", "4", "--lookup", "3")   # lookups grafted onto trees
    assert tree.returncode == 0, tree.stderr
    tree = json.loads(tree.stdout)
    assert tree["token_ids"] == plain["token_ids"] and isinstance(tree["spec"]["lookup_steps"], int)
    for bad in ("maybe", "", "ON"):
        assert_clean_error(gen(tiny_dir("llama"), "--draft", str(draft), "--batch-spec", bad), "batch-spec")


def test_bad_draft_gives_clean_error(tiny_dir, tmp_path):
    assert_clean_error(gen(tiny_dir("llama"), "--draft", str(tmp_path / "missing")), "draft")
    draft = _save_random_draft(tiny_dir, tmp_path / "d2")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 7]
    (draft / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(gen(tiny_dir("llama"), "--draft", str(draft)), "target_layer_ids")


@pytest.mark.parametrize("args,needle", [
    (("--prefill-compression", "always"), "needs --prefill-drafter"),
    (("--prefill-drafter", "self:0"), "self:0"),
    (("--prefill-drafter", "self:99"), "has 4 layers"),
    (("--prefill-drafter", "self:x"), "expected self:N"),
    (("--prefill-drafter", "self:2", "--prefill-drafter-layers", "1"), "do not apply"),
    (("--prefill-drafter-layers", "1"), "need --prefill-drafter"),
    (("--prefill-drafter", "remote:cpu"), "--prefill-drafter-device remote:"),
    (("--prefill-drafter", "self:2", "--prefill-drafter-device", "cpu"), "do not apply"),
    (("--prefill-drafter", "/nonexistent/drafter"), "/nonexistent/drafter"),
    (("--prefill-drafter", "self:2", "--prefill-keep-ratio", "0"), "keep ratio"),
    (("--prefill-drafter", "self:2", "--prefill-curve", "100:0.5", "100:0.2"), "distinct"),
    (("--prefill-drafter", "self:2", "--prefill-curve", "oops"), "tokens:ratio"),
])
def test_prefill_flags(tiny_dir, args, needle):
    assert_clean_error(gen(tiny_dir("llama"), *args), needle)


def test_generate_compresses_a_chat_file(tiny_dir, tmp_path):
    f = tmp_path / "q.txt"
    f.write_text(" ".join(f"Fact {i}: the mill stands by the river." for i in range(60)) + "\nWhere is the mill?")
    res = run_cli("generate", "--model", str(tiny_dir("llama")), "--chat-file", str(f), "--max-tokens", "2",
                  "--prefill-drafter", "self:2", "--prefill-compression", "auto", "--prefill-threshold", "100",
                  "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["pflash"]["raw_tokens"] == out["prompt_tokens"] > out["pflash"]["compressed_tokens"] > 0
    assert_clean_error(run_cli("generate", "--model", str(tiny_dir("llama")), "--chat-file",
                               str(tmp_path / "missing.txt")), "missing.txt")


@pytest.mark.parametrize("extra,needle", [
    (["--kvflash", "lots"], "--kvflash"), (["--disk-prefix-cache", "sometimes"], "--disk-prefix-cache"),
    (["--prefix-cache-slots", "-1"], "--prefix-cache-slots"), (["--ddtree"], "--draft"),
    (["--kv-cache-interval", "-2"], "--kv-cache-interval"),
])
def test_flag_errors_come_before_reading_the_model(tmp_path, extra, needle):
    """EngineConfig checks every flag it can before a weight is read: a bad flag with a
    missing model names the flag, not the model."""
    assert_clean_error(gen(tmp_path / "nope", *extra), needle)


@pytest.mark.parametrize("flag", ["file", "flag", "flag-spaces"])
def test_a_blank_api_key_is_refused_not_no_auth(tmp_path, flag):
    """Hostile review (2026-11-27): an empty --api-key-file (a secret mount not populated yet)
    or --api-key "" started an open server, without a word on loopback. Fail closed: one
    error line, before the model loads."""
    f = tmp_path / "key.txt"
    f.write_text("  \n")
    args = {"file": ["--api-key-file", str(f)], "flag": ["--api-key", ""], "flag-spaces": ["--api-key", "   "]}[flag]
    assert_clean_error(run_cli("serve", "--port", "1", *args, timeout=60), "empty")


def test_prompt_ids_outside_the_vocabulary_are_a_clean_error(tiny_dir):
    """Hostile review (2026-11-27): a tokenizer larger than the model's embedding gave prompt
    ids past the vocabulary: an IndexError traceback in the embedding lookup."""
    model = tiny_dir("llama", vocab_size=300)  # the SmolLM2 tokenizer has 49152 ids
    assert_clean_error(gen(model, "--prompt", "hello wonderful world", "--threads", "1"), "vocabulary")


def test_a_kv_cache_the_host_cannot_hold_is_refused(tiny_dir):
    """Hostile review (2026-11-27): on a CPU an explicit --max-ctx / --parallel whose KV cannot
    fit was accepted; the process then aborted in an allocation (a traceback and SIGABRT) or
    was OOM-killed without a word. Refused now with the numbers, before the weights load."""
    from dflash_server.cli.common import load_engine
    from dflash_server.engine.config import EngineConfig
    from dflash_server.errors import UserError

    res = run_cli("generate", "--model", str(tiny_dir("llama")), "--prompt", "hi", "--max-tokens", "1",
                  "--threads", "1", "--max-ctx", "100000000", timeout=120)
    assert_clean_error(res, "available")
    with pytest.raises(UserError, match="available"):   # serve --parallel 100000 --max-ctx 512
        load_engine(EngineConfig(model=str(tiny_dir("llama")), max_ctx=512, parallel="100000"), progress=False)
