"""Where this project keeps what it makes once per machine: LLM_CACHE_DIR (default
~/.cache/tritonllm), holding models/ (the default model, converted: backend/runner/convert.py)
and kernels/ (the compiled CPU kernels: backend/kernels/build.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """LLM_CACHE_DIR, else ~/.cache/tritonllm."""
    return Path(os.environ.get("LLM_CACHE_DIR") or Path.home() / ".cache" / "tritonllm")
