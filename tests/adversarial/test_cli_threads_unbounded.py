"""Hostile review (CLI): --threads takes any positive integer and hands it to
torch.set_num_threads: 100000 segfaults the process in libgomp (20000: libgomp's
"Thread creation failed" and exit 1; 5000: minutes of thread creation)."""
import subprocess
import sys


def test_absurd_thread_count_is_refused_cleanly(tiny_dir):
    res = subprocess.run([sys.executable, "-m", "dflash_server", "generate", "--model", str(tiny_dir("llama")),
                          "--prompt", "hi", "--max-tokens", "2", "--threads", "100000"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])   # today: -11 (SIGSEGV)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr[-2000:]
    assert "--threads" in res.stderr
