"""The plan of one forward pass, as the model sees it (built by the model runner).

The batch is flat (no padding between sequences): sequence i owns the tokens
input_ids[query_start[i]:query_start[i+1]]. Each sequence's new tokens are the last
`query_lens[i]` of its `context_lens[i]` tokens; the earlier ones are already in the
paged KV cache, found through its block table.

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values). Token t of a sequence lives in block
block_table[t // block_size] at offset t % block_size; its flat slot is
block * block_size + offset (`slot_mapping` holds the slots of the new tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.lora.batch import LoraBatch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot each new token's k/v is written to
    query_lens: list[int]  # [B] new tokens per sequence
    context_lens: list[int]  # [B] tokens in the KV cache after this step, new ones included
    query_start: list[int]  # [B + 1] prefix sums of query_lens
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    logits_indices: torch.Tensor  # [N] int64, rows of the flat batch whose logits are wanted
    lora: LoraBatch | None = None  # the rows that use an adapter, and which (backend.lora.batch)
    # a vision-language model (backend.vision): M-RoPE's (t, h, w) ids of every token [3, T]
    # int64 (None: a model with 1-D RoPE, which reads `positions`), and the rows [R] int64 of
    # the flat batch whose input embeddings are the vision encoder's [R, hidden] instead of
    # their placeholder token's
    mrope_positions: torch.Tensor | None = None
    embeds_rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    # a model whose layers keep state besides attention's KV (backend/runner/models/layer_state.py):
    # each sequence's states by layer, which the step reads and updates (None: no such layers)
    layer_states: list[dict] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass(slots=True)
class Span:
    """One sequence's part of a forward: `input_ids` at positions `start`.., their k/v
    written through `block_table`; logits are wanted for its last `num_logits` tokens."""

    input_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int = 0


def build_forward_batch(spans: list[Span], block_size: int, device: torch.device) -> ForwardBatch:
    """The flat batch of `spans`, in order (their logits rows too)."""
    input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
    query_start, logits_indices = [0], []
    for span in spans:
        n, table = len(span.input_ids), span.block_table
        input_ids.extend(span.input_ids)
        positions.extend(range(span.start, span.start + n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(span.start, span.start + n))
        query_lens.append(n)
        context_lens.append(span.start + n)
        query_start.append(query_start[-1] + n)
        logits_indices.extend(range(query_start[-1] - span.num_logits, query_start[-1]))
    max_blocks = max(len(span.block_table) for span in spans)
    tables = [span.block_table + [0] * (max_blocks - len(span.block_table)) for span in spans]

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        query_lens=query_lens,
        context_lens=context_lens,
        query_start=query_start,
        block_tables=as_tensor(tables),
        logits_indices=as_tensor(logits_indices),
    )
