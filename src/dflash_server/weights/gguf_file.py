"""GGUF file access: metadata dict and dequantized tensors by GGUF name."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class GGUFFile:
    def __init__(self, path: Path):
        from .gguf_parse import parse_gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file")
        try:
            header = parse_gguf(self.path)
        except (ValueError, OSError, OverflowError, MemoryError) as e:
            raise ModelLoadError(f"{self.path}: not a valid GGUF file ({e})") from None
        self.meta, self.tensors = header.meta, header.tensors
        for t in self.tensors.values():
            if t.offset + t.nbytes > header.file_size:
                raise ModelLoadError(f"{self.path}: truncated (tensor {t.name} runs past the end of the file)")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")

    @property
    def arch(self) -> str:
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: GGUF has no general.architecture")
        return arch

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor_type(self, name: str) -> str:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.tensors[name].ggml_type).name

    def _slab(self, name: str, slab: int | None):
        """(tensor info, its stored bytes, the matrix shape): the whole tensor, or matrix
        ``slab`` of a 3-D one (llama.cpp stacks a layer's experts: (experts, rows, cols))."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        raw = self._data[t.offset:t.offset + t.nbytes]
        if slab is None:
            return t, raw, tuple(t.shape)
        if len(t.shape) != 3 or not 0 <= slab < t.shape[0]:
            raise ModelLoadError(f"{self.path}: tensor {name} of shape {tuple(t.shape)} has no matrix {slab}")
        size = t.nbytes // t.shape[0]
        return t, raw[slab * size:(slab + 1) * size], tuple(t.shape[1:])

    def raw_rows(self, name: str, slab: int | None = None) -> tuple[str, np.ndarray]:
        """(type name, the stored bytes of a 2-D tensor, or of matrix ``slab`` of a 3-D one,
        as (rows, bytes per row)), a view of the file: blocks exactly as GGUF stores them, for
        kernels that read them."""
        from gguf.constants import GGMLQuantizationType

        t, raw, shape = self._slab(name, slab)
        if len(shape) != 2:
            raise ModelLoadError(f"{self.path}: tensor {name} is not a matrix")
        return GGMLQuantizationType(t.ggml_type).name, raw.reshape(shape[0], raw.size // shape[0])

    def get(self, name: str, slab: int | None = None) -> torch.Tensor:
        """Dequantized tensor (fp32, or fp16 as stored) in PyTorch (out, in) order; with
        ``slab``, only that matrix of a 3-D tensor."""
        import gguf
        from gguf.constants import GGMLQuantizationType

        t, raw, shape = self._slab(name, slab)
        qtype = GGMLQuantizationType(t.ggml_type)
        if qtype.name not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported type {qtype.name}")
        if qtype.name == "F32":
            arr = raw.view(np.float32).reshape(shape)
        elif qtype.name == "F16":
            arr = raw.view(np.float16).reshape(shape)
        else:
            rows = raw.reshape(-1, raw.size // max(1, int(np.prod(shape[:-1])) if len(shape) > 1 else 1))
            arr = gguf.quants.dequantize(rows, qtype).reshape(shape)
        return torch.from_numpy(np.array(arr))
