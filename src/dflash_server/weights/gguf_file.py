"""GGUF file access: metadata dict and dequantized tensors by GGUF name."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class GGUFFile:
    def __init__(self, path: Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file")
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:  # the reader raises ValueError/IndexError/etc. on damaged files
            raise ModelLoadError(f"{self.path}: not a valid GGUF file ({type(e).__name__}: {e})") from None
        from .gguf_tokenizer import gguf_metadata_dict

        self.meta = gguf_metadata_dict(self.reader)
        self.tensors = {t.name: t for t in self.reader.tensors}
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise ModelLoadError(f"{self.path}: truncated (tensor {t.name} runs past end of file)")

    @property
    def arch(self) -> str:
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: GGUF has no general.architecture")
        return arch

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def get(self, name: str) -> torch.Tensor:
        """Dequantized fp32 (or fp16/bf16 as stored) tensor in PyTorch (out, in) order."""
        import gguf

        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported type {kind}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if kind in ("F32", "F16"):
            arr = np.asarray(t.data)
            out = torch.from_numpy(arr.copy())
        else:
            out = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))
        if tuple(out.shape) != shape:
            out = out.reshape(shape)
        return out
