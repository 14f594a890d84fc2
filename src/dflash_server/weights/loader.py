"""Open a model (HF directory or .gguf): family, config, tensors by HF name, tokenizer."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from ..models.base import Family, Slab
from ..models.config import ModelConfig
from ..models.registry import family_for_gguf_arch, family_for_hf_config
from .tokenizer import Tokenizer


@dataclass
class ModelSource:
    """Everything needed to build stages; tensors are only read when a stage asks."""

    path: Path
    format: str  # "hf" | "gguf"
    family: Family
    config: ModelConfig
    tokenizer: Tokenizer
    _backend: object

    def has(self, name: str) -> bool:
        if self.format == "hf":
            return self._backend.has(name)
        try:
            gname, _ = self.family.gguf_tensor(name, self.config)
        except KeyError:
            return False
        return self._backend.has(gname)

    def get(self, name: str) -> torch.Tensor:
        if self.format == "hf":
            return self._backend.get(name)
        try:
            gname, transform = self.family.gguf_tensor(name, self.config)
        except KeyError:
            raise ModelLoadError(f"{self.path}: no GGUF mapping for weight {name!r}") from None
        if isinstance(transform, Slab):
            return self._backend.get(gname, transform.index)
        t = self._backend.get(gname)
        return transform(t) if transform is not None else t

    def packed(self, name: str):
        """The stored blocks of a quantized GGUF matrix the native kernels read
        (``PackedRows``), with the same row order ``get`` gives; None for other weights
        (HF files, float or unsupported types, or a transform that is not a row permutation)."""
        from ..kernels import QTYPES, PackedRows

        if self.format != "gguf":
            return None
        try:
            gname, transform = self.family.gguf_tensor(name, self.config)
            slab = transform.index if isinstance(transform, Slab) else None
            qtype, rows = self._backend.raw_rows(gname, slab)
        except (KeyError, ModelLoadError):
            return None
        if qtype not in QTYPES:
            return None
        if transform is not None and slab is None:  # usable only if it moves whole rows: probe it with indices
            n, k = self._backend.tensors[gname].shape
            probe = torch.arange(n * k, dtype=torch.float64).reshape(n, k)
            try:
                out = transform(probe)
            except Exception:  # noqa: BLE001 - any transform we cannot follow: no packed form
                return None
            first = out[:, :1]
            if out.shape != (n, k) or not torch.equal(out, first + torch.arange(k, dtype=torch.float64)) or \
                    not torch.equal(first % k, torch.zeros_like(first)):
                return None  # it mixes columns: only the dequantized weight is right
            rows = rows[(first[:, 0] // k).long().numpy()]
        return PackedRows(qtype, torch.from_numpy(np.array(rows)))

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor's shape by its name in the file (GGUF or HF names), for memory
        estimates before anything is loaded."""
        if self.format == "gguf":
            return {n: t.shape for n, t in self._backend.tensors.items()}
        return self._backend.shapes()

    def source_type(self, name: str) -> str | None:
        """The stored GGUF quantization type of a weight (None for HF safetensors)."""
        if self.format != "gguf":
            return None
        return self._backend.tensor_type(self.family.gguf_tensor(name, self.config)[0])

    def sampling_defaults(self) -> dict:
        """Sampling settings the model ships with (generation_config.json / GGUF metadata)."""
        from .generation_config import sampling_defaults

        return sampling_defaults(self.path, self.format, self._backend.meta if self.format == "gguf" else None)

    def fingerprint(self, mtime: bool = True) -> str:
        """Identity of the weights: file names, sizes and mtimes (cheap; no hashing of GBs).
        Without ``mtime`` (a shard worker's copy on another host): names, sizes and sampled
        bytes of each file (its first and last 64 KiB and 16 pieces of 4 KiB spread through
        it), so other weights of the same shapes (another fine-tune, a corrupt copy) do not
        compare equal where mtimes cannot tell."""
        h = hashlib.sha256()
        files = [self.path] if self.path.is_file() else sorted(self.path.iterdir())
        for f in files:
            if f.is_file():
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}".encode() + (f":{int(st.st_mtime)}".encode() if mtime else b""))
                if not mtime:
                    h.update(_sampled_bytes(f, st.st_size))
        return h.hexdigest()[:16]


def _sampled_bytes(path: Path, size: int, edge: int = 64 << 10, piece: int = 4 << 10, pieces: int = 16) -> bytes:
    """A file's first and last ``edge`` bytes and ``pieces`` reads of ``piece`` bytes spread
    evenly between them (the whole file when it is small)."""
    with open(path, "rb") as fh:
        if size <= 2 * edge + pieces * piece:
            return fh.read()
        out = [fh.read(edge)]
        for i in range(1, pieces + 1):
            fh.seek(edge + (size - 2 * edge - piece) * i // (pieces + 1))
            out.append(fh.read(piece))
        fh.seek(size - edge)
        out.append(fh.read(edge))
        return b"".join(out)


def open_model(path: str | Path) -> ModelSource:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        from .gguf_file import GGUFFile

        gf = GGUFFile(path)
        try:
            family = family_for_gguf_arch(gf.arch)
            config = family.config_from_gguf(gf.meta, gf.arch)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{path}: {e}") from None
        tokenizer = Tokenizer.from_gguf_meta(gf.meta)
        return ModelSource(path, "gguf", family, config, tokenizer, gf)
    from .hf_dir import SafetensorsDir

    d = SafetensorsDir(path)
    try:
        family = family_for_hf_config(d.config)
        config = family.config_from_hf(d.config)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    tokenizer = Tokenizer.from_hf_dir(path, d.config)
    return ModelSource(path, "hf", family, config, tokenizer, d)
