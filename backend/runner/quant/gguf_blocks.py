"""The default model's own quantized blocks, read from its GGUF file (no float32 on the way).

A GGUF Q4_1 block is 20 bytes for 32 weights (float16 scale d, float16 min m, 16 bytes of
nibbles in `formats`' int4 layout); Q4_0 is 18 (d, nibbles; min = -8 d); Q8_0 is 34 (d, 32
int8). Rows are the weight's output features, as ours are, so a block becomes one group of a
QuantizedWeight as is: only the scales widen to float32. llama.cpp's converter permutes the
q and k rows (its RoPE pairs neighbours, ours halves); `_unpermute` restores the Hugging
Face order, which transformers' GGUF loader also does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backend.runner.quant.formats import BLOCK, QuantizedWeight

# Our parameters' GGUF tensors, in row order (fused ones have several).
_PARTS = {
    "qkv_t": ("attn_q", "attn_k", "attn_v"),
    "o_proj_t": ("attn_output",),
    "gate_up_t": ("ffn_gate", "ffn_up"),
    "down_t": ("ffn_down",),
}
LM_HEAD_TYPE = "Q8_0"
# GGUF block type -> (kind, symmetric)
_FORMATS = {"Q4_1": ("int4", False), "Q4_0": ("int4", True), "Q8_0": ("int8", True)}


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    type_name: str  # "Q4_0", "Q4_1" or "Q8_0": the block types we serve as they are
    rows: int
    data: np.ndarray  # uint8 [rows, bytes per row], a view of the memory-mapped file


# GGUF's numbering: tensor types we read, metadata value types and their sizes
_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def read_tensor_table(path: Path) -> list[GgufTensor]:
    """The GGUF file's tensors in the block types we serve (others are left out), as views of
    the memory-mapped file. Only what locating the tensors needs is parsed: the `gguf`
    package's reader decodes every metadata string (the whole vocabulary), seconds per load."""
    raw, infos, start = _tensor_infos(path)
    tensors = []
    for name, kind, shape, offset in infos:
        type_name = _TYPES.get(kind)
        if type_name is None:
            continue
        rows, row_bytes = int(np.prod(shape[1:])), shape[0] // 32 * _BLOCK_BYTES[type_name]
        data = raw[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(GgufTensor(name, type_name, rows, data))
    return tensors


def _tensor_infos(path: Path) -> tuple[np.ndarray, list[tuple[str, int, tuple[int, ...], int]], int]:
    """(the mapped file, (name, type, shape, offset) of each tensor, where their data starts)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buffer = memoryview(raw)
    magic, _version, num_tensors, num_fields = struct.unpack_from("<4sIQQ", buffer, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    at, alignment = 24, 32
    for _ in range(num_fields):
        key, at = _string(buffer, at)
        (kind,), at = struct.unpack_from("<I", buffer, at), at + 4
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buffer, at)[0]
        at = _skip_value(buffer, at, kind)
    infos = []
    for _ in range(num_tensors):
        name, at = _string(buffer, at)
        (dims,), at = struct.unpack_from("<I", buffer, at), at + 4
        shape, at = struct.unpack_from(f"<{dims}Q", buffer, at), at + 8 * dims
        (kind, offset), at = struct.unpack_from("<IQ", buffer, at), at + 12
        infos.append((name, kind, shape, offset))
    return raw, infos, -(-at // alignment) * alignment


def _string(buffer: memoryview, at: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<Q", buffer, at)
    return bytes(buffer[at + 8 : at + 8 + size]).decode("utf-8", "replace"), at + 8 + size


def _skip_value(buffer: memoryview, at: int, kind: int) -> int:
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", buffer, at)[0]
    if kind != _ARRAY:
        return at + _VALUE_SIZES[kind]
    item, count = struct.unpack_from("<IQ", buffer, at)
    at += 12
    if item != _STRING and item != _ARRAY:
        return at + count * _VALUE_SIZES[item]
    for _ in range(count):
        at = _skip_value(buffer, at, item)
    return at


def read_gguf_weights(
    path: Path, num_heads: int, num_kv_heads: int, linear_type: str | None
) -> dict[str, QuantizedWeight]:
    """Our parameter name ("layers.3.qkv_t", "lm_head_t") -> its GGUF blocks: the decoder
    linears stored as `linear_type` (fused ones: every part), and a tied Q8_0 embedding as
    the int8 lm_head; the rest is left out (quantized from the float weights instead)."""
    by_name = {t.name: t for t in read_tensor_table(path)}
    weights: dict[str, QuantizedWeight] = {}
    if "token_embd.weight" in by_name and "output.weight" not in by_name:  # tied: the lm_head
        if by_name["token_embd.weight"].type_name == LM_HEAD_TYPE:
            weights["lm_head_t"] = _blocks(by_name["token_embd.weight"])
    layer = 0
    while f"blk.{layer}.attn_q.weight" in by_name:
        for ours, names in _PARTS.items():
            tensors = [by_name[f"blk.{layer}.{part}.weight"] for part in names]
            if linear_type is None or any(t.type_name != linear_type for t in tensors):
                continue
            parts = []
            for tensor in tensors:
                heads = {"attn_q": num_heads, "attn_k": num_kv_heads}.get(tensor.name.split(".")[2])
                parts.append(_blocks(tensor) if heads is None else _unpermute(_blocks(tensor), heads))
            weights[f"layers.{layer}.{ours}"] = _concat(parts)
        layer += 1
    return weights


def linear_format(path: Path) -> tuple[str, int, bool] | None:
    """(kind, group, symmetric) of the GGUF's decoder linears when all are stored in one block
    format we serve (the default model: Q4_1 -> int4, 32, False); None otherwise."""
    _, infos, _ = _tensor_infos(path)
    parts = {part for names in _PARTS.values() for part in names}
    types = {kind for name, kind, _, _ in infos if name.startswith("blk.") and name.split(".")[2] in parts}
    if len(types) != 1 or next(iter(types)) not in _TYPES:
        return None
    kind, symmetric = _FORMATS[_TYPES[types.pop()]]
    return kind, BLOCK, symmetric


def gguf_type(kind: str, group: int, symmetric: bool) -> str | None:
    """The GGUF block type that stores QUANT's format as is (groups of 32), if one does."""
    if group != BLOCK:
        return None
    return next((name for name, fmt in _FORMATS.items() if fmt == (kind, symmetric)), None)


def _blocks(tensor: GgufTensor) -> QuantizedWeight:
    kind, symmetric = _FORMATS[tensor.type_name]
    rows = tensor.rows
    blocks = torch.from_numpy(np.array(tensor.data).reshape(rows, -1, _BLOCK_BYTES[tensor.type_name]))
    scales = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if kind == "int8":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
        return QuantizedWeight(kind, q, scales.contiguous(), None, BLOCK)
    start = 2 if symmetric else 4
    mins = -8 * scales if symmetric else blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    q = blocks[..., start:].reshape(rows, -1).contiguous()
    return QuantizedWeight(kind, q, scales.contiguous(), mins.contiguous(), BLOCK)


def _unpermute(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """Rows in llama.cpp's order -> Hugging Face's: GGUF row (h, i, half) is HF row (h, half, i)."""
    rows = weight.q.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)
    mins = None if weight.mins is None else weight.mins[order]
    return QuantizedWeight(weight.kind, weight.q[order], weight.scales[order], mins, weight.group)


def _concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    first = parts[0]
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return QuantizedWeight(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), mins,
                           first.group)  # fmt: skip
