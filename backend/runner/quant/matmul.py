"""The quantized matmul, `quant_linear`: our AVX-512 kernels (backend/kernels: the GEMV of a
weight's tiles, or of q / scales / mins, and the dequantize before a GEMM), chosen by the
rows and the weight's own settings, or a plain dequantize-then-matmul where they cannot run
(no AVX-512, not the CPU, not float32). bench/quant_kernels.py measures it against
PyTorch's own int8 / int4 CPU kernels and the dequantize-then-matmul reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.kernels import EMPTY, cpu_flags, native
from backend.runner.quant.formats import QuantizedWeight, dequantize

# Weights with tiles (formats.Tiles, made at load where these kernels run) take the tiles'
# GEMV at every row count: against the float32 GEMM after a dequantize it measured ~1.5x
# (int4) and ~2x (int8) from 1 to 512 rows on the default model's layers (2 cores; the GEMM
# is MKL's, far from this CPU's float32 peak). What follows is the path of weights without
# tiles (rows not a multiple of formats.TILE, or TILE_A8 for int8 activations).
# Up to this many rows the GEMV kernel runs (it decodes each weight once per 8 rows); past it
# the weights are dequantized whole and multiplied by a GEMM, which a prefill chunk amortizes:
# float32 (MKL; exact, the float32 model's numbers) unless QUANT_GEMM=bf16 (oneDNN's bf16
# GEMM, AMX where the CPU has it: faster prefill, activations rounded to bf16). The crossovers
# were measured on the default model's shapes (2 cores): int4's table-lookup GEMV stays ahead
# to ~48 rows (24 rows: 1.5x), int8's to ~12. QUANT_GEMV_MAX_ROWS overrides both (a weight's
# `gemv_max_rows`, set at load: apply.quantize_model).
GEMV_MAX_ROWS = {"int4": 48, "int5": 48, "int8": 12}
GEMM_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}  # QUANT_GEMM: a weight's `gemm_dtype`
# QUANT_ACTIVATIONS=int8: tiles meet activations rounded to int8 in blocks of 32 at every row
# count (tiles_a8.cpp, AVX-512 VNNI), as llama.cpp's Q4_1 / Q8_0 x Q8_1 (a cap on the rows
# made a row's arithmetic depend on its batch); weights without tiles stay float32. auto (the
# default): int8 where the decoder's linears are int4 (the default model's Q4_1: llama.cpp's
# own arithmetic on its own weights, within its perplexity), float32 otherwise.
# Against the float32 tiles on the default model's 120 int4 linears it measured 1.05-1.36x
# at 1 row (memory-bound), ~1.55x at 12-64 rows, 1.4-1.5x from 128 to 1024; the int8
# lm_head 1.54x at 1 row, ~1.03x from 12 to 64.
ACTIVATIONS = ("auto", "float32", "int8")


def activations_for(kind: str, setting: str) -> str:
    """What the tiles of a model whose decoder linears are `kind` (QUANT) multiply: float32
    or int8, `setting` (QUANT_ACTIVATIONS) with auto resolved (int8 for int4 where the CPU
    has VNNI)."""
    if setting == "auto":
        return "int8" if kind == "int4" and "avx512_vnni" in cpu_flags() else "float32"
    return setting


def _bits(weight: QuantizedWeight) -> int:
    return 4 if weight.kind == "int4" else 8


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, gemv_rows: int | None = None
) -> torch.Tensor:
    """x: [M, in] @ the weight's [in, out] (+ bias) -> [M, out], x's dtype. Up to `gemv_rows`
    rows (default: the weight's `gemv_max_rows`, else GEMV_MAX_ROWS of its kind) the GEMV
    kernel runs; a weight with tiles takes the tiles' GEMV at every row count while the GEMM
    would be float32's (the weight's `gemm_dtype`; with tiles multiplying int8 activations,
    `Tiles.activations`: their GEMV at every row count)."""
    lib = native() if x.is_cpu and x.dtype == torch.float32 else None
    if lib is None:
        return F.linear(x, dequantize(weight).to(device=x.device, dtype=x.dtype), bias)
    b = EMPTY if bias is None else bias
    if weight.tiles is not None and weight.tiles.activations == "int8":
        return lib.tiled_matmul_a8(x.contiguous(), weight.tiles.data, weight.tiles.params, b)
    if not gemv_rows:
        gemv_rows = GEMV_MAX_ROWS[weight.kind] if weight.gemv_max_rows is None else weight.gemv_max_rows
    # float32 arithmetic takes the GEMV at every row count: a GEMM after a dequantize sums a
    # row's products in another order, so a row's numbers would depend on its batch
    gemv = x.shape[0] <= gemv_rows or weight.gemm_dtype == torch.float32
    if weight.tiles is not None and (gemv or weight.gemm_dtype == torch.float32):
        return lib.tiled_matmul(x.contiguous(), weight.tiles.data, weight.tiles.params, b)
    if weight.kind == "int5":  # the row-layout kernels read int4 / int8 only: int5 without tiles (rows not a
        return F.linear(x, dequantize(weight), bias)  # multiple of a tile's) is rare, and dequantized here
    mins = EMPTY if weight.mins is None else weight.mins
    if gemv:
        return lib.quant_matmul(x.contiguous(), weight.q, weight.scales, mins, b, weight.group, _bits(weight))
    bf16 = weight.gemm_dtype == torch.bfloat16
    w = lib.dequant(weight.q, weight.scales, mins, weight.group, _bits(weight), bf16, _scratch(weight, bf16))
    if bf16:
        y = F.linear(x.to(torch.bfloat16), w).float()
        return y if bias is None else y.add_(bias)
    return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(weight: QuantizedWeight, bf16: bool) -> torch.Tensor:
    """The buffer the dequantized weights are written to, kept and grown to the largest layer:
    a fresh tensor each time measured slower (the allocator hands big blocks back to the OS,
    so every step page-faulted the whole model's weights in again)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    size = weight.out_features * weight.in_features
    buffer = _SCRATCH.get(dtype)
    if buffer is None or buffer.numel() < size:
        _SCRATCH[dtype] = buffer = torch.empty(size, dtype=dtype)
    return buffer
