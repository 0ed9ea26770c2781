"""QUANT's matmul kernels against PyTorch's own CPU ones and the plain references, per layer.

For each of the default model's linear shapes and row counts (1: one decode stream; 8, 32:
batched decode; 512: a prefill chunk), microseconds per call of:

- ours (tiles): `quant_linear` on the weights with their Tiles, as the server loads them
  (tiles.cpp at every row count);
- ours (rows): `quant_linear` on GGUF's row layout alone (the row-layout GEMV or the
  dequantize-then-GEMM);
- ours int4 / int8 (tiles, a8): the same tiles times activations rounded to int8 per 32
  (tiles_a8.cpp, integer dot products; int4's default, QUANT_ACTIVATIONS=auto, on a CPU
  with AVX-512 VNNI), at every row count;
- torch int8: `aten._weight_int8pack_mm` (int8 weights, one scale per output channel), with
  bf16 activations (float32 ones measured far slower);
- torch int4: `aten._weight_int4pack_mm_for_cpu` on `_convert_weight_to_int4pack_for_cpu`'s
  layout (groups of 32, scale and zero), bf16 activations;
- dequantize-then-matmul: our `dequantize` reference then float32 `torch.mm`;
- float32: `torch.mm` on float32 weights ([in, out], as the float32 model stores them).

Weights are cycled over 16 copies per shape, so they come from past the L2 as in a real
step (the float32 copies, 7-28 MB each, may still sit in a large shared L3). `python -m bench.quant_kernels`.
"""

from __future__ import annotations

import time

import torch

from backend.kernels import cpu_flags, native
from backend.runner.quant.formats import QuantizedWeight, dequantize, quantize, tile_weight, unpack_int4
from backend.runner.quant.matmul import quant_linear

SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (in, out)
ROWS = (1, 8, 32, 512)
COPIES = 16


def _timed(fn, calls: int) -> float:
    fn(0)
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls * 1e6


def _torch_int4(w: torch.Tensor):
    """w float [out, in] -> (packed, scales-and-zeros) for _weight_int4pack_mm_for_cpu, groups of 32."""
    qw = quantize(w, "int4", 32, False)
    q = unpack_int4(qw.q).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    # tinygemm computes (q - 8) * scale + zero: zero = min + 8 * scale
    zeros = qw.mins + 8 * qw.scales
    return packed, torch.stack([qw.scales.t(), zeros.t()], dim=-1).contiguous().bfloat16()


def _tiled(weights: list[QuantizedWeight], activations: str = "float32") -> list[QuantizedWeight]:
    """Copies of `weights` with their Tiles (as apply.py loads them where the kernels run)."""
    return [QuantizedWeight(w.kind, w.q, w.scales, w.mins, w.group, tile_weight(w, activations)) for w in weights]


def _candidates(w_list: list[torch.Tensor]):
    int8 = [quantize(w, "int8", 32, False) for w in w_list]
    int4 = [quantize(w, "int4", 32, False) for w in w_list]
    channel = [w.abs().amax(1, keepdim=True) / 127 for w in w_list]
    int8_channel = [torch.round(w / s).to(torch.int8) for w, s in zip(w_list, channel, strict=True)]
    t4 = [_torch_int4(w) for w in w_list]
    f32 = [w.t().contiguous() for w in w_list]
    vnni = native() is not None and "avx512_vnni" in cpu_flags()
    int8_tiles, int4_tiles = _tiled(int8), _tiled(int4)
    int8_a8, int4_a8 = (_tiled(int8, "int8"), _tiled(int4, "int8")) if vnni else ([], [])
    a8 = {
        "ours int8 (tiles, a8)": lambda x, i: quant_linear(x, int8_a8[i]),
        "ours int4 (tiles, a8)": lambda x, i: quant_linear(x, int4_a8[i]),
    }
    return {
        "ours int8 (tiles)": lambda x, i: quant_linear(x, int8_tiles[i]),
        "ours int4 (tiles)": lambda x, i: quant_linear(x, int4_tiles[i]),
        "ours int8 (rows)": lambda x, i: quant_linear(x, int8[i]),
        "ours int4 (rows)": lambda x, i: quant_linear(x, int4[i]),
        **(a8 if vnni else {}),
        "torch int8 (bf16 x)": lambda x, i: torch.ops.aten._weight_int8pack_mm(
            x.bfloat16(), int8_channel[i], channel[i][:, 0].bfloat16()
        ),
        "torch int4 (bf16 x)": lambda x, i: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), t4[i][0], 32, t4[i][1]
        ),
        "dequantize + f32 mm": lambda x, i: x @ dequantize(int4[i]).t(),
        "float32 mm": lambda x, i: torch.mm(x, f32[i]),
    }


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"microseconds per call; weights cycled over {COPIES} copies (past the L2)")
    for name, (k, n) in SHAPES.items():
        w_list = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(COPIES)]
        kernels = _candidates(w_list)
        print(f"\n{name} [{k} -> {n}]   " + "".join(f"{f'M={m}':>10}" for m in ROWS))
        for label, fn in kernels.items():
            cells = []
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                calls = COPIES if m < 512 else 4
                cells.append(_timed(lambda i, fn=fn, x=x: fn(x, i % COPIES), calls))
            print(f"  {label:22}" + "".join(f"{c:>10.0f}" for c in cells))


if __name__ == "__main__":
    main()
