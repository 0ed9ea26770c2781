"""Fixtures of the quantized kernels' tests."""

from __future__ import annotations

import pytest

from backend.runner.quant import kernels


@pytest.fixture
def use_activations(monkeypatch):
    """Sets QUANT_ACTIVATIONS for the test (kernels.activations reads it once); undone after."""

    def use(name: str) -> None:
        monkeypatch.setenv("QUANT_ACTIVATIONS", name)
        kernels.activations.cache_clear()

    yield use
    monkeypatch.undo()
    kernels.activations.cache_clear()
