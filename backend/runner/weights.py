"""Reading a Hugging Face checkpoint folder: its weight files, their tensors, its end tokens.
Every model's loader uses these (backend.runner.loader, the M2M100 and Qwen2-VL models)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def eos_token_ids(folder: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """The model's end tokens: config.json's eos_token_id, then generation_config.json's, once each."""
    ids: list[int] = []
    sources = [raw]
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        sources.append(json.loads(gen_path.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if token is not None and token not in ids:
                ids.append(token)
    return tuple(ids)


def weight_formats(folder: Path) -> str:
    """The folder's weights by format and tensor count: a GGUF file's block formats (served as
    they are under QUANT=auto: a GGUF file's folder, or the default model's), or the
    safetensors' dtypes."""
    from backend.runner.convert import source_gguf
    from backend.runner.gguf_model import gguf_source
    from backend.runner.quant.gguf_blocks import read_tensor_table
    from backend.runner.quant.gguf_formats import BLOCK_TYPES

    source = gguf_source(folder) or source_gguf(folder)
    if source is not None:
        counts = Counter(t.type_name for t in read_tensor_table(source))
        named = [f"{name} x {n}" + ("" if name in BLOCK_TYPES else " (re-quantized to int8)")
                 for name, n in counts.most_common()]  # fmt: skip
        return f"of {source.name}: " + ", ".join(named)
    counts = Counter()
    for file in weight_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            counts.update(str(f.get_slice(name).get_dtype()) for name in f.keys())
    return "in safetensors: " + ", ".join(f"{name} x {n}" for name, n in counts.most_common())


def weight_files(folder: Path) -> list[Path]:
    """A checkpoint folder's safetensors files: the index's shards, or every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight in the files, one file open at a time."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
