"""paged_attention_rows (paged_attention.cpp): every query row of a step (a decode's, a verify
step's 1 + k, a prefill chunk's after cached context) over its sequence's cached keys, against
a float64 reference; and its batch invariance: a row's output is bit for bit the same alone,
beside any other rows, as a decode row or inside a prefill chunk, whatever the threads."""

from __future__ import annotations

import pytest
import torch

from backend import kernels

needs_kernels = pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")
BLOCK = 16


def _reference(q, keys, values, tables, seq, lens, scale, window, softcap=0.0):
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for r in range(n):
        length = int(lens[r])
        pos = torch.arange(max(0, length - window) if window else 0, length)
        slots = tables[seq[r], pos // BLOCK] * BLOCK + pos % BLOCK
        k, v = keys[slots].double(), values[slots].double()
        for h in range(heads):
            scores = (k[:, h // group] @ q[r, h].double()) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.softmax(scores, 0)
            out[r, h] = weights @ v[:, h // group]
    return out


def _step(dtype, dim, heads=9, kv_heads=3):
    """A step of rows: a decode at 700 positions, a verify step's 3 rows, a decode at 300, and a
    40-token prefill chunk after 250 cached positions, over scattered blocks."""
    gen = torch.Generator().manual_seed(dim)
    keys, values = (torch.randn(200 * BLOCK, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    tables = torch.stack([torch.randperm(200, generator=gen)[:48] for _ in range(4)])
    seq = torch.tensor([0, 1, 1, 1, 2] + [3] * 40)
    lens = torch.tensor([700, 5, 6, 7, 300, *range(251, 291)])
    q = torch.randn(len(seq), heads, dim, generator=gen)
    return q, (keys, values), tables, seq, lens


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
@pytest.mark.parametrize("window", [None, 100])
def test_rows_match_the_reference_and_each_row_is_its_own(dtype, dim, window):
    q, kv, tables, seq, lens = _step(dtype, dim)
    scale = dim**-0.5
    got = kernels.paged_attention_rows(q, kv, tables, seq, lens, BLOCK, scale, window)
    want = _reference(q, *kv, tables, seq, lens, scale, window)
    assert (got.double() - want).abs().max().item() < 5e-6
    for r in range(len(seq)):  # alone, and beside other rows in another order
        alone = kernels.paged_attention_rows(
            q[r : r + 1], kv, tables, seq[r : r + 1], lens[r : r + 1], BLOCK, scale, window
        )
        assert torch.equal(alone[0], got[r])
    # the prefill chunk's last row is the decode of that position
    decode = kernels.paged_decode_attention(q[-1:], kv, tables[3:4], lens[-1:], BLOCK, scale, window)
    assert torch.equal(decode[0], got[-1])
    # the chunk cut in two (a smaller prefill budget): the same rows
    first, second = (slice(5, 25), slice(25, 45))
    parts = [
        kernels.paged_attention_rows(q[s], kv, tables, seq[s], lens[s], BLOCK, scale, window) for s in (first, second)
    ]
    assert torch.equal(torch.cat(parts), got[5:])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [32, 256])
@pytest.mark.parametrize("window", [None, 100])
def test_soft_capped_rows_match_the_reference_and_each_row_is_its_own(dtype, dim, window):
    """Gemma 2's soft-capping, softcap * tanh(score / softcap) before the softmax: a cap that
    bends the scores (scaled by 1 here, they reach ~3 sigma of sqrt(dim)) changes the output, and
    a row's numbers stay its own."""
    q, kv, tables, seq, lens = _step(dtype, dim)
    scale, softcap = 1.0, 5.0
    got = kernels.paged_attention_rows(q, kv, tables, seq, lens, BLOCK, scale, window, softcap)
    want = _reference(q, *kv, tables, seq, lens, scale, window, softcap)
    assert (got.double() - want).abs().max().item() < 5e-6
    uncapped = kernels.paged_attention_rows(q, kv, tables, seq, lens, BLOCK, scale, window)
    assert (uncapped - got).abs().max().item() > 0.1
    for r in range(len(seq)):
        alone = kernels.paged_attention_rows(
            q[r : r + 1], kv, tables, seq[r : r + 1], lens[r : r + 1], BLOCK, scale, window, softcap
        )
        assert torch.equal(alone[0], got[r])
    parts = [
        kernels.paged_attention_rows(q[s], kv, tables, seq[s], lens[s], BLOCK, scale, window, softcap)
        for s in (slice(0, 5), slice(5, 25), slice(25, 45))
    ]
    assert torch.equal(torch.cat(parts), got)


@needs_kernels
def test_bad_operands_are_refused():
    q, kv, tables, seq, lens = _step(torch.float32, 64)
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernels.paged_attention_rows(q[:1], kv, tables, seq[:1], torch.tensor([48 * BLOCK + 1]), BLOCK, 1.0, None)
    with pytest.raises(RuntimeError, match="block table outside"):
        kernels.paged_attention_rows(q[:1], kv, tables, torch.tensor([4]), lens[:1], BLOCK, 1.0, None)
