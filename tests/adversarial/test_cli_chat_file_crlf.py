"""Hostile review (2026-11-28). generate --chat-file used to read the file in text mode (universal
newlines: a Windows-written file's CRLF became LF, the same prompt as --chat with that text); since
read_text_file (cli/common.py) decodes the raw bytes, every line of a CRLF file carries a '\\r' into
the prompt: other tokens, another answer, for the same document."""
import json
import subprocess
import sys


def prompt_tokens(model, path):
    res = subprocess.run([sys.executable, "-m", "dflash_server", "generate", "--model", str(model), "--dtype", "fp32",
                          "--threads", "1", "--chat-file", str(path), "--max-tokens", "1", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])["prompt_tokens"]


def test_crlf_chat_file_is_the_same_prompt_as_lf(tiny_dir, tmp_path):
    model = tiny_dir("llama")
    (tmp_path / "lf.txt").write_bytes(b"line one\nline two\nWhat is it?")
    (tmp_path / "crlf.txt").write_bytes(b"line one\r\nline two\r\nWhat is it?")
    assert prompt_tokens(model, tmp_path / "crlf.txt") == prompt_tokens(model, tmp_path / "lf.txt")
