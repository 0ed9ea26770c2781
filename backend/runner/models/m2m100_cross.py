"""Cross-attention over encoder states kept in the paged KV pool (NLLB / M2M100's decoder).

`M2M100ForTranslation.encode` writes, for every decoder layer, the keys and values of a
request's encoder output into that layer's KV cache tensor (the same one its decoder
self-attention uses) at the request's cross slots: blocks the caller allocated for the
source, ceil(S / block_size) of them, position s in block cross_table[s // block_size]
at offset s % block_size. Every decode step, each sequence's query rows attend over all
S of its own encoder positions (no mask besides the source's length).

One `CrossPlan` per forward, shared by every layer: sequences with short queries (a
decode's one token, a verify step's few) in one batched SDPA call over their gathered
encoder K/V, padded to the longest source and masked; long prefill chunks one call each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.runner.attention import MAX_SHORT_QUERY
from backend.runner.forward_batch import ForwardBatch


@dataclass(slots=True)
class CrossRows:
    """Sequences with at most MAX_SHORT_QUERY query rows each, attended in one SDPA call:
    their query rows padded to `query_len` each, their sources to the longest."""

    token_rows: torch.Tensor | None  # [R] rows of the flat batch these sequences own, in order; None: all, in order
    pad_rows: torch.Tensor | None  # [B * query_len] indices into the R rows (padding repeats one); None: unpadded
    keep: torch.Tensor | None  # [R] the real rows' places among the B * query_len padded ones; None: no padding
    num_seqs: int
    query_len: int
    slots: torch.Tensor  # [B * S_max] cache slot of each source position; padding repeats the sequence's last one
    mask: torch.Tensor | None  # [B, 1, 1, S_max] additive (0 or -inf); None when every source has S_max positions


@dataclass(slots=True)
class CrossChunk:
    """A long prefill chunk of one sequence: rows start..end of the flat batch."""

    start: int
    end: int
    slots: torch.Tensor  # [S] cache slots of its source's positions


@dataclass(slots=True)
class CrossPlan:
    rows: CrossRows | None
    chunks: list[CrossChunk]


def cross_slots(cross_table: Sequence[int], length: int, block_size: int, device: torch.device | str = "cpu"):
    """[length] int64: the flat cache slots of a source of `length` positions in the blocks `cross_table`."""
    pos = torch.arange(length, device=device)
    table = torch.as_tensor(list(cross_table), dtype=torch.int64, device=device)
    return table[pos // block_size] * block_size + pos % block_size


def build_cross_plan(
    batch: ForwardBatch,
    cross_tables: Sequence[Sequence[int]],
    cross_lens: Sequence[int],
    block_size: int,
    dtype: torch.dtype,
) -> CrossPlan:
    """The plan of `batch`, whose sequence i reads its encoder states (cross_lens[i] positions)
    from the blocks cross_tables[i] (beams of one request may share them)."""
    device = batch.input_ids.device
    short = [i for i, n in enumerate(batch.query_lens) if n <= MAX_SHORT_QUERY]
    rows = _cross_rows(batch, short, cross_tables, cross_lens, block_size, dtype) if short else None
    chunks = [
        CrossChunk(batch.query_start[i], batch.query_start[i + 1],
                   cross_slots(cross_tables[i], cross_lens[i], block_size, device))
        for i, n in enumerate(batch.query_lens)
        if n > MAX_SHORT_QUERY
    ]  # fmt: skip
    return CrossPlan(rows, chunks)


def _cross_rows(batch, seqs, cross_tables, cross_lens, block_size, dtype) -> CrossRows:
    device = batch.input_ids.device
    lens = [cross_lens[i] for i in seqs]
    if min(lens) < 1:
        raise ValueError("a sequence without encoder states cannot cross-attend")
    max_blocks, max_len = max(len(cross_tables[i]) for i in seqs), max(lens)
    tables = torch.tensor([list(cross_tables[i]) + [0] * (max_blocks - len(cross_tables[i])) for i in seqs],
                          dtype=torch.int64, device=device)  # fmt: skip
    length = torch.tensor(lens, dtype=torch.int64, device=device)[:, None]
    pos = torch.minimum(torch.arange(max_len, device=device)[None, :], length - 1)  # [B, S_max]
    slots = (tables.gather(1, pos // block_size) * block_size + pos % block_size).reshape(-1)
    mask = None
    if min(lens) < max_len:
        beyond = torch.arange(max_len, device=device)[None, :] >= length  # [B, S_max]
        mask = torch.zeros(beyond.shape, dtype=dtype, device=device).masked_fill_(beyond, float("-inf"))
        mask = mask[:, None, None, :]
    q_lens = [batch.query_lens[i] for i in seqs]
    token_rows = None
    if len(seqs) < batch.num_seqs:
        rows = [batch.query_start[i] + t for i in seqs for t in range(batch.query_lens[i])]
        token_rows = torch.tensor(rows, dtype=torch.int64, device=device)
    pad_rows, keep = _query_padding(q_lens, device)
    return CrossRows(token_rows, pad_rows, keep, len(seqs), max(q_lens), slots, mask)


def _query_padding(q_lens: list[int], device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    # Sequence j's query rows are its first..last own rows, then its last row again up to query_len.
    width = max(q_lens)
    if min(q_lens) == width:
        return None, None
    starts = [sum(q_lens[:j]) for j in range(len(q_lens))]
    pad_rows = [starts[j] + min(t, n - 1) for j, n in enumerate(q_lens) for t in range(width)]
    keep = [j * width + t for j, n in enumerate(q_lens) for t in range(n)]
    return (torch.tensor(pad_rows, dtype=torch.int64, device=device),
            torch.tensor(keep, dtype=torch.int64, device=device))  # fmt: skip


def cross_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan: CrossPlan, scale: float) -> torch.Tensor:
    """q: [T, H, D] (the batch's rows) -> [T, H, D], each row over its sequence's encoder K/V
    in kv_cache [2, num_blocks, block_size, H, D]."""
    rows = plan.rows
    if rows is not None and rows.token_rows is None:
        return _rows_attention(q, kv_cache, rows, scale)
    out = torch.empty_like(q)
    if rows is not None:
        out.index_copy_(0, rows.token_rows, _rows_attention(q.index_select(0, rows.token_rows), kv_cache, rows, scale))
    for chunk in plan.chunks:
        out[chunk.start : chunk.end] = _chunk_attention(q[chunk.start : chunk.end], kv_cache, chunk.slots, scale)
    return out


def _rows_attention(q: torch.Tensor, kv_cache: torch.Tensor, rows: CrossRows, scale: float) -> torch.Tensor:
    # q: [R, H, D] -> [B, H, query_len, D] against k, v: [B, H, S_max, D]
    num_heads, head_dim = q.shape[1], q.shape[2]
    padded = q if rows.pad_rows is None else q.index_select(0, rows.pad_rows)
    padded = padded.view(rows.num_seqs, rows.query_len, num_heads, head_dim).transpose(1, 2)
    flat = kv_cache.view(2, -1, num_heads * head_dim)
    k, v = (flat[i].index_select(0, rows.slots).to(q.dtype).view(rows.num_seqs, -1, num_heads, head_dim)
            .transpose(1, 2) for i in (0, 1))  # fmt: skip
    out = F.scaled_dot_product_attention(padded, k, v, attn_mask=rows.mask, scale=scale)
    out = out.transpose(1, 2).reshape(rows.num_seqs * rows.query_len, num_heads, head_dim)
    return out if rows.keep is None else out.index_select(0, rows.keep)


def _chunk_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [Tq, H, D] over one source's k, v: [H, S, D]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv = kv_cache.view(2, -1, num_heads, head_dim).index_select(1, slots).to(q.dtype).transpose(1, 2)  # [2, H, S, D]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kv[0], kv[1], scale=scale)
    return out.transpose(0, 1)
