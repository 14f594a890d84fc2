"""Native CPU kernels (C++ PyTorch custom ops, ``torch.ops.dflash.*``), built at first use.

On by default (``--kernels aten`` or ``DFLASH_KERNELS=0`` turn them off): row-count
invariant (DFlash is lossless with them), tested against fp64 references, and faster than
the aten path. int8 activations move greedy output on near-ties as llama.cpp's do (see
the README's perplexity and agreement figures).

The sources ship in the package (``csrc/``); the first call of ``load()`` compiles them
with the machine's C++ compiler and ninja into a per-user cache keyed by the sources, the
torch and Python versions (a progress line on stderr, ~1 min on 2 cores), and later runs
load the cached library at once. Where that cannot work (no compiler, no ninja, a failed
build) ``load()`` warns once and returns False; callers keep the
aten path. The ops pick their instruction set at run time (AMX tiles for ``qmm`` of 6+ rows
on Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q8_0 weights, AVX-512 VNNI, AVX-VNNI, AVX2+FMA, portable C++), all
bit-identical; ``DFLASH_KERNELS_ISA=<name in ISAS>`` caps the choice (benchmarks compare paths
with it). The weights' prefetch hint is chosen per CPU maker (NTA on AMD, into L2 elsewhere;
``DFLASH_KERNELS_PREFETCH=nta|l2`` overrides it): it moves memory earlier, never a result.

Ops: ``qmm(x, w, qtype, n, k)`` (quantized matmul on Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K; see ``csrc/qmm.cpp``), ``repack(blocks, qtype, n, k)`` (GGUF blocks -> the layout
``qmm`` reads; Q5_0/Q5_1 and the K-quants repack in ``kquants.py``), ``decoder_layer``
(``csrc/layer.cpp``: a Llama/Qwen3/Qwen3.5-style attention layer of a decode or verify
block in one call; ``decoder_stack``: consecutive such layers in one call),
``rms_norm(x, w, eps)`` (``csrc/norms.cpp``), ``silu_mul(h, inter)`` (``csrc/act.cpp``: SwiGLU's
activation over the gate/up output), ``argmax(x)`` (``csrc/argmax.cpp``: greedy picks) and ``attention_step(qkv, cos, sin, k_cache,
v_cache, start, nh, nkv, scale)`` (``csrc/attention.cpp``: RoPE, KV write and causal
attention of a decode or verify block in one call). ``attention_rows`` and
``decoder_layer_rows`` are their forms for one decode row of each of several sequences,
each in its own lane of a KV bank (continuous batching). ``attention_step`` / ``decoder_layer``
also take a DDTree (``tree``: each row's parent row). ``gdn_step`` (``csrc/gdn.cpp``) is a
Gated DeltaNet mixer of a decode / verify block between its projections, token by token.
``draft_pass`` (``csrc/draft.cpp``) is a DFlash draft's pass over one block with its context
update and LM head in one call.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("dflash_server.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("qmm.cpp", "norms.cpp", "act.cpp", "argmax.cpp", "sample.cpp", "attention.cpp", "layer.cpp", "gdn.cpp", "draft.cpp")
HEADERS = ("ops.h", "simd.h")
# -fopenmp: at::parallel_for is an OpenMP pragma in ATen's headers (serial without it); the
# GOMP symbols resolve to the runtime torch already loaded. -ffp-contract=off: no a * b + c
# is fused behind our back, so the instruction-set builds round alike (fma only where written)
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-ffp-contract=off")
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # ggml ids
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256 values
PY_REPACK = ("Q5_0", "Q5_1", *K_QUANTS)  # repacked by kquants.py (bit fields unpacked by vector ops)
GROUP_BLOCK_BYTES = {2: 160, 3: 160, 6: 192, 7: 192, 8: 272, 12: 176, 13: 208, 14: 224}  # per block of 32, 8 rows
ISAS = ("portable", "avx2", "avx-vnni", "avx512-vnni", "amx")

_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    base = os.environ.get("DFLASH_KERNELS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dflash-server")
    return Path(base) / "kernels"


def _build_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{sys.platform}|{CFLAGS}".encode())
    return h.hexdigest()[:16]


def enabled() -> bool:
    """Whether quantized linears should use the native kernels: yes unless
    ``DFLASH_KERNELS=0`` (the CLI's ``--kernels aten`` sets it, so shard workers it spawns
    inherit it)."""
    return os.environ.get("DFLASH_KERNELS", "1") != "0"


def inference(*tensors: torch.Tensor) -> bool:
    """True when no gradient is wanted through ``tensors``: the ops have no backward (used
    by training, a draft's norms must stay on aten's differentiable path)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _why_not() -> str | None:
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"):
        return f"no kernels for {sys.platform}/{os.uname().machine} yet"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found)"
    return None


def _build() -> None:
    import fcntl

    from torch.utils import cpp_extension

    key = _build_key()
    out = cache_dir() / key
    out.mkdir(parents=True, exist_ok=True)
    name = f"dflash_kernels_{key}"
    lib = out / f"{name}.so"
    if lib.is_file():
        torch.ops.load_library(str(lib))
        return
    # one build at a time per cache folder, under a lock the kernel drops when its holder dies:
    # torch's own build lock is a file that a killed build (Ctrl-C at first start) leaves
    # behind, and every later start would wait on it forever
    with open(out / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if lib.is_file():  # another process built it while we waited
            torch.ops.load_library(str(lib))
            return
        stale = out / "lock"
        if stale.exists():  # we hold the only build lock: nobody is building
            stale.unlink()
        if shutil.which("ninja") is None and not _venv_ninja():
            raise RuntimeError("ninja not found (pip install ninja)")
        print(f"dflash-server: building native kernels (once, cached in {out}) ...", file=sys.stderr, flush=True)
        cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES], build_directory=str(out),
                           extra_cflags=list(CFLAGS), is_python_module=False, verbose=False)
        print("dflash-server: native kernels built", file=sys.stderr, flush=True)


def _venv_ninja() -> bool:
    """pip's ninja lives next to this interpreter even when the venv is not activated."""
    candidate = Path(sys.executable).with_name("ninja")
    if candidate.is_file():
        os.environ["PATH"] = f"{candidate.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return True
    return False


def load() -> bool:
    """Build or load the kernels once per process; False (with one warning) when they
    cannot be had on this machine."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        why = _why_not()
        if why is None:
            try:
                _build()
                _register_fakes()
            except Exception as e:  # noqa: BLE001 - any build failure means the fallback
                why = f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
        if why is not None:
            log.warning("native kernels unavailable (%s); using the aten kernels", why)
        _state["ok"] = why is None
        _state["why"] = why
        return _state["ok"]


def status() -> dict:
    """For /props and benchmarks: whether the kernels are in use, and which instruction set."""
    ok = _state.get("ok")
    out = {"enabled": enabled(), "native": bool(ok), "reason": _state.get("why")}
    if ok:
        out["isa"] = ISAS[torch.ops.dflash.isa()]
        out["prefetch"] = torch.ops.dflash.prefetch()
    return out


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (the ops allocate their outputs)."""
    if _state.get("fakes"):
        return

    @torch.library.register_fake("dflash::qmm")
    def _qmm_fake(x, w, qtype, n, k, isa=-1):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("dflash::qmm_fused")
    def _qmm_fused_fake(x, w, qtype, n, k, norm_weight=None, eps=1e-6, silu=False, residual=None):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("dflash::rms_norm")
    def _rms_norm_fake(x, w, eps, portable=False):
        return x.new_empty(x.shape)  # contiguous, as the op returns

    @torch.library.register_fake("dflash::silu_mul")
    def _silu_mul_fake(h, inter, portable=False):
        return h.new_empty((*h.shape[:-1], inter))

    @torch.library.register_fake("dflash::attention_step")
    def _attention_step_fake(qkv, cos, sin, k_cache, v_cache, start, nh, nkv, scale, portable=False, q_norm=None,
                             k_norm=None, norm_eps=1e-6, gated=False, window=0, v_norm=False, tree=None,
                             write_rows=None, key_rows=None, key_counts=None, mass=None, q_out=None,
                             mass_keys=None):
        return qkv.new_empty((qkv.shape[0], qkv.shape[1], nh * k_cache.shape[-1]))

    @torch.library.register_fake("dflash::attention_rows")
    def _attention_rows_fake(qkv, cos, sin, k_bank, v_bank, lanes, positions, nh, nkv, scale, portable=False,
                             q_norm=None, k_norm=None, norm_eps=1e-6, gated=False, window=0, v_norm=False,
                             tree=None, write_rows=None, key_rows=None, key_counts=None, mass=None, q_out=None,
                             mass_keys=None):
        return qkv.new_empty((qkv.shape[0], qkv.shape[1], nh * k_bank.shape[-1]))

    @torch.library.register_fake("dflash::gdn_step")
    def _gdn_step_fake(mixed, conv, conv_w, neg_a, dt_bias, norm_w, eps, ssm, hk, hv, dk, dv, portable=False):
        return (mixed.new_empty((mixed.shape[0], mixed.shape[1], hv * dv)), conv.new_empty(conv.shape),
                ssm.new_empty(ssm.shape))

    @torch.library.register_fake("dflash::decoder_layer")
    def _decoder_layer_fake(x, *args, **kwargs):
        return x.new_empty(x.shape)

    @torch.library.register_fake("dflash::decoder_layer_rows")
    def _decoder_layer_rows_fake(x, *args, **kwargs):
        return x.new_empty(x.shape)

    @torch.library.register_fake("dflash::decoder_stack")
    def _decoder_stack_fake(x, weights, k_caches, v_caches, ints, floats, cos, sin, start, capture, tree=None,
                            lanes=None, positions=None, write_rows=None, key_rows=None, key_counts=None, mass=None,
                            q_out=None, mass_keys=None):
        return [x.new_empty(x.shape) for _ in range(1 + len(capture))]

    @torch.library.register_fake("dflash::draft_pass")
    def _draft_pass_fake(x, features, ctx_start, fc_w, fc_t, hidden_norm, hn_eps, weights, k_caches, v_caches, ints,
                         floats, cos, sin, norm_w, norm_eps, head_w=None, head_t=0, head_n=0):
        rows = x.shape[1] - 1 if head_w is not None and x.shape[1] > 1 else 0
        return [x.new_empty(x.shape), x.new_empty((1, rows, head_n) if rows else (0,))]

    @torch.library.register_fake("dflash::argmax")
    def _argmax_fake(x, portable=False):
        return x.new_empty(x.shape[:-1], dtype=torch.long)

    @torch.library.register_fake("dflash::repack")
    def _repack_fake(blocks, qtype, n, k):
        return blocks.new_empty(packed_shape(qtype, n, k))

    _state["fakes"] = True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, natively on the CPU where the kernels are built (``csrc/argmax.cpp``:
    the same indices, NaN and ties included; ~10x faster over a vocabulary's logits)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.numel() \
            and enabled() and load():
        return torch.ops.dflash.argmax(x)
    return x.argmax(-1)


def softmax_t(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(x / temperature)`` over the last dimension, in fp32: natively on the CPU where
    the kernels are built (``csrc/sample.cpp``: one pass for the maximum, one for the exps and
    their sum; ~8x aten's time over a vocabulary's logits), else aten's. -inf logits get
    probability 0; a row with a NaN, or with no finite logit, is NaN, as aten gives it."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.numel() \
            and not x.requires_grad and enabled() and load():
        return torch.ops.dflash.softmax_t(x, 1.0 / temperature)
    return torch.softmax(x.float() / temperature, dim=-1)


def draw(weights: torch.Tensor, u: float) -> int | None:
    """The inverse-CDF draw ``u`` in [0, 1) picks from 1-D non-negative ``weights``: the first
    index whose running sum (fp64) passes ``u`` times the total, natively on the CPU
    (``csrc/sample.cpp``); None where the caller takes aten's path: no kernels, another device
    or dtype, or weights whose total is 0 or not finite."""
    if weights.device.type == "cpu" and weights.dim() == 1 and weights.numel() \
            and weights.dtype in (torch.float32, torch.float64) and enabled() and load():
        i = int(torch.ops.dflash.draw(weights, float(u)))
        return i if i >= 0 else None
    return None


def top_p_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(probabilities, ids) of the best tokens of 1-D fp32 ``probs``, sorted (most likely first,
    ties by id), that hold every token top-p at ``top_p`` keeps and the next ones (``csrc/sample.cpp``:
    one pass, then a sort of the candidates); None where the caller's own search must run (no
    kernels, another device or dtype, a NaN, or a margin that takes the whole vocabulary)."""
    if probs.device.type == "cpu" and probs.dim() == 1 and probs.numel() and probs.dtype == torch.float32 \
            and 0.0 < top_p < 1.0 and enabled() and load():
        got = torch.ops.dflash.top_p_candidates(probs, float(top_p))
        return (got[0], got[1]) if got else None
    return None


def packed_shape(qtype: int, n: int, k: int) -> tuple[int, int]:
    """Shape of the layout ``qmm`` reads: groups of 8 rows, per block of 32 values the 8
    rows' codes and scales (``csrc/qmm.cpp``)."""
    return (n + 7) // 8, (k // 32) * GROUP_BLOCK_BYTES[qtype]


def supports(qtype_name: str, n: int, k: int) -> bool:
    return qtype_name in QTYPES and k % (256 if qtype_name in K_QUANTS else 32) == 0 and n > 0


# --- weights in the kernels' formats ------------------------------------------------------
@dataclass(frozen=True)
class PackedRows:
    """A weight matrix as stored GGUF blocks: ``rows`` (N, bytes per row) uint8."""
    qtype: str
    rows: torch.Tensor

    def cat(self, others: list["PackedRows"]) -> "PackedRows | None":
        """Rows of several matrices stacked (fused projections); None if the types differ."""
        if any(o.qtype != self.qtype or o.rows.shape[1] != self.rows.shape[1] for o in others):
            return None
        return PackedRows(self.qtype, torch.cat([self.rows, *(o.rows for o in others)]))


def _halves(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8).reshape(*t.shape, 2)


def blocks_q4_1(weight: torch.Tensor) -> PackedRows:
    """The project's own 4-bit format for float weights, as GGUF Q4_1 blocks (w = d * q + m,
    q in 0..15 per 32 values; the scheme ``--quantize int4`` always used)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // 32, 32)
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)
    return PackedRows("Q4_1", torch.cat([_halves(d), _halves(lo), codes], dim=-1).reshape(n, -1))


def blocks_q8_0(weight: torch.Tensor) -> PackedRows:
    """Float weights as GGUF Q8_0 blocks (w = d * q, q in -127..127 per 32 values)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // 32, 32)
    d = w.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return PackedRows("Q8_0", torch.cat([_halves(d), q], dim=-1).reshape(n, -1))


def repack(p: PackedRows, k: int) -> tuple[int, torch.Tensor]:
    """(qtype id, the layout ``qmm`` reads) of GGUF rows."""
    qtype = QTYPES[p.qtype]
    if p.qtype in PY_REPACK:
        from .kquants import repack as repack_k

        return qtype, repack_k(p.qtype, p.rows, k)
    return qtype, torch.ops.dflash.repack(p.rows.contiguous().reshape(-1), qtype, p.rows.shape[0], k)
