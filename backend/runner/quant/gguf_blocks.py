"""The default model's own quantized blocks, read from its GGUF file (no float32 on the way).

A GGUF Q4_1 block is 20 bytes for 32 weights (float16 scale d, float16 min m, 16 bytes of
nibbles in `formats`' int4 layout); Q4_0 is 18 (d, nibbles; min = -8 d); Q8_0 is 34 (d, 32
int8). Rows are the weight's output features, as ours are, so a block becomes one group of a
QuantizedWeight as is: only the scales widen to float32. llama.cpp's converter permutes the
q and k rows (its RoPE pairs neighbours, ours halves); `_unpermute` restores the Hugging
Face order, which transformers' GGUF loader also does.

`read_tensor_table` lists a file's tensors of every type; `GgufTensor.weight()` turns those of
the types gguf_formats.BLOCK_TYPES serves (all of llama.cpp's but the IQ, TQ and FP4 ones)
into QuantizedWeights or float32 tensors exactly, and those others into int8 ones
(`gguf_formats.to_weight`, `gguf_formats.requantized`).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from backend.runner.quant.formats import BLOCK, QuantizedWeight, concat_rows, select_rows
from backend.runner.quant.gguf_formats import BLOCK_TYPES, common_format, gguf_block_size, gguf_type_name, to_weight

# Our parameters' GGUF tensors, in row order (fused ones have several).
_PARTS = {
    "qkv_t": ("attn_q", "attn_k", "attn_v"),
    "o_proj_t": ("attn_output",),
    "gate_up_t": ("ffn_gate", "ffn_up"),
    "down_t": ("ffn_down",),
}
LM_HEAD_TYPE = "Q8_0"
# The GGUF block types that are QUANT's formats as they are -> (kind, symmetric)
_FORMATS = {"Q4_1": ("int4", False), "Q4_0": ("int4", True), "Q8_0": ("int8", True)}


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    type_name: str  # GGML's name of its type: served as it is (BLOCK_TYPES), re-quantized, or unknown
    rows: int  # output features (every dimension but the innermost)
    cols: int  # input features (the innermost dimension)
    shape: tuple[int, ...]  # its dimensions outermost first, as torch orders them
    raw: np.ndarray | None = field(default=None, repr=False)  # None: a type the `gguf` package does not know

    @property
    def data(self) -> np.ndarray:
        """uint8 [rows, bytes per row], a view of the memory-mapped file; a ValueError for a
        tensor whose type we do not serve."""
        if self.raw is None:
            raise ValueError(
                f"GGUF tensor {self.name} is stored as {self.type_name}, a type the gguf package does not know "
                f"(served: {', '.join(BLOCK_TYPES)}; re-quantized to int8: the IQ, TQ and FP4 types)"
            )
        return self.raw

    def weight(self) -> QuantizedWeight | torch.Tensor:
        """Its QuantizedWeight [rows, cols], or a float32 tensor (F32, F16, BF16): `to_weight`."""
        return to_weight(self.type_name, self.data, self.rows, self.cols)


# GGUF's numbering: metadata value types and their sizes
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_INTEGERS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}  # GGUF's integer kinds


def read_tensor_table(path: Path) -> list[GgufTensor]:
    """The GGUF file's tensors, as views of the memory-mapped file (one of a type we do not
    serve is listed too, but its `data` and `weight()` raise a ValueError naming it). Only
    what locating the tensors needs is parsed: the `gguf` package's reader decodes every
    metadata string (the whole vocabulary), seconds per load. A file cut short: ValueError.
    The first part of a file llama.cpp's gguf-split cut into parts (`name-00001-of-00003.gguf`,
    the metadata in the first, the tensors spread over all): every part's tensors."""
    return [tensor for part in split_parts(path) for tensor in _part_tensors(part)]


def split_parts(path: Path) -> list[Path]:
    """The files a GGUF's tensors are in: [path] for a whole file; for the first part of a
    split one, every part, beside it by gguf-split's names. ValueError, one line, for a later
    part (the first must be named: it holds the metadata) or a part missing."""
    path = Path(path)
    _raw, _infos, _start, (number, count) = _tensor_infos(path)
    if count <= 1:
        return [path]
    first = re.fullmatch(r"(.*)-00001-of-(\d{5})\.gguf", path.name)
    if number != 0 or first is None or int(first[2]) != count:
        raise ValueError(f"{path.name} is part {number + 1} of a GGUF split into {count} files: name the first, "
                         f"the one named *-00001-of-{count:05d}.gguf, which holds the metadata")  # fmt: skip
    parts = [path.with_name(f"{first[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise ValueError(f"{path.name} is part 1 of a GGUF split into {count} files, and {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not beside it")  # fmt: skip
    return parts


def _part_tensors(path: Path) -> list[GgufTensor]:
    raw, infos, start, _split = _tensor_infos(path)
    tensors = []
    for name, kind, dims, offset in infos:
        type_name = gguf_type_name(kind)
        cols, rows = (dims[0], int(np.prod(dims[1:]))) if dims else (1, 1)
        shape = tuple(reversed(dims))
        at, block = start + offset, gguf_block_size(type_name)
        if block is not None and cols % block[0]:
            raise ValueError(f"GGUF tensor {name}: {cols} columns are not whole {type_name} blocks")
        row_bytes = 0 if block is None else cols // block[0] * block[1]
        if at + rows * row_bytes > raw.size:
            raise ValueError(f"{path} is truncated: tensor {name}'s data runs past its end")
        data = raw[at : at + rows * row_bytes].reshape(rows, row_bytes) if block is not None else None
        tensors.append(GgufTensor(name, type_name, rows, cols, shape, data))
    return tensors


def _tensor_infos(
    path: Path,
) -> tuple[np.ndarray, list[tuple[str, int, tuple[int, ...], int]], int, tuple[int, int]]:
    """(the mapped file, (name, type, shape, offset) of each tensor, where their data starts,
    (split.no, split.count): (0, 1) for a whole file)."""
    if Path(path).stat().st_size == 0:
        raise ValueError(f"{path} is truncated: it is empty")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return raw, *_parse_header(memoryview(raw), path)
    except (struct.error, IndexError) as error:  # a read past the end of the file
        raise ValueError(f"{path} is truncated: its header ends early ({error})") from None


_SPLIT_KEYS = {"split.no": 0, "split.count": 1}


def _parse_header(
    buffer: memoryview, path: Path
) -> tuple[list[tuple[str, int, tuple[int, ...], int]], int, tuple[int, int]]:
    magic, _version, num_tensors, num_fields = struct.unpack_from("<4sIQQ", buffer, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    at, alignment, split = 24, 32, [0, 1]
    for _ in range(num_fields):
        key, at = _string(buffer, at)
        (kind,), at = struct.unpack_from("<I", buffer, at), at + 4
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buffer, at)[0]
        if key in _SPLIT_KEYS and kind in _INTEGERS:
            split[_SPLIT_KEYS[key]] = struct.unpack_from(_INTEGERS[kind], buffer, at)[0]
        at = _skip_value(buffer, at, kind)
    infos = []
    for _ in range(num_tensors):
        name, at = _string(buffer, at)
        (dims,), at = struct.unpack_from("<I", buffer, at), at + 4
        shape, at = struct.unpack_from(f"<{dims}Q", buffer, at), at + 8 * dims
        (kind, offset), at = struct.unpack_from("<IQ", buffer, at), at + 12
        infos.append((name, kind, shape, offset))
    return infos, -(-at // alignment) * alignment, (split[0], split[1])


def read_architecture(path: Path) -> str:
    """The file's general.architecture, read without gguf-py's reader (which parses every
    field: seconds for a tokenizer's vocabulary)."""
    buffer = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))
    num_fields, at = struct.unpack_from("<Q", buffer, 16)[0], 24
    for _ in range(num_fields):
        key, at = _string(buffer, at)
        (kind,), at = struct.unpack_from("<I", buffer, at), at + 4
        if key == "general.architecture" and kind == _STRING:
            return _string(buffer, at)[0]
        at = _skip_value(buffer, at, kind)
    raise ValueError(f"{path} names no general.architecture")


def _string(buffer: memoryview, at: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<Q", buffer, at)
    if at + 8 + size > len(buffer):
        raise struct.error(f"a string of {size} bytes at {at}")
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
    parts = {part for names in _PARTS.values() for part in names}
    tensors = read_tensor_table(path)
    types = {t.type_name for t in tensors if t.name.startswith("blk.") and t.name.split(".")[2] in parts}
    if len(types) != 1 or next(iter(types)) not in _FORMATS:
        return None
    kind, symmetric = _FORMATS[types.pop()]
    return kind, BLOCK, symmetric


def gguf_type(kind: str, group: int, symmetric: bool) -> str | None:
    """The GGUF block type that stores QUANT's format as is (groups of 32), if one does."""
    if group != BLOCK:
        return None
    return next((name for name, fmt in _FORMATS.items() if fmt == (kind, symmetric)), None)


def _blocks(tensor: GgufTensor) -> QuantizedWeight:
    weight = tensor.weight()
    if not isinstance(weight, QuantizedWeight):
        raise ValueError(f"GGUF tensor {tensor.name} is {tensor.type_name}, not quantized")
    return weight


def _unpermute(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """Rows in llama.cpp's order -> Hugging Face's: GGUF row (h, i, half) is HF row (h, half, i)."""
    rows = weight.q.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)
    return select_rows(weight, order)


def _concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    return concat_rows(common_format(parts) or parts)
