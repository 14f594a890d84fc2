"""Linear layers with optional weight-only int8 / int4.

Batch-1 decode reads every weight once per token, so it is bound by memory bandwidth:
int8 weights with per-output-channel scales halve the bytes read versus bf16
(``aten._weight_int8pack_mm``, about 2x a bf16 GEMV on the reference 2-core machine), and
int4 with per-32-group scale and offset halves them again
(``aten._weight_int4pack_mm_for_cpu``). The int4 format is the one of GGUF Q4_1
(``w = scale * q + min``, q in 0..15), so Q4_0/Q4_1 weights map onto it without new rounding
of q. Fused projections (QKV, gate+up) are concatenated along the output dimension before
quantizing.

With the native kernels (``kernels``, on by default, built at first use) a quantized linear
on the CPU runs ``dflash::qmm`` instead: a GGUF weight of a type they read (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) keeps its stored blocks (no second rounding), other
weights are quantized to Q4_1 (``int4``) or
Q8_0 (``int8``, per 32 values rather than per channel); activations go to int8 per block
inside the op, and a row's result does not depend on how many rows are computed with it.
The weight the loader hands over carries its stored blocks as ``weight.packed`` (a
callable returning ``kernels.PackedRows`` or None; ``runtime.stage`` attaches it), read only
when ``quantize_`` uses them.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels

log = logging.getLogger("dflash_server")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (int8 (N, K), fp32 scales (N,))."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


INT4_GROUP = 32


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per-group 4-bit: returns (q int32 (N, K) in 0..15, scales_and_zeros (K/g, N, 2) fp32)
    such that ``w ~= (q - 8) * scale + zero`` (the layout torch's int4 kernels use)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous()


def int4_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.shape[0] % 16 == 0 and weight.shape[1] % INT4_GROUP == 0


def cuda_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int4 weight in the layout of aten's CUDA kernel (``_weight_int4pack_mm``,
    "tinygemm": (q - 8) * scale + zero per 32, bf16 scales), or None where that kernel
    cannot take it (shape rules, no such kernel in this torch build). Self-checked at load:
    the packed weight must multiply a probe like the dequantized one (the nibble order of
    the packing input differs between torch versions, so both are tried); an int4 weight
    that fails the check stays int8 rather than wrong."""
    n, k = weight.shape
    if weight.device.type != "cuda" or n % 8 or k % 128:
        return None
    q, sz = quantize_int4(weight)
    deq = ((q.reshape(n, k // INT4_GROUP, INT4_GROUP) - 8) * sz[..., 0].T[..., None] + sz[..., 1].T[..., None])
    x = torch.randn(4, k, device=weight.device, generator=torch.Generator(weight.device).manual_seed(0))
    x = x.to(torch.bfloat16)
    ref = x.float() @ deq.reshape(n, k).T
    sz16 = sz.to(torch.bfloat16)
    for hi, lo in ((q[:, ::2], q[:, 1::2]), (q[:, 1::2], q[:, ::2])):
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack(((hi << 4) | lo).to(torch.uint8).contiguous(), 8)
            y = torch.ops.aten._weight_int4pack_mm(x, packed, INT4_GROUP, sz16).float()
        except (RuntimeError, NotImplementedError) as e:
            _warn_once(f"int4 on {weight.device} unavailable ({str(e).splitlines()[0]}); int8 instead")
            return None
        if ((y - ref).norm() / ref.norm().clamp(min=1e-6)).item() < 2e-2:
            return packed, sz16
    _warn_once(f"int4 on {weight.device}: a packed weight failed its check; int8 instead")
    return None


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def slice_rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of a weight, keeping its stored GGUF blocks for the native kernels
    (a fused gate/up matrix split in two)."""
    out = t[lo:hi]
    packed = getattr(t, "packed", None)
    if packed is not None:
        def rows():
            p = packed() if callable(packed) else packed
            return None if not isinstance(p, kernels.PackedRows) else kernels.PackedRows(p.qtype, p.rows[lo:hi])
        out.packed = rows
    return out


def _cat_packed(parts):
    """The parts' stored blocks stacked; None if one has none. Parts stored in different
    types (a Q4_K_M file keeps some V projections in Q6_K) cannot share one layout: the
    result is then ``MIXED_4BIT`` or ``MIXED`` and the fused weight is requantized, to Q4_1
    only if every part had 4 bits."""
    rows = [p() if callable(p) else p for p in parts]
    if any(r is None for r in rows):
        return None
    fused = rows[0].cat(rows[1:])
    if fused is None:
        return MIXED_4BIT if all(r.qtype in FOUR_BIT for r in rows) else MIXED
    return fused


FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
MIXED_4BIT, MIXED = "mixed-4bit", "mixed"


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``; ``W`` is (out, in) in the compute dtype, or int8 + scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = getattr(weight, "packed", None)  # GGUF blocks of this weight, if the loader had them
        self.qtype = 0
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.scales: torch.Tensor | None = None
        self.mode = "dense"  # | "int8" | "int4" | "int4-cuda" | "native" (dflash::qmm on GGUF blocks)
        self.out_features, self.in_features = weight.shape

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> "Linear":
        bias = None
        if biases is not None and any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
                              for w, b in zip(weights, biases)])
        w = torch.cat(weights, dim=0)
        parts = [getattr(x, "packed", None) for x in weights]
        if all(p is not None for p in parts):  # read (and stacked) only if quantize_ wants them
            w.packed = lambda: _cat_packed(parts)
        return cls(w, bias)

    def quantize_(self, mode: str = "int8") -> None:
        """Convert in place to weight-only ``int8`` or ``int4`` (int4 falls back to int8 where
        the kernel's shape rules or the device do not allow it). No-op if already quantized."""
        packed, self.packed = self.packed, None
        if self.mode != "dense" or mode == "dense":
            return
        dtype = self.weight.dtype
        if self.weight.device.type == "cpu" and self.in_features % 32 == 0 and kernels.enabled() and kernels.load():
            packed = packed() if callable(packed) else packed
            if not isinstance(packed, kernels.PackedRows) or \
                    not kernels.supports(packed.qtype, self.out_features, self.in_features):
                four = packed == MIXED_4BIT or (mode == "int4" and packed != MIXED)
                packed = (kernels.blocks_q4_1 if four else kernels.blocks_q8_0)(self.weight)
            try:
                self.qtype, blocks = kernels.repack(packed, self.in_features)
            except (RuntimeError, ValueError) as e:  # e.g. a Q4_0 scale whose offset fp16 cannot hold: aten here
                log.warning("native kernels: %s; this linear keeps the aten path", e)
            else:
                self.weight = nn.Parameter(blocks, requires_grad=False)
                self.mode = "native"
                return
        if mode == "int4" and self.weight.device.type == "cuda" and (got := cuda_int4(self.weight)) is not None:
            self.weight = nn.Parameter(got[0], requires_grad=False)
            self.scales = got[1]
            self.mode = "int4-cuda"
            return
        if mode == "int4" and int4_supported(self.weight):
            q, sz = quantize_int4(self.weight)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.scales = sz.to(dtype)
            self.mode = "int4"
            return
        q, s = quantize_int8(self.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scales = s.to(dtype)  # the kernel wants scales in the activation dtype
        self.mode = "int8"

    @property
    def fusable(self) -> bool:
        """Whether a fused native op (``decoder_layer``, ``qmm_fused``, ``draft_pass``) can take
        this matrix in place of the layer's call: GGUF blocks on the native kernels, no bias."""
        return self.mode == "native" and self.bias is None

    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * self.scales.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "dense":
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.mode == "native":
            y = torch.ops.dflash.qmm(x2, self.weight, self.qtype, self.out_features, self.in_features)
        elif self.mode == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, INT4_GROUP, self.scales)
        elif self.mode == "int4-cuda":  # the kernel takes bf16 activations only
            y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16), self.weight, INT4_GROUP,
                                                   self.scales).to(x2.dtype)
        elif x2.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        else:  # no fused kernel assumed elsewhere: dequantize on the fly
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)
