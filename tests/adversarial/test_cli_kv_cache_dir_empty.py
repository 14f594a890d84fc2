"""Hostile review (CLI): --kv-cache-dir "" (an unset shell variable: --kv-cache-dir "$CACHE")
is not None, so the disk cache opens Path("") = the working directory: it is marked as a
cache (.dflash-cache) and snapshot folders are written there. --api-key "" is refused for
the same reason; a blank cache folder should be too."""
import subprocess
import sys


def test_blank_kv_cache_dir_is_refused_and_writes_nothing(tiny_dir, tmp_path):
    res = subprocess.run([sys.executable, "-m", "dflash_server", "generate", "--model", str(tiny_dir("llama")),
                          "--prompt", "hi", "--max-tokens", "2", "--kv-cache-dir", ""],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())   # today: .dflash-cache + a model folder
    assert res.returncode == 2 and "--kv-cache-dir" in res.stderr, (res.returncode, res.stderr)
