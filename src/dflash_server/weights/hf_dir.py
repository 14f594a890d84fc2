"""Hugging Face model directory: config.json + (sharded) safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelLoadError

# Prefixes that multimodal wrappers put in front of the text model's weights.
_PREFIX_ALIASES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))


def _canonical(name: str) -> str:
    for old, new in _PREFIX_ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class SafetensorsDir:
    """Lazy tensor access by canonical HF name; only the tensors asked for are read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{self.path}: no config.json (not a Hugging Face model directory)")
        try:
            self.config = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{cfg_path}: cannot parse config.json: {e}") from None
        if not isinstance(self.config, dict):
            raise ModelLoadError(f"{cfg_path}: not a JSON object")
        index = self.path / "model.safetensors.index.json"
        files: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{index}: bad index file: {e}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                          for k, v in weight_map.items()):
                raise ModelLoadError(f"{index}: bad index file: weight_map is not a map of names to files")
            files = {_canonical(k): v for k, v in weight_map.items()}
            shards = sorted(set(files.values()))
        else:
            shards = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shards:
                raise ModelLoadError(f"{self.path}: no *.safetensors weight files")
        self._handles = {}
        for shard in shards:
            fp = self.path / shard
            if not fp.is_file():
                raise ModelLoadError(f"{fp}: weight shard listed in the index is missing")
            try:
                self._handles[shard] = safe_open(str(fp), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers/truncation
                raise ModelLoadError(f"{fp}: corrupt or truncated safetensors file ({e})") from None
        if not files:
            for shard, h in self._handles.items():
                files.update({_canonical(k): shard for k in h.keys()})
        self._raw_names = {}
        for shard, h in self._handles.items():
            for k in h.keys():
                self._raw_names[_canonical(k)] = k
        self._files = {k: v for k, v in files.items() if k in self._raw_names}

    def names(self) -> list[str]:
        return list(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape, from the safetensors headers (nothing is read)."""
        return {n: tuple(self._handles[f].get_slice(self._raw_names[n]).get_shape()) for n, f in self._files.items()}

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise ModelLoadError(f"{self.path}: weight {name!r} is missing")
        try:
            return self._handles[self._files[name]].get_tensor(self._raw_names[name])
        except Exception as e:
            raise ModelLoadError(f"{self.path}: cannot read weight {name!r} ({e}); file truncated?") from None

    def nbytes(self) -> int:
        return sum((self.path / s).stat().st_size for s in self._handles)
