"""Fixtures of the quantized kernels' tests."""

from __future__ import annotations

import pytest

from backend.runner.quant import kernels


@pytest.fixture
def use_activations(monkeypatch):
    """Sets QUANT_ACTIVATIONS for the models the test loads (kernels.activations reads it once);
    undone after."""

    def use(name: str) -> None:
        monkeypatch.setenv("QUANT_ACTIVATIONS", name)
        kernels.activations.cache_clear()

    yield use
    monkeypatch.undo()
    kernels.activations.cache_clear()


@pytest.fixture(autouse=True)
def float32_activations(use_activations):
    """These tests hold the kernels to float32's numbers: QUANT_ACTIVATIONS=float32 unless a
    test asks for another (auto would give int4 models int8 activations; test_tiles_a8 has
    its own tests)."""
    use_activations("float32")
