"""The runner's block copy (a forked beam's partial block): every layer's keys and values."""

from __future__ import annotations

import torch

from backend.runner.model_runner import ModelRunner
from backend.settings.engine import EngineConfig
from tests.helpers.lora_models import write_tiny_llama


def test_copy_blocks_copies_keys_and_values_in_every_layer(tmp_path):
    runner = ModelRunner(EngineConfig(model_path=str(write_tiny_llama(tmp_path / "m")), device="cpu", num_blocks=6))
    for cache in runner.kv_caches:
        cache.copy_(torch.randn_like(cache))
    before = [cache.clone() for cache in runner.kv_caches]
    runner.copy_blocks([(1, 4), (2, 5)])
    for cache, old in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(cache[:, 4], old[:, 1]) and torch.equal(cache[:, 5], old[:, 2])
        assert torch.equal(cache[:, :4], old[:, :4])  # the sources and the others untouched
