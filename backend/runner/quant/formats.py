"""Weight-only quantized formats: int8 and int4, group-wise along the input dimension.

A weight of a group is `scale * q + min` (symmetric formats have no min: `scale * q`):

- int8: q int8 [out, in]; symmetric: q in [-127, 127] (GGUF's Q8_0 is this with groups of 32);
  with zero points: 256 levels from the group's min to its max (q + 128 of them up from the min);
- int4: q in [0, 15], two per byte, in blocks of 32 weights: byte j of a block holds weight j
  in its low nibble and weight j + 16 in its high one (GGUF's Q4_1 layout, which is served as
  is; Q4_0 is the symmetric case, min = -8 * scale).
- int5 (GGUF's Q5_0, Q5_1, Q5_K only; not a QUANT= kind): q in [0, 31], its 4 low bits as int4's
  nibbles in `q` and its high bits in `qh`, uint8 [out, in / 8]: 4 bytes a block of 32, bit j
  of them (byte j / 8, bit j % 8) weight j's (GGUF's Q5_0 qh, read as a little-endian uint32);
  always with mins (Q5_0: min = -16 * scale). 5 bits a weight where int8 took 8.

A group is a multiple of 32 (BLOCK), or for int8 16 (HALF): GGUF's K-quants (Q6_K, Q3_K,
Q2_K) have a scale (and a min) per 16 weights, decoded exactly into int8 g16. QUANT= itself
(`quantize`) only makes multiples of 32.

`dequantize` is the reference every kernel is checked against (tests/backend/runner/quant);
`quantize_activations` is the reference of QUANT_ACTIVATIONS=int8's rounding of x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per int4 packing block and per block of the tiles
HALF = 16  # the one group that is not a multiple of BLOCK: int8 only, two groups a block
KINDS = ("int8", "int4")


TILE = 4  # output rows side by side in a Tiles block multiplied by float32 activations
TILE_A8 = 16  # the same for int8 activations: one row a 32-bit lane of a vector (tiles_a8.cpp)


@dataclass(slots=True, eq=False)
class Tiles:
    """A weight laid out for the GEMV, in one of two layouts by what multiplies it:

    - float32 activations (tiles.cpp): each block of 32 inputs of TILE consecutive output rows
      side by side (int4: TILE x 16 bytes, one cache line; int8: TILE x 32), and their scales
      and mins (one per block, a group's repeated over its blocks; symmetric int8: no mins)
      side by side, so a thread reads two arrays front to back instead of TILE short rows;
    - int8 activations (tiles_a8.cpp): TILE_A8 rows, a block as 64-byte words: word j of row
      n is its inputs 4j .. 4j + 3 at bytes 4n .. 4n + 3 (int4: inputs 4v.. in the low nibbles
      and 16 + 4v.. in the high ones of vector v), so one vpdpbusd takes 4 inputs of 16 rows.

    int5: float32 activations: a row's block is its 16 nibble bytes then its 4 bytes of qh (20
    bytes); int8 activations: int4's 4 vectors and a 5th of high bits (`_high_bit_plane`: 8 masks). The
    data's shape tells the kernels int5 (last dimension 20, or 5 vectors); params are int4's.

    Group 16 (int8 only): the data is group 32's; params get a dimension for the block's two
    halves (inputs 0..15, 16..31), [.., blocks, 2, P], half h's P values as a block's are in
    group 32's layout. Its 4 dimensions are what tells the kernels (and decode_layer, which
    hands params to them) that a block has two scales (and mins), whatever P is.
    """

    data: torch.Tensor  # float32 activations: [out / TILE, in / 32, TILE, bytes], each row's bytes
    # of the block as in q (int5: then its 4 qh bytes, 20 in all); int8: uint8 [out / TILE_A8,
    # in / 32, 4 (int4), 5 (int5: int4's and 8 masks of high bits) or 8 (int8: q + 128), 64]
    # float32 [out / TILE, in / 32, 2 * TILE]: the TILE scales, then the TILE mins; without
    # mins (symmetric int8; int4 / int5 whose mins are -8 / -16 x the scales: `_symmetric`),
    # [.., TILE]: the scales alone (int8 activations: TILE_A8 of each);
    # group 16: [out / TILE, in / 32, 2, 2 * TILE or TILE], half 0's params then half 1's
    params: torch.Tensor
    activations: str = "float32"  # what the GEMV multiplies them by: float32, or int8 (tiles_a8.cpp)


@dataclass(slots=True, eq=False)
class QuantizedWeight:
    """One linear layer's weights, [out_features, in_features] as the kernels read them."""

    kind: str  # "int8" | "int4" | "int5"
    q: torch.Tensor  # int8 [out, in] | uint8 [out, in / 2] (int5: the low 4 bits)
    scales: torch.Tensor  # float32 [out, in / group]
    mins: torch.Tensor | None  # float32 [out, in / group]; None: symmetric int8 (int4 always has them)
    group: int  # a multiple of BLOCK, or HALF (int8 only: GGUF's K-quant sub-blocks)
    qh: torch.Tensor | None = None  # int5's high bits, uint8 [out, in / 8] (above); None for the others
    # where the native kernels run: the same weights as Tiles (`tile_weight`), which the
    # GEMV reads instead of q, scales and mins (a copy: the reference and the other paths read those)
    tiles: Tiles | None = None
    # how matmul.quant_linear multiplies it, set at load from QUANT_GEMV_MAX_ROWS / QUANT_GEMM
    # (apply.quantize_model): up to how many rows the GEMV runs without tiles (None:
    # matmul.GEMV_MAX_ROWS of its kind), and the GEMM's dtype past them (float32 or bfloat16)
    gemv_max_rows: int | None = None
    gemm_dtype: torch.dtype = torch.float32

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.q, self.qh, self.scales, self.mins) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize(weight: torch.Tensor, kind: str, group: int, symmetric: bool) -> QuantizedWeight:
    """weight: [out, in] float -> its quantized form (round to nearest)."""
    if kind not in KINDS:
        raise ValueError(f"QUANT must be one of none, {', '.join(KINDS)}; got {kind!r}")
    out_features, in_features = weight.shape
    if group % BLOCK or in_features % group:
        raise ValueError(f"QUANT_GROUP_SIZE={group} must be a multiple of {BLOCK} dividing {in_features}")
    w = weight.detach().float().contiguous().reshape(out_features, in_features // group, group)
    if kind == "int8":
        return _quantize_int8(w, symmetric)
    if symmetric:  # as GGUF's Q4_0: the group's largest magnitude lands exactly on level -8
        extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]
        scales = torch.where(extreme.abs() < 1e-12, 1e-12, extreme / -8)
        mins = -8 * scales
    else:
        lo, hi = w.amin(-1), w.amax(-1)
        scales, mins = ((hi - lo) / 15).clamp(min=1e-12), lo
    q = torch.round((w - mins[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(kind, pack_int4(q.reshape(out_features, in_features)), scales.contiguous(),
                           mins.contiguous(), group)  # fmt: skip


def _quantize_int8(w: torch.Tensor, symmetric: bool) -> QuantizedWeight:
    """w: [out, groups, group] -> int8 q with scale (and, asymmetric, a min: 256 levels from
    the group's minimum to its maximum, q - 128 stored)."""
    out_features, groups, group = w.shape
    if symmetric:
        scales = (w.abs().amax(-1) / 127).clamp(min=1e-12)
        q, mins = torch.round(w / scales[..., None]).clamp(-127, 127), None
    else:
        lo = w.amin(-1)
        scales = ((w.amax(-1) - lo) / 255).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 255) - 128
        mins = (lo + 128 * scales).contiguous()
    q = q.to(torch.int8).reshape(out_features, groups * group)
    return QuantizedWeight("int8", q, scales.contiguous(), mins, group)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [out, in] in 0..15 -> [out, in / 2] in the block layout above."""
    out_features, in_features = q.shape
    blocks = q.reshape(out_features, in_features // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out_features, in_features // 2).contiguous()


def tile_weight(weight: QuantizedWeight, activations: str = "float32") -> Tiles | None:
    """`weight` as Tiles multiplied by `activations`; None where its rows do not make whole tiles."""
    halves = weight.group == HALF and weight.kind == "int8"
    if weight.in_features % BLOCK or (weight.group % BLOCK and not halves):
        raise ValueError(f"tiles take groups a multiple of {BLOCK} or int8 g{HALF}: not {weight.kind} g{weight.group}")
    rows = TILE_A8 if activations == "int8" else TILE
    if weight.out_features % rows:
        return None
    tiles, blocks = weight.out_features // rows, weight.in_features // BLOCK
    mins = [] if weight.mins is None or _symmetric(weight) else [_per_block(weight.mins, weight.group, rows)]
    params = torch.cat([_per_block(weight.scales, weight.group, rows), *mins], dim=-1).contiguous()
    if activations == "int8":
        words = 8 if weight.kind == "int8" else 4  # 4-byte words of a row's block
        q = weight.q if weight.kind != "int8" else (weight.q.to(torch.int16) + 128).to(torch.uint8)  # the unsigned side
        data = q.reshape(tiles, rows, blocks, words, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, words, rows * 4)
        if weight.kind == "int5":
            data = torch.cat((data, _high_bit_plane(weight, tiles, rows, blocks)), dim=2)
        return Tiles(data.contiguous(), params, activations)
    block_bytes = BLOCK if weight.kind == "int8" else BLOCK // 2
    data = weight.q.reshape(tiles, rows, blocks, block_bytes)
    if weight.kind == "int5":  # a row's 16 nibble bytes, then its 4 bytes of high bits
        data = torch.cat((data, weight.qh.reshape(tiles, rows, blocks, 4)), dim=-1)
    return Tiles(data.transpose(1, 2).contiguous(), params, activations)


def _symmetric(weight: QuantizedWeight) -> bool:
    """int4 / int5 whose mins are -8 / -16 x its scales (GGUF's Q4_0, Q5_0; QUANT_SYMMETRIC int4):
    its tiles hold the scales alone, the kernels make each min (the same number: a product by a
    power of 2), and a block's bytes shrink by 4 a row (Q5_0: 28 to 24, against llama.cpp's 22)."""
    lowest = {"int4": -8.0, "int5": -16.0}.get(weight.kind)
    return lowest is not None and weight.mins is not None and torch.equal(weight.mins, weight.scales * lowest)


def _high_bit_plane(weight: QuantizedWeight, tiles: int, rows: int, blocks: int) -> torch.Tensor:
    """int5's high bits for the int8-activation tiles: a 5th 64-byte word of a block, 8 masks of
    64 bits (little-endian), mask j's bit 4n + k the high bit of row n's input 4j + k: the bytes
    of word j of the block that take 16 (tiles_a8.cpp, int5.h add_high_bits)."""
    high = unpack_high_bits(weight.qh).reshape(tiles, rows, blocks, 8, 4)  # [.., j, k]
    high = high.permute(0, 2, 3, 1, 4).reshape(tiles * blocks * 8, rows * 4)  # [.., j, 4n + k]
    return pack_high_bits(high).reshape(tiles, blocks, 1, rows * 4)


def _per_block(values: torch.Tensor, group: int, rows: int) -> torch.Tensor:
    """A weight's scales or mins [out, in / group] as the tiles' params: [out / rows, blocks,
    rows], a group's value repeated over its blocks; group 16: [out / rows, blocks, 2, rows]."""
    out_features, groups = values.shape
    if group == HALF:
        return values.reshape(out_features // rows, rows, groups // 2, 2).permute(0, 2, 3, 1)
    values = values.repeat_interleave(group // BLOCK, dim=1)
    return values.reshape(out_features // rows, rows, -1).transpose(1, 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    out_features, half = packed.shape
    blocks = packed.reshape(out_features, half * 2 // BLOCK, 1, BLOCK // 2)
    return torch.cat((blocks & 0xF, blocks >> 4), dim=2).reshape(out_features, half * 2)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 [out, in] weights a quantized weight stands for."""
    q = unpack_int4(weight.q) if weight.kind != "int8" else weight.q
    if weight.kind == "int5":
        q = q | (unpack_high_bits(weight.qh) << 4)
    out_features, in_features = q.shape
    grouped = q.float().reshape(out_features, in_features // weight.group, weight.group)
    w = grouped * weight.scales[..., None]
    if weight.mins is not None:
        w = w + weight.mins[..., None]
    return w.reshape(out_features, in_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: float32 [M, K] -> (q int8 [M, K], d float32 [M, K / 32]): each block of 32 values
    as d * q, d = max |x| / 127 of the block, q = round(x / d) (an all-zero block: d = 0, q = 0)."""
    rows, width = x.shape
    blocks = x.float().reshape(rows, width // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    q = torch.round(blocks / torch.where(d > 0, d, 1.0)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(rows, width), d


def dequantize_activations(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    rows, width = q.shape
    return (q.float().reshape(rows, width // BLOCK, BLOCK) * d[..., None]).reshape(rows, width)


def unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """int5's qh uint8 [out, in / 8] -> each weight's high bit, uint8 [out, in] (0 or 1)."""
    bits = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., None] >> bits) & 1).reshape(qh.shape[0], -1)


def pack_high_bits(high: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] of 0 / 1 -> qh [out, in / 8] (bit j % 8 of byte j / 8: weight j's)."""
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    return (high.reshape(high.shape[0], -1, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def select_rows(weight: QuantizedWeight, order: torch.Tensor | slice) -> QuantizedWeight:
    """The weight's rows `order` (e.g. GGUF's q / k rows in Hugging Face's order; a slice: views)."""
    pick = lambda t: None if t is None else t[order]
    return QuantizedWeight(weight.kind, weight.q[order], weight.scales[order], pick(weight.mins), weight.group,
                           pick(weight.qh))  # fmt: skip


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one kind, group and mins' presence, stacked by rows (a fused q|k|v, gate|up)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)
    return QuantizedWeight(first.kind, cat([p.q for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), first.group, cat([p.qh for p in parts]))  # fmt: skip
