"""int5 weights (formats.py: GGUF's Q5_0, Q5_1 and Q5_K, 5 bits a weight: int4's nibbles and a
plane of high bits) through every path quant_linear can take, against `dequantize` then a
float64 matmul: the tiles' GEMV with float32 activations (tiles.cpp), with int8 ones
(tiles_a8.cpp, against the rounded activations), weights without tiles; a row's numbers
whatever its batch; the fused decode layer with int5 linears beside int4 and int8 ones."""

from __future__ import annotations

import pytest
import torch

from backend import kernels
from backend.runner.models.llama import DecoderLayer, LlamaForCausalLM
from backend.runner.quant.formats import (
    QuantizedWeight,
    dequantize,
    pack_high_bits,
    pack_int4,
    quantize,
    tile_weight,
    unpack_high_bits,
    unpack_int4,
)
from backend.runner.quant.matmul import quant_linear
from tests.backend.runner.quant.test_decode_layer import CONFIGS, _decode_logits, _quantized
from tests.backend.runner.quant.test_group16 import _reference, _relative_error

needs_kernels = pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")
needs_vnni = pytest.mark.skipif(
    kernels.native() is None or "avx512_vnni" not in kernels.cpu_flags(), reason="no AVX-512 VNNI on this CPU"
)
ROWS = [1, 3, 8, 17, 64]
ACTIVATIONS = ["float32", pytest.param("int8", marks=needs_vnni)]


def _int5(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> QuantizedWeight:
    """q uint8 [out, in] in 0..31 -> int5 (the nibbles as int4's, the high bits in qh)."""
    return QuantizedWeight("int5", pack_int4(q & 0xF), scales, mins, 32, pack_high_bits(q >> 4))


def _weight(out_features: int, in_features: int, seed: int = 0, q5_0: bool = False) -> QuantizedWeight:
    """Random int5 weights: scales of either sign, mins as Q5_1 / Q5_K make them or Q5_0's -16 d."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 32, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = torch.randn(out_features, in_features // 32, generator=gen) * 0.01
    mins = -16 * scales if q5_0 else -torch.rand(out_features, in_features // 32, generator=gen) * 0.02
    return _int5(q, scales, mins)


def test_dequantize_and_nbytes():
    weight = _weight(4, 64)
    q = unpack_int4(weight.q) | (unpack_high_bits(weight.qh) << 4)
    want = q.float().reshape(4, 2, 32) * weight.scales[..., None] + weight.mins[..., None]
    assert torch.equal(dequantize(weight), want.reshape(4, 64))
    assert weight.nbytes == 4 * 64 * 5 // 8 + 2 * 4 * 2 * 4 and weight.in_features == 64


def test_the_high_bits_round_trip():
    high = torch.randint(0, 2, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_high_bits(pack_high_bits(high)), high)


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("q5_0", [False, True])
def test_the_tiles_gemv_matches_its_reference(rows, activations, q5_0):
    weight = _weight(96, 256, seed=rows, q5_0=q5_0)
    weight.tiles = tile_weight(weight, activations)
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, 256, generator=gen)
    x[0, :32] = 0  # an all-zero block of activations
    bias = torch.randn(96, generator=gen)
    got = quant_linear(x, weight, bias)
    assert got.shape == (rows, 96)
    assert _relative_error(got, _reference(x, weight, activations, bias)) < 1e-6
    if activations == "int8":  # and it is the int8 path: float32 activations give other numbers
        assert (got.double() - _reference(x, weight, "float32", bias)).abs().max().item() > 1e-5


@needs_kernels
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_every_level_of_every_input_position(activations):
    """One weight row per (level, position) pattern: a wrong shift or bit shows as a wrong output."""
    q = torch.zeros(32 * 16, 64, dtype=torch.uint8)
    for level in range(32):
        for i in range(16):  # row 16 * level + i: `level` at positions i, i + 16, i + 32, ...
            q[16 * level + i, i::16] = level
    weight = _int5(q, torch.ones(q.shape[0], 2), torch.full((q.shape[0], 2), -0.5))
    weight.tiles = tile_weight(weight, activations)
    x = torch.randn(5, 64)
    assert _relative_error(quant_linear(x, weight), _reference(x, weight, activations)) < 1e-6


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
def test_a_weight_without_tiles_is_dequantized(rows):
    weight = _weight(50, 256, seed=rows)  # 50 rows: no whole tiles of either kind
    assert tile_weight(weight, "float32") is None and tile_weight(weight, "int8") is None
    x = torch.randn(rows, 256)
    bias = torch.randn(50)
    assert _relative_error(quant_linear(x, weight, bias), _reference(x, weight, "float32", bias)) < 1e-6


@needs_kernels
@pytest.mark.parametrize("path", ["float32", pytest.param("int8", marks=needs_vnni)])
def test_a_rows_numbers_do_not_depend_on_its_batch(path):
    """Batch invariance: each of 64 rows, alone or among 1..64, the same numbers bit for bit."""
    weight = _weight(48, 128)
    weight.tiles = tile_weight(weight, path)
    x = torch.randn(64, 128)
    together = quant_linear(x, weight)
    for m in range(1, 65):
        assert torch.equal(quant_linear(x[:m], weight), together[:m]), m
    for r in (0, 17, 63):
        assert torch.equal(quant_linear(x[r : r + 1], weight), together[r : r + 1]), r


def _requantized(weight: QuantizedWeight, kind: str, activations: str) -> QuantizedWeight:
    """A layer's weight as int5 (32 levels from each group's min) or symmetric int8, from its floats."""
    w = dequantize(weight)
    if kind == "int8":
        out = quantize(w, "int8", 32, True)
    else:
        groups = w.reshape(w.shape[0], -1, 32)
        lo = groups.amin(-1)
        scales = ((groups.amax(-1) - lo) / 31).clamp(min=1e-8)
        q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 31).to(torch.uint8)
        out = _int5(q.reshape(w.shape), scales, lo)
    out.tiles = tile_weight(out, activations)
    return out


@needs_kernels
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_the_fused_decode_layer_takes_int5_linears(activations, tmp_path, monkeypatch):
    """qkv and down int5, o int8, gate_up int4 (as a Q4_K_M file's mix): the fused layer and
    the layer-by-layer path, the same numbers bit for bit."""
    model = _quantized(CONFIGS["qwen2-bias"](), tmp_path, "int4", activations)
    int4 = _decode_logits(model, [[3, 1, 4, 1, 5]], steps=1)[0]
    for layer in model.layers:
        for attr, kind in (("qkv_t", "int5"), ("down_t", "int5"), ("o_proj_t", "int8")):
            setattr(layer, attr, _requantized(getattr(layer, attr), kind, activations))
        layer._decode_operands = None  # made by the first run, from the int4 tiles
        assert layer.decode_operands() is not None
    prompts = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate([9, 20, 3])]
    calls = []
    fused_decode = DecoderLayer.decode
    monkeypatch.setattr(DecoderLayer, "decode", lambda self, *a: calls.append(1) or fused_decode(self, *a))
    fused = _decode_logits(model, prompts, steps=6)
    assert len(calls) == 7 * model.config.num_layers  # the prefill and each step, each layer, fused
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode", lambda *a: False)
    plain = _decode_logits(model, prompts, steps=6)
    assert all(torch.equal(got, want) for got, want in zip(fused, plain, strict=True))
    first = _decode_logits(model, [[3, 1, 4, 1, 5]], steps=1)[0]  # finer weights: close to int4's logits
    assert 0 < (first - int4).abs().max().item() < 0.1 * int4.abs().max().item()


@needs_kernels
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["int4", "int5"])
def test_symmetric_tiles_hold_the_scales_alone_and_give_the_same_numbers(kind, activations, monkeypatch):
    """Q4_0 / Q5_0 (mins -8 / -16 x the scales): tiles without mins, 4 bytes a row's block less;
    the kernels make each min, bit for bit the numbers of the tiles that store them."""
    weight = _weight(96, 256, q5_0=True)
    if kind == "int4":
        weight = quantize(dequantize(weight), "int4", 32, symmetric=True)
    with_mins = tile_weight(weight, activations)
    monkeypatch.setattr("backend.runner.quant.formats._symmetric", lambda w: False)
    stored = tile_weight(weight, activations)
    monkeypatch.undo()
    assert with_mins.params.shape[-1] * 2 == stored.params.shape[-1]
    x = torch.randn(5, 256)
    for rows in (1, 5):
        weight.tiles = with_mins
        ours = quant_linear(x[:rows], weight)
        weight.tiles = stored
        assert torch.equal(ours, quant_linear(x[:rows], weight))
