"""Hostile review (2026-11-27). A GGUF header is read with every count bounded by the bytes left in the file: a tiny
hostile file is a clean ModelLoadError, never a huge allocation or an OverflowError."""
import struct
import subprocess
import sys
import textwrap

import pytest


def _s(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def _array_count(path):        # a u8 metadata array claiming 2**64-1 elements
    body = struct.pack("<IQQ", 3, 0, 1) + _s("general.architecture") + struct.pack("<I", 9) + \
        struct.pack("<IQ", 0, 2 ** 64 - 1)
    path.write_bytes(b"GGUF" + body + b"\0" * 64)


def _n_dims(path):             # one tensor claiming 2**32-1 dimensions (a ~200-byte file)
    body = struct.pack("<IQQ", 3, 1, 1) + _s("general.architecture") + struct.pack("<I", 8) + _s("llama") + \
        _s("t") + struct.pack("<I", 2 ** 32 - 1)
    path.write_bytes(b"GGUF" + body + b"\0" * 64)


def _n_kv(path):               # 2**62 metadata keys claimed in a tiny file
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2 ** 62) + b"\0" * 64)


def _string_array(path):       # an array of 2**40 strings
    body = struct.pack("<IQQ", 3, 0, 1) + _s("tokenizer.ggml.tokens") + struct.pack("<I", 9) + \
        struct.pack("<IQ", 8, 2 ** 40)
    path.write_bytes(b"GGUF" + body + b"\0" * 64)


@pytest.mark.parametrize("make", [_array_count, _n_dims, _n_kv, _string_array])
def test_hostile_counts_are_a_clean_error(tmp_path, make):
    p = tmp_path / "bad.gguf"
    make(p)
    # in a child limited to 2 GiB of address space, so the unfixed parser fails with MemoryError
    # instead of taking the machine's memory
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from dflash_server.errors import ModelLoadError
        from dflash_server.weights.gguf_file import GGUFFile
        try:
            GGUFFile({str(p)!r})
        except ModelLoadError as e:
            print("clean:", e); sys.exit(0)
        except BaseException as e:
            print("raw:", type(e).__name__, e); sys.exit(1)
        sys.exit(3)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
