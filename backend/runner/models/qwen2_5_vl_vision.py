"""Qwen2.5-VL's vision tower (`Qwen2_5_VLForConditionalGeneration`'s `visual.*`): its config and
our encoder, with Qwen2VisionEncoder's call signature (pixel_values, grid_thw) -> merged tokens.

It keeps Qwen2-VL's patch embedding, 2-D rotary embeddings and merge-window patch order
(backend/runner/models/qwen2_vl_vision.py) and changes the rest:
- RMSNorm instead of LayerNorm (blocks and merger), a SwiGLU MLP with biases;
- window attention: the merged tokens of each frame are grouped in square windows of
  `window_size` pixels (window_size / patch / merge merged tokens a side, the last row and
  column of windows cut short by the frame's edge); a patch attends only within its window,
  except in the blocks of `fullatt_block_indexes`, which attend within the whole frame.
  The patches are reordered window by window (each merge window's patches kept together)
  before the blocks and the merged tokens put back in the processor's order after the merger;
- the merger maps to `out_hidden_size` (the language model's width).
Modelled on transformers' modeling_qwen2_5_vl.py (its math, not its code).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.runner.models.qwen2_vl_vision import (
    _ACTIVATIONS,
    Qwen2VisionConfig,
    Qwen2VisionEncoder,
    frame_lengths,
    patch_positions,
    rotary_tables,
)

_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class Qwen2_5VisionConfig(Qwen2VisionConfig):
    """config.json's vision_config. As in Qwen2VisionConfig, `embed_dim` is the tower's width
    (the config's hidden_size) and `hidden_size` the merger's output (out_hidden_size)."""

    intermediate_size: int = 0
    window_size: int = 112  # pixels a side of an attention window
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float = 0.0  # video time ids (the language model's side)

    @classmethod
    def load(cls, folder: str | Path) -> Qwen2_5VisionConfig:
        raw = json.loads((Path(folder) / "config.json").read_text()).get("vision_config")
        if not raw:
            raise ValueError(f"{folder}'s config.json has no vision_config")
        if raw.get("hidden_act", "silu") not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {raw['hidden_act']!r}")
        cfg = cls(
            depth=raw["depth"],
            embed_dim=raw["hidden_size"],
            hidden_size=raw["out_hidden_size"],
            num_heads=raw["num_heads"],
            in_channels=raw.get("in_channels", raw.get("in_chans", 3)),
            patch_size=raw.get("patch_size", raw.get("spatial_patch_size", 14)),
            temporal_patch_size=raw.get("temporal_patch_size", 2),
            spatial_merge_size=raw.get("spatial_merge_size", 2),
            hidden_act=raw.get("hidden_act", "silu"),
            rope_theta=(raw.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            intermediate_size=raw["intermediate_size"],
            window_size=raw.get("window_size", 112),
            fullatt_block_indexes=tuple(raw.get("fullatt_block_indexes", ())),
            tokens_per_second=float(raw.get("tokens_per_second", 4)),
        )
        if cfg.window_side < 1:
            raise ValueError(f"window_size {cfg.window_size} is below one merge window of patches")
        return cfg

    @property
    def window_side(self) -> int:
        """Merged tokens a side of an attention window."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def window_order(grid_thw: list[tuple[int, int, int]], merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens in window order, as indices [M] into the processor's order (frames,
    then merged rows, then columns), and each window's patch count, windows in order.

    A frame's windows go row-major over `side` x `side` blocks of merged tokens; inside one,
    its tokens keep their row-major order (a stable sort by window number)."""
    orders, lengths, offset = [], [], 0
    for t, h, w in grid_thw:
        rows_m, cols_m = h // merge, w // merge
        across = -(-cols_m // side)  # windows per row of windows
        per_frame = -(-rows_m // side) * across
        rows = torch.arange(rows_m).repeat_interleave(cols_m)
        cols = torch.arange(cols_m).repeat(rows_m)
        in_frame = (rows // side) * across + cols // side  # [rows_m * cols_m]
        window = (torch.arange(t)[:, None] * per_frame + in_frame).reshape(-1)
        orders.append(torch.argsort(window, stable=True) + offset)
        counts = torch.bincount(window, minlength=t * per_frame)
        lengths += [int(c) * merge * merge for c in counts.tolist() if c > 0]
        offset += t * rows_m * cols_m
    return torch.cat(orders), lengths


class Qwen2_5VisionEncoder(Qwen2VisionEncoder):
    """Qwen2VisionEncoder's weights convention (prefix dropped, patch kernel flattened) with
    Qwen2.5-VL's blocks: "blocks.N.mlp.{gate,up,down}_proj", RMSNorm gains only."""

    config_class = Qwen2_5VisionConfig

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """[sum(t*h*w) / merge^2, out_hidden_size]: the merged tokens of every image / video in
        turn, in the processor's order. `pixel_values` [sum(t*h*w), patch_dim]."""
        cfg, grid_thw = self.cfg, [tuple(int(v) for v in g) for g in grid_thw]
        x = self._patch_embed(pixel_values, grid_thw)
        unit = cfg.spatial_merge_size**2
        order, windows = window_order(grid_thw, cfg.spatial_merge_size, cfg.window_side)
        # Patches reordered window by window; a merge window's `unit` patches stay together.
        patches = (order[:, None] * unit + torch.arange(unit)).reshape(-1).to(self.device)
        x = x[patches]
        cos, sin = rotary_tables(cfg, patch_positions(grid_thw, cfg.spatial_merge_size).to(self.device)[patches])
        frames = frame_lengths(grid_thw)  # window order keeps each frame's patches contiguous
        for i in range(cfg.depth):
            lengths = frames if i in cfg.fullatt_block_indexes else windows
            x = self._block(x, f"blocks.{i}.", cos, sin, lengths)
        return self._merge(x)[torch.argsort(order).to(self.device)]

    def _mlp(self, h: torch.Tensor, prefix: str) -> torch.Tensor:
        gate, up = self._linear(h, prefix + "gate_proj"), self._linear(h, prefix + "up_proj")
        return self._linear(self.act(gate) * up, prefix + "down_proj")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm computed in float32, cast back, then scaled (transformers' order)."""
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=_NORM_EPS).to(x.dtype)
        return normed * self.weights[name + ".weight"]
