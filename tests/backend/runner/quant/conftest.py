"""Fixtures of the quantized kernels' tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def activations() -> str:
    """QUANT_ACTIVATIONS of the models these tests quantize (`QuantSpec(kind, activations=...)`):
    float32, so they hold the kernels to float32's numbers (auto would give int4 models int8
    activations; test_tiles_a8 has its own tests). A test parametrized on `activations`
    overrides it."""
    return "float32"
