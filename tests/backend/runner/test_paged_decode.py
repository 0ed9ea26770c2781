"""Decode attention over the paged KV cache: our kernel (paged_attention.cpp `paged_decode_attention`,
which reads each sequence's keys through its block table) against a float64 reference of
softmax(q k^T * scale) v over each sequence's own positions, and `paged_attention` with the
kernel against the gather-and-SDPA path it replaces, on decode batches of mixed lengths."""

from __future__ import annotations

import pytest
import torch

from backend import kernels
from backend.runner import attention
from backend.runner.attention import build_attention_plan, paged_attention, paged_kv
from backend.runner.forward_batch import Span, build_forward_batch

needs_kernels = pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")
BLOCK = 16


def _cache(num_blocks: int, kv_heads: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=gen)


def _tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Each sequence's blocks, drawn without repeats from a shuffled pool (not consecutive)."""
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(pool[:need])
        pool = pool[need:]
    return tables


def _reference(q, cache, tables, lengths, scale, window=None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: each sequence's positions gathered one by one, in float64."""
    kv_heads = cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        first = max(0, n - window) if window else 0
        slots = [(table[p // BLOCK], p % BLOCK) for p in range(first, n)]
        k = torch.stack([cache[0, blk, off] for blk, off in slots]).double()  # [L, KV, D]
        v = torch.stack([cache[1, blk, off] for blk, off in slots]).double()
        group = q.shape[1] // kv_heads
        k, v = (t.transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))  # [H, L, D]
        weights = torch.softmax((q[b].double()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale, dim=-1)  # [H, L]
        out[b] = (weights[:, :, None] * v).sum(1)
    return out


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("lengths", [[1, 16, 17], [300, 5, 64, 33, 1, 129], [40, 40]])
@pytest.mark.parametrize("window", [None, 5, 48])
def test_the_kernel_matches_the_reference(heads, kv_heads, dim, lengths, window):
    cache = _cache(64, kv_heads, dim, seed=len(lengths) + dim)
    tables = _tables(lengths, 64, seed=heads)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(3))
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    kv = paged_kv(cache)
    got = kernels.paged_decode_attention(
        q, (kv.keys, kv.values), padded, torch.tensor(lengths), BLOCK, dim**-0.5, window
    )  # fmt: skip
    assert got.shape == q.shape
    assert _relative_error(got, _reference(q, cache, tables, lengths, dim**-0.5, window)) < 1e-5


@needs_kernels
@pytest.mark.parametrize(
    "heads,kv_heads,dim,lengths", [(9, 3, 64, [1000]), (8, 2, 128, [900, 1]), (4, 4, 32, [1500]), (9, 3, 64, [700, 40])]
)
@pytest.mark.parametrize("window", [None, 100, 777])
def test_few_long_contexts_split_across_threads_match_the_reference(heads, kv_heads, dim, lengths, window):
    """Fewer (sequence, KV head) tasks than 4 a thread over long contexts: each context is cut
    in one span per thread and the spans' softmaxes merged; the same as one thread's whole
    context (up to float rounding), and the reference. A length-1 context leaves spans empty."""
    cache = _cache(128, kv_heads, dim, seed=dim)
    tables = _tables(lengths, 128, seed=heads)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(4))
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    kv = paged_kv(cache)
    threads = torch.get_num_threads()
    call = lambda: kernels.paged_decode_attention(  # noqa: E731
        q, (kv.keys, kv.values), padded, torch.tensor(lengths), BLOCK, dim**-0.5, window
    )  # fmt: skip
    try:
        torch.set_num_threads(max(2, threads))
        split = call()
        torch.set_num_threads(1)
        whole = call()
    finally:
        torch.set_num_threads(threads)
    assert _relative_error(split, whole.double()) < 5e-6
    assert _relative_error(split, _reference(q, cache, tables, lengths, dim**-0.5, window)) < 1e-5


@needs_kernels
def test_the_kernel_refuses_a_length_past_its_block_table():
    cache = _cache(8, 1, 32, seed=0)
    kv = paged_kv(cache)
    q = torch.randn(1, 1, 32)
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernels.paged_decode_attention(q, (kv.keys, kv.values), torch.tensor([[0]]), torch.tensor([17]), BLOCK, 1.0, 0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_decode_attention(q, (kv.keys, kv.values), torch.tensor([[9]]), torch.tensor([3]), BLOCK, 1.0, 0)


def _decode_step(lengths: list[int], heads: int, kv_heads: int, dim: int, window: int | None):
    """A decode step of len(lengths) sequences: (q, k, v, the cache, the batch, the plan)."""
    cache = _cache(64, kv_heads, dim, seed=7)
    tables = _tables(lengths, 64, seed=11)
    spans = [Span([5], n - 1, table, num_logits=1) for n, table in zip(lengths, tables, strict=True)]
    batch = build_forward_batch(spans, BLOCK, torch.device("cpu"))
    plan = build_attention_plan(batch, BLOCK, torch.float32, window, heads // kv_heads)
    gen = torch.Generator().manual_seed(5)
    qk = torch.randn(len(lengths), heads + kv_heads, dim, generator=gen)
    q, k = qk[:, :heads], qk[:, heads:]  # q a strided view, as the model's is
    v = torch.randn(len(lengths), kv_heads, dim, generator=gen)
    return q, k, v, cache, batch, plan, tables


@needs_kernels
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_with_the_kernel_matches_the_gather_and_sdpa_path(monkeypatch, window):
    lengths = [70, 3, 33, 128, 1]
    q, k, v, cache, batch, plan, tables = _decode_step(lengths, 9, 3, 64, window)
    assert plan.decode[0].tables is not None and plan.decode[0].mask is not None  # mixed lengths
    with_kernel = paged_attention(q, k, v, cache.clone(), batch, 0.125, plan)
    monkeypatch.setattr(attention, "paged_attention_rows", lambda *args: None)
    written = cache.clone()
    gathered = paged_attention(q, k, v, written, batch, 0.125, plan)
    assert _relative_error(with_kernel, gathered.double()) < 1e-5
    # and both against the reference over the cache with this step's k/v written
    assert _relative_error(with_kernel, _reference(q, written, tables, lengths, 0.125, window)) < 1e-5


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("window", [None, 20])
def test_a_float16_cache_reads_as_the_float32_cache_of_its_values(heads, kv_heads, dim, window):
    """KV_CACHE_DTYPE=float16: the kernel widens each value exactly, so over a float16 cache
    it gives bit for bit what it gives over a float32 cache holding the same values."""
    lengths = [70, 3, 33, 128, 1]
    tables = _tables(lengths, 24, seed=3)
    half = _cache(24, kv_heads, dim, seed=4).half()
    keys, values = paged_kv(half).keys, paged_kv(half).values
    wide = paged_kv(half.float())
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(6))
    padded = torch.tensor([t + [0] * (9 - len(t)) for t in tables])
    lens = torch.tensor(lengths)
    got = kernels.paged_decode_attention(q, (keys, values), padded, lens, BLOCK, 0.125, window)
    want = kernels.paged_decode_attention(q, (wide.keys, wide.values), padded, lens, BLOCK, 0.125, window)
    assert got is not None and torch.equal(got, want)


@pytest.mark.parametrize("kernel", [True, False])
def test_paged_attention_over_a_float16_cache_rounds_the_new_keys_and_attends_in_float32(monkeypatch, kernel):
    """Both paths (the kernel; the gather and SDPA where it does not run) write this step's
    k / v rounded to float16 and attend in q's float32 over the cache's values."""
    lengths = [70, 3, 33, 128, 1]
    q, k, v, cache, batch, plan, tables = _decode_step(lengths, 9, 3, 64, None)
    if not kernel:
        monkeypatch.setattr(attention, "paged_attention_rows", lambda *args: None)
    half = cache.half()
    got = paged_attention(q, k, v, half, batch, 0.125, plan)
    assert got.dtype == torch.float32
    written = cache.half().float()
    paged_attention(q, k.half().float(), v.half().float(), written, batch, 0.125, plan)
    assert torch.equal(half.float(), written)  # the new rows rounded as .to(float16) rounds them
    assert _relative_error(got, _reference(q, written, tables, lengths, 0.125)) < 1e-5


@needs_kernels
@pytest.mark.parametrize("window", [None, 20])
def test_soft_capped_attention_with_the_kernel_matches_the_eager_path(monkeypatch, window):
    """Gemma 2's soft-capped scores: our kernel, and where it does not run the eager path
    (SDPA does not take soft-capping), give the same attention."""
    lengths = [70, 3, 33, 128, 1]
    q, k, v, cache, batch, plan, _ = _decode_step(lengths, 9, 3, 64, window)
    with_kernel = paged_attention(q, k, v, cache.clone(), batch, 1.0, plan, softcap=4.0)
    monkeypatch.setattr(attention, "paged_attention_rows", lambda *args: None)
    eager = paged_attention(q, k, v, cache.clone(), batch, 1.0, plan, softcap=4.0)
    assert _relative_error(with_kernel, eager.double()) < 1e-5
    uncapped = paged_attention(q, k, v, cache.clone(), batch, 1.0, plan)
    assert _relative_error(uncapped, eager.double()) > 1e-2
