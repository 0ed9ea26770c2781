"""int5 tiles (GGUF's Q5_0 / Q5_1 / Q5_K, 5 bits a weight) against what Q5_0 was served as
before (int8 groups of 32) and int4, int8 activations (tiles_a8.cpp): microseconds per GEMV
of a gate_up-size (3072 x 576) and an lm_head-size (49152 x 576) weight at 1 and 5 rows.
Weights cycle over copies past the L2, as in a decode step. `python -m bench.int5_gemv`."""

from __future__ import annotations

import time

import torch

from backend.runner.quant.formats import QuantizedWeight, pack_high_bits, pack_int4, quantize, tile_weight
from backend.runner.quant.matmul import quant_linear

SHAPES = {"gate_up": (3072, 576), "lm_head": (49152, 576)}  # (out, in)
ROWS = (1, 5)


def _weight(kind: str, out_features: int, in_features: int) -> QuantizedWeight:
    w = torch.randn(out_features, in_features) * 0.02
    if kind == "int8":  # Q5_0 before int5: int8 g32 symmetric
        weight = quantize(w, "int8", 32, True)
    elif kind == "int4":
        weight = quantize(w, "int4", 32, False)
    else:
        q = torch.randint(0, 32, (out_features, in_features), dtype=torch.uint8)
        scales, mins = torch.rand(out_features, in_features // 32) * 0.01, -torch.rand(out_features, in_features // 32)
        weight = QuantizedWeight("int5", pack_int4(q & 0xF), scales, mins, 32, pack_high_bits(q >> 4))
    weight.tiles = tile_weight(weight, "int8")
    return weight


def _microseconds(weights: list[QuantizedWeight], x: torch.Tensor, rounds: int = 30) -> float:
    """The fastest of `rounds` passes over the copies, per call: the machine is shared, and
    a slow pass is another process's time."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for w in weights:
            quant_linear(x, w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best * 1e6


def main() -> None:
    print(f"{torch.get_num_threads()} threads")
    for name, (out_features, in_features) in SHAPES.items():
        copies = max(4, (64 << 20) // (out_features * in_features))  # ~64 M weights or more: past every cache
        for kind in ("int5", "int8", "int4"):
            weights = [_weight(kind, out_features, in_features) for _ in range(copies)]
            mb = weights[0].tiles.data.numel() / 1e6
            times = [_microseconds(weights, torch.randn(rows, in_features)) for rows in ROWS]
            cells = "  ".join(f"{rows} row(s): {t:7.1f} us" for rows, t in zip(ROWS, times, strict=True))
            print(f"{name:8} {kind}: {mb:5.2f} MB of tiles data  {cells}")


if __name__ == "__main__":
    main()
