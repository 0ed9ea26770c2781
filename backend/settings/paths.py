"""Where this project keeps what it makes once per machine: LLM_CACHE_DIR (default
~/.cache/tritonllm), holding models/ (the default model, converted: backend/runner/convert.py)
and kernels/ (the compiled CPU kernels: backend/kernels/build.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


def cache_dir() -> Path:
    """LLM_CACHE_DIR, else ~/.cache/tritonllm."""
    return Path(os.environ.get("LLM_CACHE_DIR") or Path.home() / ".cache" / "tritonllm")


# In a GGUF file's prepared folder (backend/runner/gguf_model.py): the file it stands for, as
# JSON {"path", "size", "mtime"}
GGUF_SOURCE_FILE = "gguf-source.json"
_QUANT_TAG = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16|TQ\d\w*)$", re.IGNORECASE)


def gguf_source_file(folder: Path) -> Path | None:
    """The GGUF file a prepared folder stands for; None for any other folder."""
    marker = Path(folder) / GGUF_SOURCE_FILE
    return Path(json.loads(marker.read_text())["path"]) if marker.is_file() else None


def model_name(folder: Path) -> str:
    """The name a model goes by (the served name, its preset's): a folder's name, or for a GGUF
    file's prepared folder the file's name without .gguf."""
    source = gguf_source_file(folder)
    return Path(folder).name if source is None else source.stem


def base_model_name(folder: Path) -> str:
    """`model_name` without a GGUF file's quantization tag (SmolLM2-135M-Instruct.Q4_K_M ->
    SmolLM2-135M-Instruct), what a preset is named after."""
    return _QUANT_TAG.sub("", model_name(folder))
