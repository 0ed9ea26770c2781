"""Every GGUF block type we serve read as our QuantizedWeight: `formats.dequantize` of it is the
`gguf` package's dequantization of the same blocks (llama.cpp's), bit for bit in float32; the
types we have no kernel for (IQ, TQ, FP4) within half an int8 step of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from backend.runner.quant.formats import QuantizedWeight, concat_rows, dequantize
from backend.runner.quant.gguf_blocks import read_tensor_table
from backend.runner.quant.gguf_formats import BLOCK_TYPES, common_format, to_weight

ROWS, COLS = 6, 768  # several rows of 3 super-blocks (24 blocks of 32)
# (kind, group, with mins) of each quantized type
FORMATS = {
    "Q4_0": ("int4", 32, True), "Q4_1": ("int4", 32, True), "Q4_K": ("int4", 32, True),
    "Q8_0": ("int8", 32, False), "Q5_0": ("int5", 32, True), "Q5_1": ("int5", 32, True),
    "Q5_K": ("int5", 32, True), "Q6_K": ("int8", 16, False), "Q3_K": ("int8", 16, False),
    "Q2_K": ("int8", 16, True),
}  # fmt: skip
# where the float16 d (and dmin) of the blocks the package cannot make are
HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random weights as `type_name`: the package's quantization where it has one, else random
    bytes with sane float16 scales (uint8 [rows, bytes per row]; F32/F16: a float array)."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if type_name == "F32":
        return weights
    if type_name not in HALVES:
        return quants.quantize(weights, GGMLQuantizationType[type_name])
    block = BLOCK_TYPES[type_name]
    raw = rng.integers(0, 256, (rows, cols // block.weights, block.bytes), dtype=np.uint8)
    for at in HALVES[type_name]:
        half = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = half[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    writer = GGUFWriter(path, "llama")
    writer.add_string("general.name", "test")
    for name, (type_name, data) in tensors.items():
        raw_dtype = None if data.dtype != np.uint8 else GGMLQuantizationType[type_name]
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def as_float(weight: QuantizedWeight | torch.Tensor) -> torch.Tensor:
    return dequantize(weight) if isinstance(weight, QuantizedWeight) else weight


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    """A GGUF file with a [ROWS, COLS] tensor of every served type, a 3-D one, and an IQ4_NL one."""
    path = tmp_path_factory.mktemp("gguf") / "every.gguf"
    tensors = {f"{name}.weight": (name, blocks(name, ROWS, COLS, seed)) for seed, name in enumerate(BLOCK_TYPES)}
    tensors["experts.weight"] = ("Q4_K", blocks("Q4_K", 2 * 3, 512).reshape(2, 3, -1))
    iq4 = np.random.default_rng(9).integers(0, 256, (ROWS, COLS // 32, 18), dtype=np.uint8)
    iq4[..., :2] = np.full(iq4.shape[:2], 0.01, np.float16)[..., None].view(np.uint8)  # sane scales
    iq4 = iq4.reshape(ROWS, -1)
    tensors["iq.weight"] = ("IQ4_NL", iq4)
    write_gguf(path, tensors)
    return path


def test_every_type_is_the_packages_dequantization_bit_for_bit(every_type):
    theirs = {t.name: t for t in GGUFReader(every_type).tensors}
    ours = {t.name: t for t in read_tensor_table(every_type)}
    assert set(ours) == set(theirs)  # every tensor listed, the unserved one too
    for name in BLOCK_TYPES:
        tensor, reference = ours[f"{name}.weight"], theirs[f"{name}.weight"]
        assert (tensor.type_name, tensor.rows, tensor.cols, tensor.shape) == (name, ROWS, COLS, (ROWS, COLS))
        raw = np.asarray(reference.data)
        assert np.array_equal(tensor.data, raw.view(np.uint8).reshape(tensor.data.shape)), name  # byte sizes
        weight = tensor.weight()
        want = torch.from_numpy(quants.dequantize(raw, reference.tensor_type).reshape(ROWS, COLS).copy())
        got = as_float(weight)
        # equal values: the very bits, but for a zero's sign (llama.cpp's d * 0 is -0.0 for a negative d)
        assert got.dtype == torch.float32 and torch.equal(got, want), name
        if name in FORMATS:
            assert (weight.kind, weight.group, weight.mins is not None) == FORMATS[name], name
            assert weight.q.is_contiguous() and weight.q.dtype == (torch.int8 if weight.kind == "int8" else torch.uint8)
            if weight.kind == "int5":  # 5 bits a weight: the nibbles and a plane of high bits
                assert weight.qh.dtype == torch.uint8 and weight.qh.shape == (ROWS, COLS // 8)
                assert weight.nbytes == ROWS * COLS * 5 // 8 + 2 * 4 * ROWS * COLS // 32
            assert weight.scales.shape == (ROWS, COLS // weight.group)
        else:
            assert not isinstance(weight, QuantizedWeight)


def test_a_three_dimensional_tensor_is_its_rows(every_type):
    tensor = {t.name: t for t in read_tensor_table(every_type)}["experts.weight"]
    assert (tensor.rows, tensor.cols, tensor.shape) == (6, 512, (2, 3, 512))
    want = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType.Q4_K)
    assert torch.equal(dequantize(tensor.weight()), torch.from_numpy(want.copy()))


# types without a kernel of ours, and where their float16 scale sits (MXFP4: an exponent byte)
REQUANTIZED = {"IQ4_NL": 0, "IQ4_XS": 0, "IQ3_S": 0, "IQ2_XXS": 0, "TQ2_0": 64, "MXFP4": None}


@pytest.mark.parametrize("type_name", list(REQUANTIZED))
def test_the_iq_tq_and_fp4_types_are_their_dequantization_in_int8_groups_of_32(type_name):
    kind = GGMLQuantizationType[type_name]
    per_block, size = GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(3).integers(0, 256, (ROWS, COLS // per_block, size), dtype=np.uint8)
    at = REQUANTIZED[type_name]
    if at is None:
        raw[..., 0] = 120  # 2 ** -7
    else:
        raw[..., at : at + 2] = np.full(raw.shape[:2], 0.01, np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(ROWS, -1)
    weight = to_weight(type_name, raw, ROWS, COLS)
    assert isinstance(weight, QuantizedWeight) and (weight.kind, weight.group) == ("int8", 32)
    want = torch.from_numpy(quants.dequantize(raw, kind)).reshape(ROWS, COLS // 32, 32)
    step = want.abs().amax(-1, keepdim=True) / 127  # a group's int8 step
    error = (dequantize(weight).reshape(want.shape) - want).abs()
    assert bool((error <= step / 2 + 1e-7).all()) and float(step.max()) > 0


def test_an_iq_tensor_in_a_file_is_listed_and_requantized(every_type):
    iq = {t.name: t for t in read_tensor_table(every_type)}["iq.weight"]
    assert iq.type_name == "IQ4_NL" and (iq.rows, iq.cols) == (ROWS, COLS)
    assert isinstance(iq.weight(), QuantizedWeight) and iq.weight().kind == "int8"


def test_a_type_the_gguf_package_cannot_dequantize_is_refused_naming_it():
    with pytest.raises(ValueError, match="GGUF block type type 99 is not served"):
        to_weight("type 99", np.zeros((ROWS, COLS), np.uint8), ROWS, COLS)


def test_a_truncated_file_is_named_truncated(every_type, tmp_path):
    data = every_type.read_bytes()
    first_data = min(int(t.data_offset) for t in GGUFReader(every_type).tensors)
    for size in (0, 10, 30, 60, first_data - 100, first_data - 1, first_data + 100, len(data) - 1000):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match="truncated"):
            read_tensor_table(cut)


def weights(*type_names: str) -> list[QuantizedWeight]:
    return [to_weight(t, blocks(t, ROWS, COLS, seed), ROWS, COLS) for seed, t in enumerate(type_names)]


@pytest.mark.parametrize(
    "types,want",
    [
        (("Q4_K", "Q4_K", "Q6_K"), ("int8", 16, True)),  # a Q4_K_M file's attn_q, attn_k, attn_v
        (("Q4_0", "Q4_K", "Q4_1"), ("int4", 32, True)),  # int4 all: as they are
        (("Q8_0", "Q3_K", "Q6_K"), ("int8", 16, False)),  # symmetric all: still no mins
        (("Q8_0", "Q5_0", "Q6_K"), ("int8", 16, True)),  # Q5_0 is int5 with mins: mins 0 for the rest
        (("Q5_0", "Q4_K", "Q5_K"), ("int5", 32, True)),  # int5 meets int4: high bits 0
        (("Q4_0", "Q5_1"), ("int5", 32, True)),
        (("Q5_1", "Q8_0"), ("int8", 32, True)),  # int5 meets int8: q 0..31
        (("Q8_0", "Q4_1"), ("int8", 32, True)),  # symmetric + with mins: mins 0
        (("Q2_K", "Q3_K", "Q5_K", "Q5_1"), ("int8", 16, True)),
    ],
)
def test_common_format_keeps_every_parts_values(types, want):
    parts = weights(*types)
    common = common_format(parts)
    assert common is not None and len(common) == len(parts)
    assert {(w.kind, w.group, w.mins is not None) for w in common} == {want}
    for part, same in zip(parts, common, strict=True):
        assert torch.equal(dequantize(same), dequantize(part))
    fused = concat_rows(common)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))


def test_common_format_of_a_float_part_is_none():
    parts = weights("Q4_K", "Q6_K") + [to_weight("F16", blocks("F16", ROWS, COLS).view(np.uint8), ROWS, COLS)]
    assert isinstance(parts[-1], torch.Tensor)
    assert common_format(parts) is None
