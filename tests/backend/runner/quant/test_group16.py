"""int8 weights in groups of 16 (formats.HALF: GGUF's Q6_K, Q3_K and Q2_K decode to them)
through every path quant_linear can take, against `dequantize` then a float64 matmul: the
tiles' GEMV with float32 activations (tiles.cpp) and with int8 ones (tiles_a8.cpp, against
the rounded activations), the row-layout GEMV of weights without tiles, the dequantize
before a GEMM; a row's numbers whatever its batch; the fused decode layer with group-16
linears beside group-32 ones. QUANT itself still makes only multiples of 32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend import kernels
from backend.runner.models.llama import DecoderLayer, LlamaForCausalLM
from backend.runner.quant.apply import LINEARS, QuantSpec
from backend.runner.quant.formats import (
    HALF,
    TILE,
    TILE_A8,
    QuantizedWeight,
    dequantize,
    dequantize_activations,
    quantize,
    quantize_activations,
    tile_weight,
)
from backend.runner.quant.matmul import quant_linear
from tests.backend.runner.quant.test_decode_layer import CONFIGS, _decode_logits, _quantized

needs_kernels = pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")
needs_vnni = pytest.mark.skipif(
    kernels.native() is None or "avx512_vnni" not in kernels.cpu_flags(), reason="no AVX-512 VNNI on this CPU"
)
ROWS = [1, 3, 8, 17, 64]
# (q's range, mins): Q6_K's -32..31 symmetric, Q2_K's 0..3 with a min, and int8's whole range
FORMATS = {"q6k-like": (-32, 32, False), "q2k-like": (0, 4, True), "full-range": (-128, 128, True)}
ACTIVATIONS = ["float32", pytest.param("int8", marks=needs_vnni)]


def _weight(out_features: int, in_features: int, fmt: str, seed: int = 0) -> QuantizedWeight:
    """Random group-16 weights as a K-quant decoder makes them: scales of either sign (Q3_K's
    d * (sc - 32)), mins below zero (Q2_K's -dmin * m)."""
    lo, hi, with_mins = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(lo, hi, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.randn(out_features, in_features // HALF, generator=gen) * 0.01
    mins = -torch.rand(out_features, in_features // HALF, generator=gen) * 0.02 if with_mins else None
    return QuantizedWeight("int8", q, scales, mins, HALF)


def _reference(x: torch.Tensor, weight: QuantizedWeight, activations: str, bias=None) -> torch.Tensor:
    if activations == "int8":
        x = dequantize_activations(*quantize_activations(x))
    y = x.double() @ dequantize(weight).double().t()
    return y if bias is None else y + bias.double()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def test_dequantize_reads_two_groups_a_block():
    weight = _weight(2, 32, "q2k-like")
    want = weight.q.float().reshape(2, 2, 16) * weight.scales[..., None] + weight.mins[..., None]
    assert torch.equal(dequantize(weight), want.reshape(2, 32))


def test_quant_keeps_refusing_groups_that_are_not_multiples_of_32():
    with pytest.raises(ValueError, match="QUANT_GROUP_SIZE=16 must be a multiple of 32"):
        quantize(torch.randn(8, 64), "int8", 16, True)
    int4 = QuantizedWeight("int4", torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 4), torch.ones(4, 4), 16)
    with pytest.raises(ValueError, match="not int4 g16"):  # int4 packs 32 a block
        tile_weight(int4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_hold_each_half_blocks_params(fmt):
    """formats.Tiles' group-16 layout: [tiles, blocks, 2 halves, scales (then mins) of the rows]."""
    weight = _weight(32, 64, fmt)
    for activations, rows in (("float32", TILE), ("int8", TILE_A8)):
        params = tile_weight(weight, activations).params
        per_half = rows * (1 if weight.mins is None else 2)
        assert params.shape == (32 // rows, 2, 2, per_half)
        # tile 1, block 1, half 0: its rows' scales are those of group 2
        assert torch.equal(params[1, 1, 0, :rows], weight.scales[rows : 2 * rows, 2])
        if weight.mins is not None:
            assert torch.equal(params[1, 1, 1, rows:], weight.mins[rows : 2 * rows, 3])


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_tiles_gemv_matches_its_reference(fmt, rows, activations, with_bias):
    weight = _weight(96, 256, fmt, seed=rows)
    weight.tiles = tile_weight(weight, activations)
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, 256, generator=gen)
    x[0, :32] = 0  # an all-zero block of activations
    bias = torch.randn(96, generator=gen) if with_bias else None
    got = quant_linear(x, weight, bias)
    assert got.shape == (rows, 96)
    assert _relative_error(got, _reference(x, weight, activations, bias)) < 1e-6
    if activations == "int8":  # and it is the int8 path: float32 activations give other numbers
        assert (got.double() - _reference(x, weight, "float32", bias)).abs().max().item() > 1e-5


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", ROWS)
def test_a_weight_without_tiles_takes_the_row_gemv(fmt, rows):
    weight = _weight(50, 256, fmt, seed=rows)  # 50 rows: no whole tiles of either kind
    assert tile_weight(weight, "float32") is None and tile_weight(weight, "int8") is None
    x = torch.randn(rows, 256)
    bias = torch.randn(50)
    assert _relative_error(quant_linear(x, weight, bias), _reference(x, weight, "float32", bias)) < 1e-6
    assert _relative_error(quant_linear(x, weight, gemv_rows=1), _reference(x, weight, "float32")) < 1e-6


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_is_the_reference_and_feeds_the_bf16_gemm(fmt):
    weight = _weight(50, 256, fmt)
    lib, none = kernels.native(), torch.empty(0)
    mins = none if weight.mins is None else weight.mins
    assert torch.equal(lib.dequant(weight.q, weight.scales, mins, HALF, 8, False, none), dequantize(weight))
    assert torch.equal(lib.dequant(weight.q, weight.scales, mins, HALF, 8, True, none), dequantize(weight).bfloat16())
    weight.gemm_dtype = torch.bfloat16  # QUANT_GEMM=bf16: past the GEMV's rows, oneDNN's GEMM
    x = torch.randn(64, 256)
    want = F.linear(x.bfloat16(), dequantize(weight).bfloat16()).float()
    assert torch.equal(quant_linear(x, weight), want)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ["float32", pytest.param("int8", marks=needs_vnni), "rows"])
def test_a_rows_numbers_do_not_depend_on_its_batch(fmt, path):
    """Batch invariance: each of 64 rows, alone or among 1..64, the same numbers bit for bit."""
    weight = _weight(48 if path != "rows" else 50, 128, fmt)
    weight.tiles = None if path == "rows" else tile_weight(weight, path)
    x = torch.randn(64, 128)
    together = quant_linear(x, weight)
    for m in range(1, 65):
        assert torch.equal(quant_linear(x[:m], weight), together[:m]), m
    for r in (0, 17, 63):
        assert torch.equal(quant_linear(x[r : r + 1], weight), together[r : r + 1]), r


def _to_group16(weight: QuantizedWeight, activations: str) -> QuantizedWeight:
    """A layer's int8 g32 weight as int8 g16, from its float weights: symmetric per 16 (Q6_K's
    kind), with a different scale in each half of a block."""
    w = dequantize(weight).reshape(weight.out_features, -1, HALF)
    scales = (w.abs().amax(-1) / 31).clamp(min=1e-8)
    q = torch.round(w / scales[..., None]).clamp(-32, 31).to(torch.int8).reshape(weight.out_features, -1)
    half = QuantizedWeight("int8", q, scales, None, HALF)
    half.tiles = tile_weight(half, activations)
    return half


@needs_kernels
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_the_fused_decode_layer_takes_group16_linears(activations, tmp_path, monkeypatch):
    """qkv and down in groups of 16 (as a Q4_K_M file's Q6_K ones), o and gate_up int8 g32:
    the fused layer and the layer-by-layer path, the same numbers bit for bit."""
    model = _quantized(CONFIGS["qwen2-bias"](), tmp_path, "int8", activations)
    group32 = _decode_logits(model, [[3, 1, 4, 1, 5]], steps=1)[0]
    for layer in model.layers:
        for attr in ("qkv_t", "down_t"):
            setattr(layer, attr, _to_group16(getattr(layer, attr), activations))
        layer._decode_operands = None  # made by the first run, from the group-32 tiles
        assert {getattr(layer, a).group for a in LINEARS} == {HALF, 32}
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
    # the weights changed (6-bit, per 16): other logits than group 32's, close to them
    first = _decode_logits(model, [[3, 1, 4, 1, 5]], steps=1)[0]
    assert 0 < (first - group32).abs().max().item() < 0.1 * group32.abs().max().item()


def test_quant_spec_still_takes_group_32():
    assert QuantSpec("int8").group == 32
