"""The quantized matmuls against their own reference: `dequantize` then a float64 matmul.

Every path `quant_linear` can take is checked: the GEMV kernels (float32 activations, exact
up to summation order; the tiles' at every row count), the dequantize-then-GEMM for many rows (float32, exact; or with
QUANT_GEMM=bf16, bf16 rounding of the activations and weights), and the plain fallback;
int8 and int4, with and without zero points, several group sizes and row counts, with and
without a bias. The int4 packing is
checked against GGUF's Q4_1 block layout written out by hand.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from backend import kernels
from backend.runner.quant.apply import QuantSpec
from backend.runner.quant.formats import (
    TILE,
    QuantizedWeight,
    dequantize,
    pack_int4,
    quantize,
    tile_weight,
    unpack_int4,
)
from backend.runner.quant.matmul import GEMV_MAX_ROWS, quant_linear

needs_kernels = pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")
FORMATS = [
    ("int8", 32, True),
    ("int8", 64, False),
    ("int8", 128, True),
    ("int4", 32, False),
    ("int4", 64, True),
    ("int4", 128, False),
]


def _weight(out_features: int, in_features: int, kind: str, group: int, symmetric: bool) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05 + 0.01
    return quantize(w, kind, group, symmetric)


def _reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ dequantize(weight).double().t()
    return y if bias is None else y + bias.double()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@needs_kernels
@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 12, 16, 33, 48])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_kernel_matches_its_reference(kind, group, symmetric, rows, with_bias):
    weight = _weight(200, 384, kind, group, symmetric)  # 200: not a multiple of any tile
    if rows > GEMV_MAX_ROWS[kind]:
        pytest.skip(f"{kind} multiplies {rows} rows by the GEMM")
    _check_quant_linear(weight, rows, with_bias)


def _check_quant_linear(weight: QuantizedWeight, rows: int, with_bias: bool) -> None:
    """quant_linear on `rows` rows of x (and a bias) against the reference, for a 200 x 384 weight."""
    x = torch.randn(rows, 384)
    bias = torch.randn(200) if with_bias else None
    got = quant_linear(x, weight, bias)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    assert _relative_error(got, _reference(x, weight, bias)) < 1e-6


@needs_kernels
@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
@pytest.mark.parametrize("rows", [49, 100])
def test_many_rows_go_through_a_float32_gemm_on_the_exact_weights(kind, group, symmetric, rows):
    assert rows > GEMV_MAX_ROWS[kind]
    weight = _weight(256, 512, kind, group, symmetric)
    x = torch.randn(rows, 512)
    bias = torch.randn(256)
    got = quant_linear(x, weight, bias)
    assert _relative_error(got, _reference(x, weight, bias)) < 1e-6


@needs_kernels
@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
@pytest.mark.parametrize("rows", [49, 100])
def test_quant_gemm_bf16_matches_within_bf16_rounding(kind, group, symmetric, rows):
    weight = _weight(256, 512, kind, group, symmetric)
    weight.gemm_dtype = torch.bfloat16  # QUANT_GEMM=bf16 (apply.quantize_model sets it at load)
    x = torch.randn(rows, 512)
    bias = torch.randn(256)
    got = quant_linear(x, weight, bias)
    assert _relative_error(got, _reference(x, weight, bias)) < 1e-2  # bf16: 8 bits of mantissa on x and on w
    # exactly oneDNN's bf16 GEMM on the dequantized weights
    exact = torch.nn.functional.linear(x.bfloat16(), dequantize(weight).bfloat16()).float() + bias
    assert torch.equal(got, exact)


@needs_kernels
@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
def test_dequant_is_the_reference(kind, group, symmetric):
    weight = _weight(64, 256, kind, group, symmetric)
    mins = torch.empty(0) if weight.mins is None else weight.mins
    bits = 4 if kind == "int4" else 8
    lib = kernels.native()
    none = torch.empty(0)
    assert torch.equal(lib.dequant(weight.q, weight.scales, mins, weight.group, bits, False, none), dequantize(weight))
    bf16 = lib.dequant(weight.q, weight.scales, mins, weight.group, bits, True, none)
    assert torch.equal(bf16, dequantize(weight).bfloat16())
    buffer = torch.full((64 * 256 + 5,), 7.0)  # written into a larger, reused buffer
    assert torch.equal(
        lib.dequant(weight.q, weight.scales, mins, weight.group, bits, False, buffer), dequantize(weight)
    )
    assert (buffer[64 * 256 :] == 7.0).all()


def _tiled(weight: QuantizedWeight) -> QuantizedWeight:
    weight.tiles = tile_weight(weight)
    assert weight.tiles is not None
    return weight


@needs_kernels
@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 48, 49, 100, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_gemv_matches_its_reference_at_every_row_count(kind, group, symmetric, rows, with_bias):
    _check_quant_linear(_tiled(_weight(200, 384, kind, group, symmetric)), rows, with_bias)


@needs_kernels
def test_tiled_weights_of_a_wide_layer_are_read_in_chunks():
    # 1024 blocks of 32 inputs: one tile is ~96 KB, a thread's chunk of tiles a few of them
    weight = _tiled(_weight(64, 32768, "int4", 32, False))
    x = torch.randn(7, 32768)
    assert _relative_error(quant_linear(x, weight), _reference(x, weight, None)) < 1e-6


@needs_kernels
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(kind):
    """Passes of 1 to 4 rows reduce their accumulators differently (tiles.cpp `reduce_tile`),
    and a prefill's many rows read the tiles decoded once (`grouped_passes`), all in the
    same order of additions: a sequence's logits never depend on its batch, so a verify
    step's rows equal plain decoding's."""
    weight = _tiled(_weight(96, 256, kind, 32, kind == "int8"))
    x = torch.randn(150, 256)
    together = quant_linear(x, weight)
    for size in (1, 2, 3, 5, 130):
        for start in range(0, 150 - size + 1, size):
            assert torch.equal(quant_linear(x[start : start + size], weight), together[start : start + size])


@needs_kernels
def test_a_kernel_lets_other_python_threads_run():
    """The kernels release the GIL: in the model's stub the sender thread keeps sending while a
    step computes. A thread stamps the time in a loop; during one long kernel call, stamps
    land inside the call, which the GIL held would forbid (but for a switch interval at
    either end)."""
    weight = _tiled(_weight(3072, 576, "int4", 32, False))
    margin = 2 * sys.getswitchinterval()
    x = torch.randn(2048, 576)
    while _timed(quant_linear, x, weight) < 8 * margin and len(x) < 65536:
        x = torch.cat([x, x])  # long enough to tell on any CPU
    stamps: list[float] = []
    done = threading.Event()

    def stamp() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=stamp)
    thread.start()
    try:
        time.sleep(0.02)
        start = time.perf_counter()
        quant_linear(x, weight)
        end = time.perf_counter()
    finally:
        done.set()
        thread.join()
    assert end - start > 4 * margin, "the call was too short to tell"
    assert sum(start + margin < t < end - margin for t in stamps) > 100


def _timed(call, *args) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


@needs_kernels
@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
def test_tiled_weights_past_the_gemv_rows_take_the_bf16_gemm_when_asked(kind, group, symmetric):
    weight = _tiled(_weight(256, 512, kind, group, symmetric))
    weight.gemm_dtype = torch.bfloat16  # QUANT_GEMM=bf16
    x = torch.randn(GEMV_MAX_ROWS[kind] + 1, 512)
    exact = torch.nn.functional.linear(x.bfloat16(), dequantize(weight).bfloat16()).float()
    assert torch.equal(quant_linear(x, weight), exact)


@needs_kernels
def test_a_weights_gemv_max_rows_moves_the_crossover():
    """QUANT_GEMV_MAX_ROWS (a weight's `gemv_max_rows`, set at load): past it the rows go to
    the GEMM (here bf16's, which gives other numbers than the GEMV)."""
    weight = _weight(200, 384, "int4", 32, False)  # no tiles: the GEMV / GEMM choice applies
    weight.gemm_dtype = torch.bfloat16
    x = torch.randn(5, 384)
    bf16 = torch.nn.functional.linear(x.bfloat16(), dequantize(weight).bfloat16()).float()
    assert _relative_error(quant_linear(x, weight), _reference(x, weight, None)) < 1e-6  # 5 <= 48: the GEMV
    weight.gemv_max_rows = 4
    assert torch.equal(quant_linear(x, weight), bf16)


@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
def test_tiles_hold_the_weights_four_rows_side_by_side(kind, group, symmetric):
    weight = _weight(8, 256, kind, group, symmetric)
    tiles = tile_weight(weight)
    block_bytes = 16 if kind == "int4" else 32
    assert tiles.data.shape == (8 // TILE, 256 // 32, TILE, block_bytes)
    stored_mins = weight.mins is not None and not symmetric  # symmetric: the scales alone (int4: -8 x scale)
    params = 2 * TILE if stored_mins else TILE
    assert tiles.params.shape == (8 // TILE, 256 // 32, params)
    for row in range(8):
        for block in range(256 // 32):
            tile, t = divmod(row, TILE)
            want = weight.q[row, block * block_bytes : (block + 1) * block_bytes]
            assert torch.equal(tiles.data[tile, block, t], want)
            group_index = block * 32 // group
            assert tiles.params[tile, block, t] == weight.scales[row, group_index]
            if stored_mins:
                assert tiles.params[tile, block, TILE + t] == weight.mins[row, group_index]
    assert tile_weight(_weight(6, 256, kind, group, symmetric)) is None  # rows that make no whole tiles


def test_a_bad_quant_gemm_is_refused():
    with pytest.raises(ValueError, match="QUANT_GEMM must be one of float32, bf16"):
        QuantSpec("int4", gemm="fp8")


@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
def test_fallback_for_other_dtypes_is_the_reference(kind, group, symmetric):
    weight = _weight(48, 256, kind, group, symmetric)
    x = torch.randn(3, 256, dtype=torch.float64)
    got = quant_linear(x, weight)
    assert got.dtype == torch.float64
    assert torch.allclose(got, _reference(x, weight, None), rtol=1e-6, atol=1e-6)


def test_int4_packing_is_ggufs_q4_1_block_layout():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    for row in range(3):
        for block in range(2):
            for j in range(16):
                byte = int(packed[row, block * 16 + j])
                assert byte & 0xF == q[row, block * 32 + j] and byte >> 4 == q[row, block * 32 + j + 16]
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("kind,group,symmetric", FORMATS)
def test_quantization_error_is_within_half_a_step(kind, group, symmetric):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 256, generator=gen)
    qw = quantize(w, kind, group, symmetric)
    step = qw.scales.abs().repeat_interleave(group, dim=1)
    # symmetric int4 (Q4_0) puts the largest magnitude on -8, so the other side's +8 is clamped to +7
    bound = step if kind == "int4" and symmetric else step / 2
    assert ((dequantize(qw) - w).abs() <= bound + 1e-6).all()


def test_a_transposed_weight_quantizes_to_contiguous_tensors():
    w_t = torch.randn(64, 96)  # [in, out], as our float parameters are stored
    qw = quantize(w_t.t(), "int8", 32, True)
    assert qw.q.is_contiguous() and qw.scales.is_contiguous()
    assert torch.allclose(dequantize(qw), w_t.t(), atol=qw.scales.max().item())


def test_bad_formats_are_refused():
    w = torch.randn(8, 96)
    with pytest.raises(ValueError, match="QUANT must be one of"):
        quantize(w, "int3", 32, False)
    with pytest.raises(ValueError, match="QUANT_GROUP_SIZE=64"):
        quantize(w, "int4", 64, False)  # 96 inputs: not a multiple of 64


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("width", [576, 100])  # 100: a tail past the 16-wide vectors
def test_rms_norm_matches_pytorchs(rows, width):
    x, weight = torch.randn(rows, width) * 3, torch.randn(width)
    got = kernels.rms_norm(x, weight, 1e-5)
    want = torch.nn.functional.rms_norm(x.double(), (width,), weight.double(), 1e-5)
    assert _relative_error(got, want) < 1e-6
    assert torch.equal(kernels.rms_norm(x.double(), weight.double(), 1e-5), want)  # elsewhere: PyTorch's own
