"""Hostile review (CLI): a --prompt / --chat / --system argument that is not valid UTF-8 (a
Latin-1 terminal, $(cat latin1.txt)) reaches the tokenizer as a str with lone surrogates
(Python's surrogateescape) and crashes it with a TypeError traceback."""
import os
import subprocess
import sys

import pytest


def run_cli(*args):
    # bytes argv: what a shell passes for "$(printf 'caf\xe9')"
    return subprocess.run([os.fsencode(sys.executable), b"-m", b"dflash_server", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("flag", [b"--prompt", b"--chat", b"--system"])
def test_non_utf8_prompt_argument_is_not_a_traceback(tiny_dir, flag):
    extra = [b"--chat", b"hi"] if flag == b"--system" else []
    res = run_cli(b"generate", b"--model", os.fsencode(tiny_dir("llama")), *extra, flag, b"caf\xe9",
                  b"--max-tokens", b"2", b"--json")
    assert "Traceback" not in res.stderr, res.stderr
    if res.returncode != 0:   # refused: one clear line naming the flag
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert flag.decode() in res.stderr, res.stderr
