"""Every GGUF block format llama.cpp files use, as our QuantizedWeight, exactly.

`to_weight` turns a tensor's raw blocks (uint8 [rows, bytes per row], rows its output
features) into the QuantizedWeight whose `formats.dequantize` is llama.cpp's dequantization
of them bit for bit in float32 (all of its products are exact or made in the same order):

- F32, F16, BF16: a float32 tensor [rows, cols] (norms, embeddings, unquantized linears);
- Q4_0, Q4_1: int4 g32 (Q4_0: min = -8 d), their nibbles already in our layout;
- Q8_0: int8 g32 symmetric; Q5_0: int5 g32, min = -16 d; Q5_1: int5 g32, min m (both: the
  nibbles and qh as the file has them);
- Q4_K: int4 g32, scale d * sc, min -dmin * m (a 64-weight chunk's 32 bytes hold weights
  0..31 in their low nibbles and 32..63 in the high ones: repacked into our layout);
- Q5_K: int5 g32 like Q4_K (nibbles repacked; sub-block s's high bits: bit s of qh[j]);
- Q2_K: int8 g16, q 0..3, scale d * sc, min -dmin * m;
- Q3_K: int8 g16 symmetric, q -4..3, scale d * (sc - 32); Q6_K: int8 g16 symmetric, q - 32,
  scale d * sc.

Every other type the `gguf` package dequantizes (IQ1_S .. IQ4_XS, TQ1_0 / TQ2_0, MXFP4,
NVFP4) has no kernel of ours: `requantized` rounds its dequantized weights to int8 groups of
32 (close, not bit for bit; 8.5 bits a weight in memory).

`common_format` brings the parts of a fused matrix (q|k|v, gate|up) to one format.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from backend.runner.quant.formats import BLOCK, QuantizedWeight, quantize, unpack_high_bits, unpack_int4


class BlockType(NamedTuple):
    number: int  # GGML's type number in a GGUF tensor table
    weights: int  # weights per block
    bytes: int  # bytes per block


BLOCK_TYPES: dict[str, BlockType] = {
    "F32": BlockType(0, 1, 4), "F16": BlockType(1, 1, 2), "BF16": BlockType(30, 1, 2),
    "Q4_0": BlockType(2, 32, 18), "Q4_1": BlockType(3, 32, 20), "Q5_0": BlockType(6, 32, 22),
    "Q5_1": BlockType(7, 32, 24), "Q8_0": BlockType(8, 32, 34), "Q2_K": BlockType(10, 256, 84),
    "Q3_K": BlockType(11, 256, 110), "Q4_K": BlockType(12, 256, 144), "Q5_K": BlockType(13, 256, 176),
    "Q6_K": BlockType(14, 256, 210),
}  # fmt: skip
TYPE_NAMES = {t.number: name for name, t in BLOCK_TYPES.items()}  # GGML type number -> name
FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_type_name(number: int) -> str:
    """A GGML type number's name, served or not (the `gguf` package names those we do not serve)."""
    if number in TYPE_NAMES:
        return TYPE_NAMES[number]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(number).name
    except (ImportError, ValueError):
        return f"type {number}"


def gguf_block_size(type_name: str) -> tuple[int, int] | None:
    """(weights, bytes) of a block of any GGML type the `gguf` package knows; None if unknown."""
    if type_name in BLOCK_TYPES:
        return BLOCK_TYPES[type_name][1:]
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    except (ImportError, KeyError):
        return None


def to_weight(type_name: str, data: np.ndarray, rows: int, cols: int) -> QuantizedWeight | torch.Tensor:
    """A tensor's blocks (uint8 [rows, bytes per row], e.g. a view of the mapped file) -> its
    QuantizedWeight [rows, cols], or a float32 tensor [rows, cols] for F32, F16 and BF16."""
    if type_name not in BLOCK_TYPES:
        return requantized(type_name, data, rows, cols)
    block = BLOCK_TYPES[type_name]
    if cols % block.weights or data.shape != (rows, cols // block.weights * block.bytes):
        raise ValueError(f"{type_name} data {tuple(data.shape)} does not hold {rows} x {cols} weights")
    if type_name == "F32":
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
    if type_name == "F16":
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float16).astype(np.float32))
    if type_name == "BF16":
        bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32))
    b = np.asarray(data).reshape(rows, cols // block.weights, block.bytes)
    return _CONVERT[type_name](b, rows, cols)


def requantized(type_name: str, data: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """A type we have no kernel for (the IQ, TQ and FP4 ones): the `gguf` package's
    dequantization of its blocks, rounded to int8 groups of 32 (symmetric, as Q8_0: each weight
    within half a step of 1 / 127 of its group's largest); a ValueError for a type that package
    cannot dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        floats = dequantize(np.asarray(data), GGMLQuantizationType[type_name])
    except (KeyError, NotImplementedError):
        served = ", ".join(BLOCK_TYPES)
        raise ValueError(f"GGUF block type {type_name} is not served (served: {served}; re-quantized to int8: "
                         f"the IQ, TQ and FP4 types)") from None  # fmt: skip
    return quantize(torch.from_numpy(floats).reshape(rows, cols), "int8", BLOCK, symmetric=True)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _bits(b: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> its bits [..., 8 (bit), n]: [..., i, j] is bit i of byte j."""
    return (b[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1


def _crumbs(b: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> its 2-bit fields [..., 4, n]: [..., s, j] is bits 2s, 2s + 1 of byte j."""
    return (b[..., None, :] >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3


def _nibbles(b: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> [..., 2, n]: the low nibbles, then the high ones."""
    return np.stack((b & 0xF, b >> 4), axis=-2)


def _weight(
    kind: str,
    q: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray | None,
    rows: int,
    group: int,
    qh: np.ndarray | None = None,
):
    """QuantizedWeight from q ([rows, ...], row-major in weight order; int4 / int5: packed bytes),
    per-group scales and mins ([rows, ...] in group order) and int5's qh bytes."""
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1), dtype=np.float32))
    return QuantizedWeight(kind, _owned(q, rows), to(scales), None if mins is None else to(mins), group,
                           None if qh is None else _owned(qh, rows))  # fmt: skip


def _owned(a: np.ndarray, rows: int) -> torch.Tensor:
    """Bytes [rows, ...] as a tensor [rows, -1], copied where a view of the (read-only) mapped file."""
    a = a.reshape(rows, -1)
    return torch.from_numpy(a if a.flags.writeable and a.flags.c_contiguous else np.array(a))


def _pack(q: np.ndarray) -> np.ndarray:
    """q [..., 32] in 0..15 (weights of 32-blocks) -> our int4 bytes [..., 16]."""
    return q[..., :16] | (q[..., 16:] << 4)


def _q4_0(b, rows, cols):
    d = _f16(b, 0)
    return _weight("int4", b[..., 2:], d, -8 * d, rows, BLOCK)


def _q4_1(b, rows, cols):
    return _weight("int4", b[..., 4:], _f16(b, 0), _f16(b, 2), rows, BLOCK)


def _q8_0(b, rows, cols):
    return _weight("int8", b[..., 2:].view(np.int8), _f16(b, 0), None, rows, BLOCK)


def _q5_0(b, rows, cols):  # qs and qh (bit j: weight j's high bit) already in int5's layout
    d = _f16(b, 0)
    return _weight("int5", b[..., 6:], d, -16 * d, rows, BLOCK, b[..., 2:6])


def _q5_1(b, rows, cols):
    return _weight("int5", b[..., 8:], _f16(b, 0), _f16(b, 2), rows, BLOCK, b[..., 4:8])


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (sc, m) uint8 [..., 8]."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def _scales_mins(b: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """d * sc and -dmin * m per sub-block, float32 as llama.cpp makes them (d, dmin: bytes 0..3)."""
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> [..., 8 sub-blocks, 32]: chunk c's bytes hold sub-block 2c low, 2c + 1 high."""
    return _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b, rows, cols):
    scales, mins = _scales_mins(b, *_k_scales(b[..., 4:16]))
    return _weight("int4", _pack(_k4_nibbles(b[..., 16:])), scales, mins, rows, BLOCK)


def _q5_k(b, rows, cols):
    scales, mins = _scales_mins(b, *_k_scales(b[..., 4:16]))
    qh = np.packbits(_bits(b[..., 16:48]), axis=-1, bitorder="little")  # sub-block s: bit s of qh[j]
    return _weight("int5", _pack(_k4_nibbles(b[..., 48:])), scales, mins, rows, BLOCK, qh)


def _q2_k(b, rows, cols):
    sc = b[..., 0:16]
    scales, mins = _scales_mins(b[..., 80:], sc & 0xF, sc >> 4)
    q = _crumbs(b[..., 16:80].reshape(rows, -1, 2, 32))  # weight 128 c + 32 s + j: bits 2s of byte 32 c + j
    return _weight("int8", q.view(np.int8), scales, mins, rows, 16)


def _q3_k(b, rows, cols):
    low, high = b[..., 96:104], b[..., 104:108]
    sc = _nibbles(low).reshape(rows, -1, 16) | (_crumbs(high).reshape(rows, -1, 16) << 4)
    scales = _f16(b, 108)[..., None] * (sc.view(np.int8) - 32).astype(np.float32)
    ql = _crumbs(b[..., 32:96].reshape(rows, -1, 2, 32))  # as Q2_K's
    hbit = _bits(b[..., 0:32]).reshape(rows, -1, 2, 4, 32)  # weight 32 i + j: bit i of hmask[j]
    q = ql.view(np.int8) - ((hbit ^ 1) << 2).view(np.int8)
    return _weight("int8", q, scales, None, rows, 16)


def _q6_k(b, rows, cols):
    ql = _nibbles(b[..., 0:128].reshape(rows, -1, 2, 64))  # [.., chunk, nibble, 64]: weight 128 c + 64 n + k
    qh = _crumbs(b[..., 128:192].reshape(rows, -1, 2, 32))  # [.., chunk, 4, 32]: weight 128 c + 32 s + j
    q = (ql.reshape(rows, -1, 2, 4, 32) | (qh << 4)).view(np.int8) - 32
    scales = _f16(b, 208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
    return _weight("int8", q, scales, None, rows, 16)


_CONVERT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
            "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}  # fmt: skip


def common_format(parts: list[QuantizedWeight | torch.Tensor]) -> list[QuantizedWeight] | None:
    """`parts` (rows of one fused matrix) in one format, so their q, scales and mins concatenate
    by rows, each dequantizing to exactly what it did: int4 / int5 -> int8 (q 0..15 / 0..31, same
    scales and mins) where any part is int8, else int4 -> int5 (high bits 0) where any is int5;
    the smallest group (each group's scale and min repeated); with mins (0 for symmetric int8) where any part has them.

    None where that cannot be done: a float part (F32/F16/BF16, a torch.Tensor from `to_weight`)
    among them, or groups that are not multiples of the smallest; the caller then handles the
    matrix otherwise (e.g. dequantizes the quantized parts and requantizes the whole)."""
    if not parts or not all(isinstance(p, QuantizedWeight) for p in parts):
        return None
    kinds = {p.kind for p in parts}
    kind = "int8" if "int8" in kinds else "int5" if "int5" in kinds else "int4"
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts) or (kind != "int8" and group % BLOCK):
        return None
    with_mins = any(p.mins is not None for p in parts)
    out = []
    for p in parts:
        if p.kind == kind and p.group == group and (p.mins is not None) == with_mins:
            out.append(p)
            continue
        q, qh = _as_kind(p, kind)
        mins = torch.zeros_like(p.scales) if p.mins is None and with_mins else p.mins
        scales, repeat = p.scales, p.group // group
        if repeat > 1:
            scales = scales.repeat_interleave(repeat, 1)
            mins = None if mins is None else mins.repeat_interleave(repeat, 1)
        out.append(QuantizedWeight(kind, q, scales, mins, group, qh))
    return out


def _as_kind(p: QuantizedWeight, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """p's q (and qh) as `kind`'s, the same levels: int4 / int5 -> int8, int4 -> int5."""
    if p.kind == kind:
        return p.q, p.qh
    if kind == "int5":  # from int4: every high bit 0
        return p.q, torch.zeros(p.q.shape[0], p.q.shape[1] // 4, dtype=torch.uint8)
    q = unpack_int4(p.q)
    if p.kind == "int5":
        q = q | (unpack_high_bits(p.qh) << 4)
    return q.to(torch.int8), None
