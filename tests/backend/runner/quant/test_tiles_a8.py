"""QUANT_ACTIVATIONS=int8: tiles of int4 and int8 weights times activations rounded to int8 per
32 (tiles_a8.cpp) against its own reference, `quantize_activations` then `dequantize` and a
float64 matmul; the rounding reference against hand-checked values; the setting's refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from backend import kernels
from backend.runner.loader import load_model
from backend.runner.quant.apply import LINEARS, QuantSpec, quantize_model
from backend.runner.quant.formats import dequantize, dequantize_activations, quantize, quantize_activations, tile_weight
from backend.runner.quant.matmul import activations_for, quant_linear

needs_vnni = pytest.mark.skipif(
    kernels.native() is None or "avx512_vnni" not in kernels.cpu_flags(), reason="no AVX-512 VNNI on this CPU"
)


def _reference(x: torch.Tensor, weight, bias) -> torch.Tensor:
    xq = dequantize_activations(*quantize_activations(x))
    y = xq.double() @ dequantize(weight).double().t()
    return y if bias is None else y + bias.double()


def test_activations_round_per_block_of_32():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.54, 1.27, 32)
    x[0, 5] = 0.0101  # 0.0101 / 0.02 = 0.505: rounds up to 1
    q, d = quantize_activations(x)
    assert d[0, 0].item() == pytest.approx(0.02) and q[0, 0].item() == -127 and q[0, 5].item() == 1
    assert d[0, 1].item() == 0 and d[1].eq(0).all() and q[1].eq(0).all()  # all-zero blocks
    assert q.abs().max().item() <= 127


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 48, 300])
@pytest.mark.parametrize("in_features, group", [(96, 32), (384, 128), (576, 32), (576, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kind, symmetric", [("int4", False), ("int8", False), ("int8", True)])
def test_int8_activation_kernel_matches_its_reference(rows, in_features, group, with_bias, kind, symmetric):
    gen = torch.Generator().manual_seed(rows * 100 + in_features)
    weight = quantize(torch.randn(208, in_features, generator=gen) * 0.05 + 0.01, kind, group, symmetric)
    weight.tiles = tile_weight(weight, "int8")
    x = torch.randn(rows, in_features, generator=gen)
    x[0, :32] = 0  # an all-zero block
    bias = torch.randn(208, generator=gen) if with_bias else None
    got = quant_linear(x, weight, bias)
    want = _reference(x, weight, bias)
    assert got.shape == (rows, 208)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    # and it is the int8 path: float32 activations give other numbers
    exact = x.double() @ dequantize(weight).double().t() + (0 if bias is None else bias.double())
    assert (got.double() - exact).abs().max().item() > 1e-5


@needs_vnni
def test_a_weight_without_tiles_keeps_float32_activations():
    untiled = quantize(torch.randn(66, 128) * 0.05, "int4", 32, False)
    assert tile_weight(untiled, "int8") is None
    x = torch.randn(3, 128)
    exact = x.double() @ dequantize(untiled).double().t()
    assert ((quant_linear(x, untiled).double() - exact).norm() / exact.norm()).item() < 1e-6


def test_a_bad_or_unusable_setting_is_refused():
    with pytest.raises(ValueError, match="QUANT_ACTIVATIONS must be one of auto, float32, int8"):
        QuantSpec("none", 32, activations="int4")
    if "avx512_vnni" in kernels.cpu_flags():
        with pytest.raises(ValueError, match="needs int4 or int8 weights and our kernels; QUANT is none"):
            quantize_model(torch.nn.Module(), QuantSpec("none", 32, activations="int8"))
    else:
        with pytest.raises(ValueError, match="QUANT_ACTIVATIONS=int8 needs a CPU with AVX-512 VNNI"):
            quantize_model(torch.nn.Module(), QuantSpec("int4", 32, activations="int8"))


@pytest.mark.parametrize("setting", ["auto", "float32", "int8"])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_auto_gives_int4_weights_int8_activations_and_the_tiles_carry_them(tmp_path, setting, kind):
    """QUANT_ACTIVATIONS=auto (the default): int8 activations for int4 linears where the CPU
    has VNNI (llama.cpp's arithmetic on Q4_1), float32 for int8 ones; every tile of the
    model, the lm_head's too, is multiplied alike."""
    vnni = "avx512_vnni" in kernels.cpu_flags()
    if setting == "int8" and not vnni:
        pytest.skip("no AVX-512 VNNI on this CPU")
    want = {"auto": "int8" if kind == "int4" and vnni else "float32"}.get(setting, setting)
    assert activations_for(kind, setting) == want
    if kernels.native() is None:
        return
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    quantize_model(model, QuantSpec(kind, 32, activations=setting))
    tiles = [getattr(layer, a).tiles for layer in model.layers for a in LINEARS] + [model.lm_head_q.tiles]
    assert {t.activations for t in tiles} == {want}
