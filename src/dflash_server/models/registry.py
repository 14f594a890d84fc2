"""Family registry: HF ``architectures[0]`` / ``model_type`` and GGUF
``general.architecture`` -> family. New families register here."""
from __future__ import annotations

from .base import Family
from .gemma3 import Gemma3Family
from .gemma4 import Gemma4Family
from .laguna import LagunaFamily
from .llama import LlamaFamily
from .qwen3 import Qwen3Family
from .qwen3_5 import Qwen3_5Family

FAMILIES: tuple[Family, ...] = (LlamaFamily(), Qwen3Family(), Qwen3_5Family(), Gemma3Family(),
                                 Gemma4Family(), LagunaFamily())


def family_for_hf_config(cfg: dict) -> Family:
    archs = cfg.get("architectures") or []
    for fam in FAMILIES:
        if archs and archs[0] in fam.hf_architectures:
            return fam
    mtype = cfg.get("model_type")
    for fam in FAMILIES:
        if mtype in fam.hf_model_types:
            return fam
    known = sorted(a for f in FAMILIES for a in f.hf_architectures)
    raise ValueError(f"unknown architecture {archs[0] if archs else mtype!r}; supported: {', '.join(known)}")


def family_for_gguf_arch(arch: str) -> Family:
    for fam in FAMILIES:
        if arch in fam.gguf_archs:
            return fam
    known = sorted(a for f in FAMILIES for a in f.gguf_archs)
    raise ValueError(f"unknown GGUF architecture {arch!r}; supported: {', '.join(known)}")
