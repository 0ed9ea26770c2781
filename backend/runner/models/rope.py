"""RoPE as transformers computes it (default, linear, Llama 3.1's, Phi-3's longrope, partial
rotary), laid out for our forward: a head's dim i turns with dim i + head_dim / 2; the cos / sin
table the models read their rows from (`RopeTable`).

Partial rotary (a share of each head turns, the rest passes): transformers turns the head's
first `rotary_dim` dims, pairing i with i + rotary_dim / 2. We reorder each q and k head's
rows once at load (`head_order`) so the turning pairs sit at i and i + head_dim / 2 and the
passing dims between them, with frequency 0 (cos 1, sin 0): the fused kernels' RoPE then
serves any share unchanged, and q . k is the same sum (q and k reordered alike; v is not).
"""

from __future__ import annotations

import math

import torch

from backend.types.model_config import ModelConfig, RopeConfig


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim * cfg.rope.partial_rotary_factor)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], computed as transformers does (float32); the
    passing dims of a partial rotary get 0."""
    rope, dim = cfg.rope, rotary_dim(cfg)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.rope_type == "longrope":
        inv_freq = 1.0 / (torch.tensor(rope.ext_factors, dtype=torch.float32) * rope.theta**exponents)
    else:
        inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope, cfg.max_position_embeddings)
    passing = cfg.head_dim // 2 - inv_freq.shape[0]
    return torch.cat((inv_freq, torch.zeros(passing))) if passing else inv_freq


def rope_table(cfg: ModelConfig, inv_freq: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [size, head_dim] (float32) of positions 0 .. size - 1; rotate_half's sign in sin.
    rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * [-1, +1]: the sign goes into sin."""
    freqs = torch.arange(size, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()  # [size, D/2]
    scale = cfg.rope.attention_factor
    if scale != 1.0:  # longrope's: on the turning dims only (transformers scales the rotated part)
        turning = rotary_dim(cfg) // 2
        cos[:, :turning] *= scale
        sin[:, :turning] *= scale
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def head_order(cfg: ModelConfig) -> torch.Tensor | None:
    """Our order of a q / k head's dims: transformers' dim at each of our places; None when
    every dim turns (see the module's doc)."""
    d, r = cfg.head_dim, rotary_dim(cfg)
    if r == d:
        return None
    if r % 2 or (d - r) % 2:
        raise ValueError(f"partial rotary over {r} of {d} dims: both parts must be even")
    half, rest = r // 2, r + (d - r) // 2
    return torch.cat((torch.arange(half), torch.arange(r, rest), torch.arange(half, r), torch.arange(rest, d)))


def qkv_order(cfg: ModelConfig) -> torch.Tensor | None:
    """`head_order` over a fused q|k|v's rows (every q and k head; v as it is)."""
    order = head_order(cfg)
    if order is None:
        return None
    d, qk_heads = cfg.head_dim, cfg.num_heads + cfg.num_kv_heads
    qk = (torch.arange(qk_heads)[:, None] * d + order[None, :]).reshape(-1)
    return torch.cat((qk, torch.arange(qk_heads * d, (qk_heads + cfg.num_kv_heads) * d)))


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig, max_positions: int) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the middle band
    # interpolated smoothly between the two.
    old_len = rope.original_max_position_embeddings or max_positions
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def reorder_rotary_rows(cfg: ModelConfig, layers: torch.nn.ModuleList) -> None:
    """Partial rotary: each layer's float q / k rows (weights stored [in, out], q|k|v biases,
    q / k norms) in `head_order`; a no-op where every dim turns."""
    order, inner = qkv_order(cfg), head_order(cfg)
    if order is None:
        return
    with torch.no_grad():
        for layer in layers:
            layer.qkv_t.data = layer.qkv_t.data[:, order].contiguous()
            if layer.qkv_bias is not None:
                layer.qkv_bias.data = layer.qkv_bias.data[order]
            if layer.qk_norm is not None:
                layer.qk_norm.data = layer.qk_norm.data[:, inner].contiguous()


class RopeTable:
    """cos, sin rows [T, 1, D] of one set of inverse frequencies, from a table kept across
    steps and grown as positions do."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.config = cfg
        self._kept: tuple[torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def rows(
        self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at `positions` (the largest, when the caller knows it: `max_position`)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        kept = self._kept
        if kept is None or kept[0] != dtype or kept[1].shape[0] <= max_position:
            # computed in float32 like transformers, then cast to the model dtype: [size, 1, D]
            size = max(1 << max_position.bit_length(), 256)
            cos, sin = rope_table(self.config, inv_freq, size)
            self._kept = kept = (dtype, cos[:, None, :].to(dtype), sin[:, None, :].to(dtype))
        return kept[1].index_select(0, positions), kept[2].index_select(0, positions)
