"""Build llama.cpp's tools (llama-bench, llama-perplexity, ...) from the llama-cpp-python sdist (the
peer every speed goal is measured against), once, into ``benchmarks/out/llama.cpp``.

    python benchmarks/llama_cpp.py            # prints the bin directory (builds if needed)

The sdist comes from PyPI (``pip download --no-binary :all:``); its ``vendor/llama.cpp`` is
configured with cmake (``GGML_NATIVE=ON``: this machine's instruction set, as ours uses) and
only the two tools are built (~10 min on 2 cores). Nothing of it is committed.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "llama.cpp"
VERSION = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp is built
TOOLS = ("llama-bench", "llama-perplexity")  # llama-simple on demand (benchmarks/greedy_agreement.py)


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # (-march=native would enable them)


def ensure_built(jobs: int = 2, targets: tuple[str, ...] = TOOLS) -> Path:
    bin_dir = OUT / "build" / "bin"
    if all((bin_dir / t).is_file() for t in targets):
        return bin_dir
    OUT.mkdir(parents=True, exist_ok=True)
    sdist = OUT / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={VERSION}", "-d", str(OUT)], check=True)
    src = OUT / "src"
    if not src.is_dir():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(OUT / "extract", members=members, filter="data")
        shutil.move(next((OUT / "extract").glob("*/vendor/llama.cpp")), src)
        shutil.rmtree(OUT / "extract")
    build = OUT / "build"
    # ggml's AMX code, built natively on an AMX machine (the 2026-11-26 Xeon VM, GCC 12),
    # died with SIGILL at 4+ rows (llama-bench -p 4; -p 1 and tg ran): off, so the peer runs
    # its AVX-512 VNNI path there
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", *targets, f"-j{jobs}"], check=True)
    return bin_dir


if __name__ == "__main__":
    print(ensure_built())
