"""huge_pages.py: copies and zeroed tensors in regions advised as huge pages, and the
quantized model's tiles and the KV caches made there."""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from backend import kernels
from backend.runner import huge_pages
from backend.runner.drafters import allocate_kv
from backend.runner.loader import load_model
from backend.runner.quant.apply import LINEARS, QuantSpec, quantize_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_copies_are_equal_side_by_side_and_aligned():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.uint8), torch.empty(0), torch.randn(2, 2).half()]
    copies = huge_pages.copies(tensors)
    for got, want in zip(copies, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(t.data_ptr() % 64 == 0 for t in copies if t.numel())
    # one region: each copy right after the one before, on the next cache line
    assert copies[1].data_ptr() == copies[0].data_ptr() + 64 and copies[3].data_ptr() == copies[1].data_ptr() + 64
    copies[0].add_(1)  # a copy, not a view of the original
    assert not torch.equal(copies[0], tensors[0])


def test_zeros_and_the_kv_caches_on_the_cpu():
    z = huge_pages.zeros((2, 3, 4), torch.float16)
    assert z.shape == (2, 3, 4) and z.dtype == torch.float16 and not z.any()
    cfg = SimpleNamespace(num_kv_heads=1, head_dim=32)
    caches = allocate_kv(cfg, 2, num_blocks=5, block_size=4, dtype=torch.float32, device="cpu")
    assert [tuple(c.shape) for c in caches] == [(2, 5, 4, 1, 32)] * 2
    assert all(c.data_ptr() % huge_pages.HUGE_PAGE == 0 and not c.any() for c in caches)


def _mapping(address: int) -> list[str] | None:
    """The /proc/self/smaps entry of the mapping holding `address`, or None."""
    entry: list[str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            low, high = (int(a, 16) for a in first.split("-"))
            if entry is not None:
                return entry
            entry = [line] if low <= address < high else None
        elif entry is not None:
            entry.append(line)
    return entry


@pytest.mark.skipif("[madvise]" not in (THP.read_text() if THP.exists() else ""), reason="THP is not 'madvise' here")
def test_a_region_gets_huge_pages_where_advised_and_goes_with_its_tensor():
    """With THP 'madvise' (this machine's), a touched region is backed by huge pages (smaps'
    AnonHugePages), and the mapping is gone once its last tensor is."""
    z = huge_pages.zeros((4 * huge_pages.HUGE_PAGE,), torch.uint8)
    address = z.data_ptr()
    entry = _mapping(address)
    assert entry is not None
    huge_kb = next(int(line.split()[1]) for line in entry if line.startswith("AnonHugePages:"))
    assert huge_kb >= 4 * huge_pages.HUGE_PAGE // 1024
    del z
    gc.collect()
    assert _mapping(address) is None


@pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU: no tiles")
def test_a_quantized_models_tiles_lie_in_one_region(tmp_path):
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    quantize_model(model, QuantSpec("int4", activations="float32"))
    weights = [getattr(layer, a) for layer in model.layers for a in LINEARS] + [model.lm_head_q]
    tensors = [t for w in weights for t in (w.tiles.data, w.tiles.params)]
    assert tensors[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    for before, after in zip(tensors, tensors[1:], strict=False):
        end = before.data_ptr() + before.numel() * before.element_size()
        assert after.data_ptr() == -(-end // 64) * 64
