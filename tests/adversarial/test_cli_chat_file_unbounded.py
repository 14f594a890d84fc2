"""Hostile review (CLI): generate --chat-file reads the whole file (fh.read()) before anything
checks its size: /dev/zero grows until the OOM killer ends the process (observed: SIGKILL),
a file larger than memory is a MemoryError traceback. The prompt cannot exceed the context
(max_ctx tokens x the longest token's characters), so a bounded read can refuse it at once.
Here the address space is capped so that a 16 GiB (sparse) file cannot be read whole."""
import resource
import subprocess
import sys


def _cap():
    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))


def test_a_chat_file_far_larger_than_the_context_is_refused_without_reading_it(tiny_dir, tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(16 << 30)   # sparse: no disk used
    res = subprocess.run([sys.executable, "-m", "dflash_server", "generate", "--model", str(tiny_dir("llama")),
                          "--chat-file", str(big), "--max-tokens", "2", "--max-ctx", "256"],
                         capture_output=True, text=True, timeout=60, preexec_fn=_cap)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])   # today: 1, MemoryError traceback
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr[-2000:]
    assert "--chat-file" in res.stderr
