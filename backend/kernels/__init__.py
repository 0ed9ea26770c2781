"""Our CPU kernels (AVX-512, the .cpp files here): the quantized matmul's GEMV / dequantize
(kernels.cpp, tiles.cpp, tiles_a8.cpp), the float32 matmul (dense.cpp), rms_norm, the paged
attention of every query row (paged_attention.cpp), a decoder layer's whole step
(decode_layer.cpp; its RoPE, SiLU / GELU and q / k norms, layer_ops.cpp, for the
layer-by-layer path too) and the sampler's
first maximum (first_max.cpp); every one takes a row's sums in one order whatever the batch.
build.py compiles them once per machine (`python -m backend.kernels`); ops.py holds the
wrappers the runner calls. The quantized matmul's choice of path is
backend/runner/quant/matmul.py's: this package imports nothing of backend.runner.
bench/quant_kernels.py measures the matmul against PyTorch's own kernels."""

from backend.kernels.build import build_directory, cpu_flags, native
from backend.kernels.ops import (
    EMPTY,
    KV_KERNEL_DTYPES,
    PAGED_HEAD_DIMS,
    dense_matmul,
    gelu_mul,
    head_rms_norm_,
    paged_attention_rows,
    paged_decode_attention,
    rms_norm,
    rope_,
    silu_mul,
)

__all__ = [
    "EMPTY",
    "KV_KERNEL_DTYPES",
    "PAGED_HEAD_DIMS",
    "build_directory",
    "cpu_flags",
    "dense_matmul",
    "gelu_mul",
    "head_rms_norm_",
    "native",
    "paged_attention_rows",
    "paged_decode_attention",
    "silu_mul",
    "rms_norm",
    "rope_",
]
