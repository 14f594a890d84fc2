"""Hostile review (CLI): train-draft bad inputs that end in a traceback instead of one line:
--out a symbolic-link loop (Path.resolve RuntimeError), --temperature nan (torch.multinomial
RuntimeError after the model loaded and sampling began: --temperature / --top-p are never
checked; --top-p nan is silently accepted), and a --prompts line without "messages"
(KeyError)."""
import os
import subprocess
import sys

import pytest

FAST = ["--samples", "1", "--max-new-tokens", "2", "--gen-batch", "1", "--steps", "1", "--eval-prompts", "0",
        "--batch", "1", "--anchors", "1"]


def run_train(tiny_dir, out, *extra):
    return subprocess.run([sys.executable, "-m", "dflash_server", "train-draft", "--model", str(tiny_dir("llama")),
                           "--out", str(out), *FAST, *extra], capture_output=True, text=True, timeout=120)


def assert_clean(res, needle):
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, (res.returncode, res.stderr[-2000:])
    assert needle in res.stderr, res.stderr


def test_out_symlink_loop(tiny_dir, tmp_path):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    assert_clean(run_train(tiny_dir, tmp_path / "a"), "--out")


@pytest.mark.parametrize("flag", ["--temperature", "--top-p"])
def test_nan_sampling_flags(tiny_dir, tmp_path, flag):
    assert_clean(run_train(tiny_dir, tmp_path / "out", flag, "nan"), flag)


def test_prompt_line_without_messages(tiny_dir, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hi"}\n')
    assert_clean(run_train(tiny_dir, tmp_path / "out", "--prompts", str(p)), "--prompts")


@pytest.mark.parametrize("block", ["1", "65"])
def test_train_draft_block_size_bounds(block):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dflash_server", "train-draft", "--out", "unused", "--block-size", block],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--block-size" in r.stderr, r.stderr


@pytest.mark.parametrize("extra, needle", [(["--gen-batch", "4", "--continuations", "3"], "does not divide"),
                                           (["--continuations", "0"], "--continuations"),
                                           (["--continuations", "x"], "--continuations")])
def test_bad_continuations(tiny_dir, tmp_path, extra, needle):
    res = run_train(tiny_dir, tmp_path / "out", *extra)
    assert "Traceback" not in res.stderr and res.returncode == 2 and needle in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("value", ["17", "0", "x"])
def test_bad_soft_k(tiny_dir, tmp_path, value):
    res = run_train(tiny_dir, tmp_path / "out", "--labels", "soft", "--soft-k", value)
    assert "Traceback" not in res.stderr and res.returncode == 2 and "--soft-k" in res.stderr, res.stderr[-2000:]


def _rewrite_shards(data, edit):
    from safetensors.torch import load_file, save_file

    shards = sorted(data.glob("data-*.safetensors"))
    assert shards
    for f in shards:
        save_file(edit(load_file(str(f))), str(f))


def test_soft_labels_on_a_dataset_without_them_or_with_bad_ones(tiny_dir, tmp_path):
    """--labels soft on data sampled before soft labels were stored: one line, no traceback;
    soft labels that do not match the shard's tokens: a corrupt shard, not a crash."""
    out = tmp_path / "out"
    res = run_train(tiny_dir, out, "--data-only", "--samples", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    _rewrite_shards(out / "data", lambda t: {k: v for k, v in t.items() if not k.startswith("soft_")})
    assert_clean(run_train(tiny_dir, out, "--labels", "soft"), "soft")
    res = run_train(tiny_dir, out, "--labels", "greedy")   # the same data trains on argmax labels
    assert res.returncode == 0, res.stderr[-2000:]
    out2 = tmp_path / "out2"
    assert run_train(tiny_dir, out2, "--data-only", "--samples", "2").returncode == 0
    _rewrite_shards(out2 / "data", lambda t: {**t, "soft_p": t["soft_p"][1:].contiguous()})
    assert_clean(run_train(tiny_dir, out2, "--labels", "soft"), "corrupt dataset shard")


def test_sampling_that_can_never_give_a_sample_stops_with_one_line(tiny_dir, tmp_path):
    """--max-new-tokens 1 (a sample needs a response of 2+ tokens) looped forever over the
    prompts; now one line after a whole pass gave nothing. A prompts file with no training
    prompt (all held out) is one line too."""
    res = run_train(tiny_dir, tmp_path / "out", "--max-new-tokens", "1")
    assert_clean(res, "gave no sample")
    p = tmp_path / "held.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "hi"}], "split": "heldout"}\n')
    assert_clean(run_train(tiny_dir, tmp_path / "out2", "--prompts", str(p)), "no training prompts")


def test_a_prompt_longer_than_the_context_is_skipped(tiny_dir, tmp_path):
    """A prompt that leaves no room in the target's context gives no sample and sampling goes
    on with the others (the tiny target's context is 1024 positions)."""
    import json
    p = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": "word " * 1500}]},
            {"messages": [{"role": "user", "content": "Say hello."}]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_train(tiny_dir, tmp_path / "out", "--prompts", str(p), "--samples", "4", "--gen-batch", "2",
                    "--data-only")
    assert res.returncode == 0, res.stderr[-2000:]
    man = json.loads((tmp_path / "out" / "data" / "dataset.json").read_text())
    assert man["samples"] == 4 and man["prompts_done"] >= 3          # the long one visited, skipped
    from dflash_server.spec.train_data import load_dataset
    assert all(s.prompt_len < 100 for s in load_dataset(tmp_path / "out" / "data")[1])
