"""The forwards that draft tokens for speculative decoding, each with its own paged KV.

Both index their KV caches with the target sequence's own block table (the same block
ids, in caches of the same number of blocks), so a draft needs no allocator of its
own: the blocks the scheduler gives a sequence hold its target, MTP and draft keys.

- `DraftModelRunner`: a smaller model with the target's tokenizer (SPEC_DRAFT_MODEL),
  run by our own forward.
- `MtpRunner`: the target checkpoint's MTP layers (backend/runner/models/mtp.py).

Both answer greedy: a draft is a guess the verify step checks, so its argmax is enough.
"""

from __future__ import annotations

from pathlib import Path

import torch

from backend.runner import huge_pages
from backend.runner.forward_batch import Span, build_forward_batch
from backend.runner.loader import load_model
from backend.runner.models.llama import LlamaForCausalLM
from backend.sampling.vocab import load_tokenizer
from backend.types.model_config import ModelConfig


def allocate_kv(
    cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype, device, empty: tuple[int, ...] = ()
) -> list:
    """One cache a layer, [2, num_blocks, block_size, KV, head_dim], zeroed; on the CPU, on huge
    pages (a decode step reads each sequence's blocks whole); the layers in `empty` (that never
    attend) get caches of no blocks."""
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if torch.device(device).type == "cpu":
        caches = [huge_pages.zeros(shape, dtype) if i not in empty else None for i in range(num_layers)]
    else:
        caches = [torch.zeros(shape, dtype=dtype, device=device) if i not in empty else None for i in range(num_layers)]
    none = (2, 0, *shape[2:])
    return [c if c is not None else torch.zeros(none, dtype=dtype, device=device) for c in caches]


def kv_block_bytes(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over `num_layers` layers of `cfg`'s shape."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem * num_layers


class DraftModelRunner:
    def __init__(self, path: str, target_path: str, target: ModelConfig, dtype, device):
        self.model = load_model(path, dtype, device)  # either forward: ours, or the transformers path
        self.dtype, self.device = dtype, torch.device(device)
        check_same_vocabulary(path, target_path, self.model.config, target)
        self.vocab_size = target.vocab_size
        self.kv_caches: list[torch.Tensor] = []  # allocate() makes them, once the pool's size is known

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_block_bytes(self.model.config, self.model.config.num_layers, block_size, dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        cfg = self.model.config
        self.kv_caches = allocate_kv(cfg, cfg.num_layers, num_blocks, block_size, self.dtype, self.device)

    @torch.inference_mode()
    def greedy(self, spans: list[Span]) -> list[int]:
        """The draft model's argmax after each span (each wants one logits row)."""
        batch = build_forward_batch(spans, self.kv_caches[0].shape[2], self.device)
        hidden = self.model(batch, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()


class MtpRunner:
    def __init__(self, target: LlamaForCausalLM, num_blocks: int, block_size: int):
        self.target, self.head = target, target.mtp
        cfg, weight = target.config, target.norm
        self.kv_caches = allocate_kv(cfg, cfg.num_mtp_layers, num_blocks, block_size, weight.dtype, weight.device)

    @torch.inference_mode()
    def greedy(self, spans: list[Span], hidden: torch.Tensor, step: int) -> tuple[torch.Tensor, list[int]]:
        """Run MTP step `step` over the spans (input ids: the token after each position;
        `hidden` [T, hidden]: the state each position reads). Returns each span's last
        output [num spans, hidden], which the next step reads, and its argmax."""
        batch = build_forward_batch(spans, self.kv_caches[0].shape[2], hidden.device)
        out = self.head(self.target, batch, hidden, self.kv_caches, step)[batch.logits_indices]
        return out, self.target.compute_logits(out).argmax(dim=-1).tolist()


def check_same_vocabulary(path: str, target_path: str, draft: ModelConfig, target: ModelConfig) -> None:
    """A draft must speak the target's tokens: the same tokenizer vocabulary when both
    folders have one, else the same logits width. Raises ValueError saying which."""
    draft_tok, target_tok = load_tokenizer(path), load_tokenizer(target_path)
    name = Path(path).name
    if draft_tok is not None and target_tok is not None:
        a, b = draft_tok.get_vocab(), target_tok.get_vocab()
        if a != b:
            differ = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise ValueError(
                f"SPEC_DRAFT_MODEL={name}: its tokenizer's vocabulary ({len(a)} tokens) is not the model's "
                f"({len(b)} tokens); a draft model must share the tokenizer. First differences: {differ}"
            )
        if draft.vocab_size < len(b):
            raise ValueError(f"SPEC_DRAFT_MODEL={name}: {draft.vocab_size} logits cannot cover the {len(b)} tokens")
    elif draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"SPEC_DRAFT_MODEL={name}: its vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size}; "
            "a draft model must share the tokenizer"
        )
