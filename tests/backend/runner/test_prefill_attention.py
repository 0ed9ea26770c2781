"""Prefill chunks over the paged KV cache: a chunk after cached context runs as two unmasked
flash calls merged by their logsumexps (attention._split_attention), against the masked
SDPA it replaces and a float64 reference of softmax(q k^T * scale) v over each query's
positions, for chunk and context lengths around block edges, GQA groups, head dims 32 /
64 / 128 and a float16 cache."""

from __future__ import annotations

import pytest
import torch

from backend.runner import attention
from backend.runner.attention import build_attention_plan, paged_attention
from backend.runner.forward_batch import Span, build_forward_batch

BLOCK = 16
NUM_BLOCKS = 160


def _step(chunks: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, seed: int):
    """A step of (cached, chunk length) sequences, blocks shuffled: (q, k, v, cache, batch, tables)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    spans, tables = [], []
    for cached, length in chunks:
        need = -(-(cached + length) // BLOCK)
        tables.append(pool[:need])
        pool = pool[need:]
        spans.append(Span([7] * length, cached, tables[-1], num_logits=1))
    batch = build_forward_batch(spans, BLOCK, torch.device("cpu"))
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, dim, generator=gen)
    total = sum(length for _, length in chunks)
    qkv = torch.randn(total, heads + 2 * kv_heads, dim, generator=gen)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # strided views, as the model's are
    return q, k, v, cache, batch, tables


def _reference(q, cache, batch, tables) -> torch.Tensor:
    """[T, H, D] in float64: each query over its sequence's positions up to its own."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.shape[3]
    for i, table in enumerate(tables):
        first, context = batch.query_start[i], batch.context_lens[i]
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
        k, v = (cache[j].flatten(0, 1)[slots].double().repeat_interleave(group, 1) for j in (0, 1))  # [L, H, D]
        for t in range(batch.query_lens[i]):
            seen = context - batch.query_lens[i] + t + 1
            scores = torch.einsum("hd,lhd->hl", q[first + t].double(), k[:seen]) * 0.125
            out[first + t] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v[:seen])
    return out


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the largest value."""
    return float((got.double() - want.double()).abs().max() / want.abs().max())


def _attend(q, k, v, cache, batch, heads, kv_heads, split: bool, monkeypatch):
    monkeypatch.setattr(attention, "_splits", lambda device, dtype: split)
    plan = build_attention_plan(batch, BLOCK, torch.float32, None, heads // kv_heads)
    assert all((chunk.mask is None) == (split or chunk.slots is None) for chunk in plan.prefills)
    return paged_attention(q, k, v, cache, batch, 0.125, plan)


CASES = [
    [(1, 17)],  # one cached key
    [(16, 40), (33, 100)],  # on and past a block edge
    [(500, 300)],  # a long context
    [(200, 64), (0, 80), (47, 1), (90, 17)],  # a first chunk and a decode beside them
    [(512, 512)],
]


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 64)])
@pytest.mark.parametrize("chunks", CASES)
def test_a_chunk_after_cached_context_matches_the_masked_path_and_the_reference(
    monkeypatch, heads, kv_heads, dim, chunks
):
    q, k, v, cache, batch, tables = _step(chunks, heads, kv_heads, dim, seed=len(chunks) + dim)
    split_cache, masked_cache = cache.clone(), cache.clone()
    split = _attend(q, k, v, split_cache, batch, heads, kv_heads, True, monkeypatch)
    masked = _attend(q, k, v, masked_cache, batch, heads, kv_heads, False, monkeypatch)
    assert torch.equal(split_cache, masked_cache)  # the chunk's keys written alike
    assert _error(split, masked) < 1e-6
    assert _error(split, _reference(q, split_cache, batch, tables)) < 1e-5


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
def test_over_a_float16_cache_the_split_attends_to_the_rounded_keys_in_float32(monkeypatch, heads, kv_heads, dim):
    q, k, v, cache, batch, tables = _step([(300, 150), (31, 33)], heads, kv_heads, dim, seed=3)
    half = cache.half()
    got = _attend(q, k, v, half, batch, heads, kv_heads, True, monkeypatch)
    assert got.dtype == torch.float32
    masked = _attend(q, k, v, cache.half(), batch, heads, kv_heads, False, monkeypatch)
    assert _error(got, masked) < 1e-6
    assert _error(got, _reference(q, half.float(), batch, tables)) < 1e-5


def test_the_plan_splits_on_the_cpu_and_masks_a_sliding_window():
    _, _, _, _, batch, _ = _step([(40, 30)], 4, 2, 32, seed=1)
    (split,) = build_attention_plan(batch, BLOCK, torch.float32, None, 2).prefills
    (windowed,) = build_attention_plan(batch, BLOCK, torch.float32, 24, 2).prefills
    assert split.mask is None and split.slots is not None
    assert windowed.mask is not None and windowed.mask.shape == (30, 70)
    assert not attention._splits(torch.device("cuda"), torch.float32)
    assert not attention._splits(torch.device("cpu"), torch.int8)


def test_bfloat16_queries_split_within_bfloat16s_rounding(monkeypatch):
    q, k, v, cache, batch, tables = _step([(200, 120)], 9, 3, 64, seed=5)
    narrow = cache.bfloat16()
    got = _attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), narrow, batch, 9, 3, True, monkeypatch)
    want = _reference(q.bfloat16().float(), narrow.float(), batch, tables)
    assert got.dtype == torch.bfloat16 and _error(got, want) < 1e-2
