"""Our CPU kernels that are not the quantized matmul, each with the caller's fallback where
they cannot run: rms_norm, silu_mul, gelu_mul, head_rms_norm_ and the paged attention of query
rows (one arithmetic for decode, verify and prefill rows: batch-invariant). The quantized matmul is
backend/runner/quant/matmul.py; the sampler's first_max and the decoder layer's decode_layer
are called on `native()` directly."""

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


def dense_matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, in] @ weight_t [in, out] (+ bias) in float32 on the CPU by our kernel (dense.cpp:
    each row's sums in one order, whatever the row count, where MKL's GEMM changes kernels
    with it); None where it cannot run."""
    usable = x.is_cpu and x.dtype == weight_t.dtype == torch.float32 and weight_t.is_contiguous() and x.dim() == 2
    lib = native() if usable else None
    return None if lib is None else lib.dense_matmul(x.contiguous(), weight_t, EMPTY if bias is None else bias)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I] (gate first): on the CPU in float32, decode_layer's
    own arithmetic (its exp), so a row gets the same numbers in a fused decode step and in a
    mixed step; elsewhere torch's."""
    usable = gate_up.is_cpu and gate_up.dtype == torch.float32 and gate_up.dim() == 2 and gate_up.shape[1] % 32 == 0
    lib = native() if usable else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return lib.silu_mul(gate_up.contiguous())


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up of gate_up [T, 2I] (gate first, Gemma's GeGLU): on
    the CPU in float32, decode_layer's own arithmetic (layer_ops.cpp); elsewhere torch's."""
    usable = gate_up.is_cpu and gate_up.dtype == torch.float32 and gate_up.dim() == 2 and gate_up.shape[1] % 32 == 0
    lib = native() if usable else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    return lib.gelu_mul(gate_up.contiguous())


def head_rms_norm_(x: torch.Tensor, first: int, heads: int, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm in place of heads first .. first + heads - 1 of each row of x [T, width], each
    weight.numel() long, times weight (q / k norms): decode_layer's arithmetic on the CPU in
    float32, elsewhere torch's."""
    size = weight.numel()
    usable = x.is_cpu and x.dtype == weight.dtype == torch.float32 and x.dim() == 2 and size % 16 == 0
    lib = native() if usable and x.is_contiguous() and weight.is_contiguous() else None
    if lib is not None:
        lib.head_rms_norm_(x, first, heads, weight, eps)
        return
    rows = x[:, first * size : (first + heads) * size].view(x.shape[0], heads, size)
    rows.copy_(F.rms_norm(rows, (size,), eps=eps) * weight)


def rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """RoPE in place on the first `heads` heads of each row of x [T, width] (cos, sin: [T, 1, D]
    rows of the model's table, rotate_half's sign in sin), decode_layer's arithmetic; False
    (nothing done) where our kernel cannot run: the caller's torch then does it."""
    head_dim = cos.shape[-1]
    usable = x.is_cpu and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() == 2 and head_dim % 32 == 0
    lib = native() if usable and x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() else None
    if lib is None:
        return False
    lib.rope_(x, heads, cos, sin)
    return True


PAGED_HEAD_DIMS = (32, 64, 128, 256)  # the head sizes paged_attention_rows (and decode_layer) take
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


def paged_attention_rows(
    q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], tables: torch.Tensor, seq: torch.Tensor,
    lens: torch.Tensor, block_size: int, scale: float, window: int | None, softcap: float = 0.0,
) -> torch.Tensor | None:  # fmt: skip
    """Each query row of q [N, H, D] over its sequence's cached keys / values (kv: the layer's
    flat slot views [num_slots, KV, D] each), read through block table tables[seq[r]] up to
    lens[r] positions (its last `window`, with a sliding window): [N, H, D], each row's numbers
    its own whatever the other rows (paged_attention.cpp); `softcap` > 0: each score becomes
    softcap * tanh(score / softcap) before the softmax (Gemma 2), 0: off. None where our kernel
    cannot run."""
    keys, values = kv
    usable = q.is_cpu and q.dtype == torch.float32 and keys.dtype in KV_KERNEL_DTYPES and q.shape[-1] in PAGED_HEAD_DIMS
    lib = native() if usable and keys.is_contiguous() and values.is_contiguous() else None
    if lib is None:
        return None
    return lib.paged_attention_rows(
        q.contiguous(), keys, values, tables, seq, lens, block_size, scale, window or 0, softcap
    )
