"""GGUF architectures transformers' reader (5.24) does not know, taught to it: Gemma (1),
OLMo (1), Granite, OLMo 2 and SmolLM3, named in the files as llama.cpp's converter writes
them. Each entry is the file's keys (after `<arch>.`) to the transformers config's fields,
and what the converter did to the tensors that the reader must undo: Llama's permutation of
the q / k rows (`permute`: Granite, SmolLM3 and OLMo, whose converters derive from or copy
Llama's) or Gemma's norms stored as 1 + w (`norm`). `register` adds them to transformers'
tables once, in the process that reads files: the prepared folder's config and tokenizer, and
the transformers path's load of the weights (backend/runner/transformers_loader.py) both go
through transformers' reader. Any other architecture of a file is taught from the file itself
where transformers has a decoder of it (backend/runner/gguf_generic.py).

What a file leaves out comes from the transformers config's defaults, which are the
checkpoints': SmolLM3's NoPE layers (every 4th layer without RoPE; llama.cpp assumes the
same), Granite's head size (hidden / heads; its converter drops head_dim), Gemma's RoPE base
(10000: its converter writes none).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from backend.runner.gguf_generic import supplement, taught, teach, wrap
from backend.runner.gguf_processors import processors as file_processors

_LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}
# file architecture -> (its keys to config fields, what the reader undoes in its tensors)
ARCHITECTURES: dict[str, tuple[dict[str, str], str | None]] = {
    "gemma": (_LLAMA_KEYS, "norm"),
    "olmo": (
        {**{k: v for k, v in _LLAMA_KEYS.items() if "rms" not in k}, "attention.clamp_kqv": "clip_qkv"},
        "permute",
    ),
    "granite": (
        {
            **_LLAMA_KEYS,
            "attention.scale": "attention_multiplier",
            "embedding_scale": "embedding_multiplier",
            "residual_scale": "residual_multiplier",
            "logit_scale": "logits_scaling",
        },  # fmt: skip
        "permute",
    ),
    "olmo2": (_LLAMA_KEYS, None),
    "smollm3": (_LLAMA_KEYS, "permute"),
}

# key namespaces of any file, not the architecture's: what it is, its tokenizer, how it was
# split or quantized
_COMMON = ("general.", "tokenizer.", "split.", "quantize.", "GGUF.")
# file architectures transformers' reader reads under another name (its load_gguf_checkpoint)
_READER_RENAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
_lock = threading.Lock()
_registered = False


def register(source: Path | None = None) -> None:
    """Teach transformers' GGUF reader ARCHITECTURES (idempotent, thread-safe), and the
    architecture of file `source` where neither knows it (backend/runner/gguf_generic.py)."""
    _register_table()
    if source is None:
        return
    from gguf import GGUFReader
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    fields = GGUFReader(source).fields
    arch = field_value(fields["general.architecture"]) if "general.architecture" in fields else None
    if arch is None:
        return
    prefix, known = f"{arch}.", _READER_RENAMES.get(arch, arch)
    values = {k.removeprefix(prefix): field_value(f) for k, f in fields.items() if k.startswith(prefix)}
    if taught(arch) or known not in GGUF_CONFIG_MAPPING:  # each file's keys checked
        teach(arch, values, [k for k in fields if not k.startswith((prefix, *_COMMON))], source)
    else:  # keys transformers' table for it lacks (gpt-oss' attention.key_length, attention.sliding_window)
        supplement(known, values)


def field_value(field) -> Any:
    """A scalar or string field's value of a GGUFReader (arrays: None)."""
    if len(field.types) != 1:
        return None
    part = field.parts[-1]
    return bytes(part).decode() if field.types[0].name == "STRING" else part[0].item()


def _register_table() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from transformers import modeling_gguf_pytorch_utils as reader
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        wrap()
        _teach_block_types()
        reader.TENSOR_PROCESSORS.update(file_processors())
        processors = {"permute": reader.LlamaTensorProcessor, "norm": reader.Gemma2TensorProcessor}
        for arch, (keys, undo) in ARCHITECTURES.items():
            if arch in GGUF_CONFIG_MAPPING:  # a newer transformers reads it itself
                continue
            GGUF_CONFIG_MAPPING[arch] = dict(keys)
            reader.GGUF_TO_TRANSFORMERS_MAPPING["config"][arch] = GGUF_CONFIG_MAPPING[arch]
            reader.GGUF_SUPPORTED_ARCHITECTURES.append(arch)
            if undo is not None:
                reader.TENSOR_PROCESSORS[arch] = processors[undo]
        _registered = True


def _teach_block_types() -> None:
    """The block formats transformers' newer GGUF reader (the one reading Qwen3.5 and LFM2 files,
    transformers.integrations.gguf) lacks but the gguf package dequantizes: Q5_0 and Q5_1 (a
    Q4_K_M file's rows of a width K-quants do not divide), TQ1_0 / TQ2_0, MXFP4 ... Its tables are
    shared dicts: each added type is read and dequantized by the gguf package's own code."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    try:
        from transformers.integrations.gguf import dequant
    except ImportError:  # a transformers without that reader
        return

    def dequantize(qtype: GGMLQuantizationType):
        def run(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(quants.dequantize(blocks.numpy(), qtype)).to(dtype)

        return run

    for qtype, (elements, size) in GGML_QUANT_SIZES.items():
        if qtype.value not in dequant.GGML_BLOCK and elements > 1 and qtype.name not in ("Q8_1", "Q8_K"):
            dequant.GGML_BLOCK[qtype.value] = (elements, size)
            dequant.GGML_NAME[qtype.value] = qtype.name
            dequant._DEQUANT[qtype.value] = dequantize(qtype)
