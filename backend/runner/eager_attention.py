"""Attention with what our paged kernel does not take where it cannot run (a GPU, bfloat16,
head sizes other than 32, 64 and 128): soft-capped scores (Gemma 2) and attention sinks
(gpt-oss), in plain torch, one sequence at a time over its cached context."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from backend.runner.attention import PagedKv
    from backend.runner.forward_batch import ForwardBatch


def eager_attention(
    q: torch.Tensor, kv: PagedKv, batch: ForwardBatch, scale: float, window: int | None,
    softcap: float | None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [T, H, D] over each sequence's cached keys / values (the step's already written), in
    float32: [T, H, D]. `softcap`: scores become softcap * tanh(score / softcap); `sinks` [H]:
    a per-head logit that takes a share of the softmax and gives nothing."""
    out = torch.empty_like(q)
    block_size = kv.cache.shape[2]
    num_heads, group = q.shape[1], q.shape[1] // kv.keys.shape[1]
    for i in range(batch.num_seqs):
        start, end, length = batch.query_start[i], batch.query_start[i + 1], batch.context_lens[i]
        pos = torch.arange(length, device=q.device)
        slots = batch.block_tables[i, pos // block_size] * block_size + pos % block_size
        k, v = (half.index_select(0, slots).float().repeat_interleave(group, dim=1) for half in (kv.keys, kv.values))
        scores = torch.einsum("thd,lhd->htl", q[start:end].float(), k) * scale  # [H, Tq, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(length - (end - start), length, device=q.device)[:, None]
        seen = pos[None, :] <= q_pos
        if window is not None:
            seen &= pos[None, :] > q_pos - window
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, end - start, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("htl,lhd->thd", probs, v).to(q.dtype)
    return out
