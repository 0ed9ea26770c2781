"""RoPE's inverse frequencies as transformers computes them (default, linear and Llama 3.1's),
and the cos / sin table the models read their rows from."""

from __future__ import annotations

import math

import torch

from backend.types.model_config import ModelConfig, RopeConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], computed as transformers does (float32)."""
    rope, dim = cfg.rope, cfg.head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope, cfg.max_position_embeddings)
    return inv_freq


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


class RopeTable:
    """cos, sin rows [T, 1, D] of one set of inverse frequencies, from a table kept across
    steps and grown as positions do."""

    def __init__(self) -> None:
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
            freqs = torch.arange(size, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos(), freqs.sin()  # [size, D/2]
            # rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * [-1, +1]: the sign goes into sin.
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
            self._kept = kept = (dtype, cos[:, None, :].to(dtype), sin[:, None, :].to(dtype))
        return kept[1].index_select(0, positions), kept[2].index_select(0, positions)
