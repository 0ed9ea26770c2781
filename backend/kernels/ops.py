"""Our CPU kernels that are not the quantized matmul, each with the caller's fallback where
they cannot run: rms_norm and the decode attention of one query token (contiguous or paged
KV). The quantized matmul is backend/runner/quant/matmul.py; the sampler's first_max and the
decoder layer's decode_layer are called on `native()` directly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.kernels.build import native

EMPTY = torch.empty(0)  # what the kernels take for an absent mins / bias tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over x's last dimension; on the CPU in float32, one call of our kernel (the
    same arithmetic, in another order of additions) instead of PyTorch's six small ops, a
    measurable share of a decode step at one stream."""
    lib = native() if x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and weight.dtype == torch.float32 else None
    if lib is None:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return lib.rms_norm(x.contiguous(), weight, eps)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor | None:
    """One query token's attention, q [H, D] over keys / values [L, KV, D] (one sequence's
    consecutive cache slots): [H, D]; None where our kernel cannot run (the caller's SDPA
    then does). SDPA's call for one query measured ~55 us a layer at one stream."""
    usable = q.is_cpu and q.dtype == torch.float32 == keys.dtype and q.shape[1] % 16 == 0
    lib = native() if usable and q.is_contiguous() and keys.is_contiguous() and values.is_contiguous() else None
    return None if lib is None else lib.decode_attention(q, keys, values, scale)


PAGED_HEAD_DIMS = (32, 64, 128)  # the head sizes paged_decode_attention (and decode_layer) take
KV_KERNEL_DTYPES = (torch.float32, torch.float16)  # the caches they read (KV_CACHE_DTYPE)


def paged_decode_attention(
    q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], tables: torch.Tensor, lens: torch.Tensor,
    block_size: int, scale: float, window: int | None,
) -> torch.Tensor | None:  # fmt: skip
    """One query token per sequence, q [B, H, D], over its cached keys / values, kv: the
    layer's flat slot views [num_slots, KV, D] each, read through `tables` [B, max_blocks]
    up to `lens` [B] (the last `window` positions, with a sliding window): [B, H, D]; None
    where our kernel cannot run (the caller then gathers the contexts for SDPA)."""
    keys, values = kv
    usable = q.is_cpu and q.dtype == torch.float32 and keys.dtype in KV_KERNEL_DTYPES and q.shape[-1] in PAGED_HEAD_DIMS
    lib = native() if usable and keys.is_contiguous() and values.is_contiguous() else None
    if lib is None:
        return None
    return lib.paged_decode_attention(q.contiguous(), keys, values, tables, lens, block_size, scale, window or 0)
