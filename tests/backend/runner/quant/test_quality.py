"""QUANT's quality on the default model, measured on the held-out text and prompts of
bench/quality.py (text no other test uses), with thresholds set from what was measured.

Measured (2 cores, `python -m bench.quality`; docs/quantization.md): the default model's
float32 weights are its GGUF's Q4_1 blocks dequantized, so int4 g32 with zero points (the
GGUF's blocks as they are) and int8 g32 with zero points (whose 256 levels hold Q4_1's 16
exactly) give float32's perplexity and 20/20 identical greedy prompts, one stream at a time
and batched. Symmetric int8 does not hold Q4_1's levels: +0.37% perplexity, 8/20 identical.
int4 with QUANT_ACTIVATIONS=int8 (llama.cpp's arithmetic, what QUANT_ACTIVATIONS=auto serves the
default model with): -0.09% perplexity, 1/20 identical. The greedy tests hold float32
activations (bench.quality's default), the weight formats' own loss.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from backend import kernels
from bench import quality

pytestmark = [pytest.mark.slow, pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")]


@pytest.fixture(scope="module")
def prompts(model_path):
    return quality.chat_prompts(AutoTokenizer.from_pretrained(model_path))


@pytest.fixture(scope="module")
def float32_tokens(model_path, prompts):
    return quality.greedy_tokens(str(model_path), "none", prompts, together=True)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_greedy_tokens_equal_float32s_on_most_held_out_prompts(model_path, prompts, float32_tokens, quant):
    tokens = quality.greedy_tokens(str(model_path), quant, prompts, together=True)
    identical, prefix = quality.agreement(float32_tokens, tokens)
    assert identical >= 18, f"{quant}: {identical}/20 prompts identical (measured 20/20), prefix kept {prefix:.0%}"


def test_symmetric_int8_stays_within_one_percent_of_float32_perplexity(model_path):
    ids = AutoTokenizer.from_pretrained(model_path)(quality.HELDOUT.read_text()).input_ids
    base, _ = quality.perplexity(quality.load(str(model_path), "none"), ids)
    int8, count = quality.perplexity(quality.load(str(model_path), "int8", 32, True), ids)
    assert count == 1275
    assert int8 / base - 1 < 0.01, f"int8 g32 symmetric: {int8:.4f} vs float32 {base:.4f} (measured +0.37%)"
    assert int8 != base  # symmetric int8 does not hold the Q4_1 levels: it is a real requantization


@pytest.mark.skipif("avx512_vnni" not in kernels.cpu_flags(), reason="no AVX-512 VNNI on this CPU")
def test_int4_with_int8_activations_stays_within_half_a_percent_of_float32(model_path):
    """QUANT_ACTIVATIONS=int8 (llama.cpp's own decode arithmetic) on the GGUF's Q4_1 blocks.
    On these 1275 tokens the figure moves with the order of the float additions alone (an
    activation rounded to int8 lands on the other side of a .5 and the change runs on through
    30 layers): -0.09% with 4-row tiles, +0.11% with a float64 matmul, +0.43% with 16-row
    tiles, against llama.cpp's +0.14% on the same file (docs/quantization.md). The bound is
    that band; the kernel's own error is held to 1e-6 by test_tiles_a8."""
    ids = AutoTokenizer.from_pretrained(model_path)(quality.HELDOUT.read_text()).input_ids
    base, _ = quality.perplexity(quality.load(str(model_path), "none"), ids)
    a8, _ = quality.perplexity(quality.load(str(model_path), "int4", 32, activations="int8"), ids)
    assert a8 / base - 1 < 0.005, f"int4 g32 a8: {a8:.4f} vs float32 {base:.4f} (measured +0.43%)"
    assert a8 != base  # the int8 activations' arithmetic, not float32's
