"""Hostile review (CLI): serve reads --api-key-file and --chat-template-file with
Path.read_text() and catches OSError only: a file that is not UTF-8 is a
UnicodeDecodeError traceback instead of one error line."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("flag", ["--api-key-file", "--chat-template-file"])
def test_a_non_utf8_file_is_one_clean_error(tmp_path, flag):
    f = tmp_path / "f"
    f.write_bytes(b"key\xff\xfe0123456789abcdef{{ 1 }}")
    res = subprocess.run([sys.executable, "-m", "dflash_server", "serve", "--port", "0", flag, str(f)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and flag in res.stderr, res.stderr
