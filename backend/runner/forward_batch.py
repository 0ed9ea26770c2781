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

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)
