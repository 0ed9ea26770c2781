"""Qwen2-VL's vision tower (`Qwen2VLForConditionalGeneration`'s `visual.*`): its config and our
encoder, run once per request over its images and video frames (issue: vision inputs).

The image processor cuts each image (or pair of video frames) into patches of C x T x P x P
values (3 x 2 x 14 x 14), already ordered by 2x2 merge window: patch rows (2i, 2i+1) and columns
(2j, 2j+1) sit next to each other. A patch embedding (a Conv3d whose kernel is the whole patch:
a linear map over the flattened patch), then pre-LN blocks: self-attention with 2-D rotary
embeddings (a quarter of each head's pairs rotate by the patch's row, a quarter by its column,
every pair twice as rotate-half lays them out), attending only within one frame of one image;
a QuickGELU MLP. The merger LayerNorms each patch, concatenates each window's 4 patches and
maps them through a GELU MLP to the language model's hidden size: one token per window.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from backend.runner.weights import weight_files

PREFIXES = ("model.visual.", "visual.")  # transformers 5 may save either; released checkpoints: visual.*
_NORM_EPS = 1e-6
_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "silu": F.silu,
}


@dataclass(frozen=True, slots=True)
class Qwen2VisionConfig:
    """config.json's vision_config (released checkpoints name some keys differently:
    in_chans, spatial_patch_size); `hidden_size` is the merger's output, the text's width."""

    depth: int
    embed_dim: int
    hidden_size: int
    num_heads: int
    mlp_ratio: float = 4.0
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0

    @classmethod
    def load(cls, folder: str | Path) -> Qwen2VisionConfig:
        raw = json.loads((Path(folder) / "config.json").read_text()).get("vision_config")
        if not raw:
            raise ValueError(f"{folder}'s config.json has no vision_config")
        if raw.get("hidden_act", "quick_gelu") not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {raw['hidden_act']!r}")
        rope = raw.get("rope_parameters") or {}
        return cls(
            depth=raw["depth"],
            embed_dim=raw["embed_dim"],
            hidden_size=raw["hidden_size"],
            num_heads=raw["num_heads"],
            mlp_ratio=raw.get("mlp_ratio", 4),
            in_channels=raw.get("in_channels", raw.get("in_chans", 3)),
            patch_size=raw.get("patch_size", raw.get("spatial_patch_size", 14)),
            temporal_patch_size=raw.get("temporal_patch_size", 2),
            spatial_merge_size=raw.get("spatial_merge_size", 2),
            hidden_act=raw.get("hidden_act", "quick_gelu"),
            rope_theta=rope.get("rope_theta", 10000.0),
        )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The values of one flattened patch: a row of pixel_values."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """The merged tokens (language-model positions) one image or video of this grid yields."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[N, 2] int64 (row, column) of every patch, in the processor's order: frames, then merge
    windows row-major, then the merge x merge patches of each window row-major."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rows, cols = (x.transpose(1, 2).reshape(-1) for x in (rows, cols))
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def rotary_tables(cfg: Qwen2VisionConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] float32: head_dim/4 frequencies by row, then as many by column;
    the half repeated for rotate-half's pairing of dimension i with i + head_dim/2."""
    quarter = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
    angles = (positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)).flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] rotated in float32 (as transformers does), back in x's dtype."""
    xf, half = x.float(), x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def frame_lengths(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Patches per attention segment: each frame (t) of each image attends only to itself."""
    return [h * w for t, h, w in grid_thw for _ in range(t)]


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float):
    """q, k, v [N, heads, d] -> [N, heads * d]: each frame's (or window's) patches, `lengths`
    of them in turn, attend to one another only. Consecutive frames of one length (a video's,
    images of one size) go through one batched attention call, not one call each."""
    n, heads, d = q.shape
    outs, at = [], 0
    for length, group in itertools.groupby(lengths):
        count = len(list(group))
        rows = slice(at, at + count * length)

        def batched(x, rows=rows, count=count, length=length):
            return x[rows].view(count, length, heads, d).transpose(1, 2)  # [frames, heads, length, d]

        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), scale=scale)
        outs.append(out.transpose(1, 2).reshape(count * length, heads * d))
        at += count * length
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def is_vision_weight(name: str) -> bool:
    return name.startswith(PREFIXES)


def strip_vision_prefix(name: str) -> str:
    return next(name[len(p) :] for p in PREFIXES if name.startswith(p))


class Qwen2VisionEncoder(torch.nn.Module):
    """`weights`: the checkpoint's vision tensors with their prefix dropped ("blocks.0.attn.qkv.weight",
    ...; the patch embedding's Conv3d kernel flattened to [embed_dim, patch_dim]), in the
    encoder's dtype and device."""

    config_class = Qwen2VisionConfig  # what `load` reads the vision_config with (a subclass's own)

    def __init__(self, cfg: Qwen2VisionConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.weights = dict(weights)
        self.weights["patch_embed.proj.weight"] = weights["patch_embed.proj.weight"].reshape(cfg.embed_dim, -1)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    @classmethod
    def load(
        cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> Qwen2VisionEncoder:

        weights = {}
        for file in weight_files(Path(folder)):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in filter(is_vision_weight, f.keys()):
                    weights[strip_vision_prefix(name)] = f.get_tensor(name).to(device=device, dtype=dtype)
        if "patch_embed.proj.weight" not in weights:
            raise ValueError(f"no Qwen2-VL vision weights (visual.*) in {folder}")
        return cls(cls.config_class.load(folder), weights)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights["patch_embed.proj.weight"].dtype

    @property
    def device(self) -> torch.device:
        return self.weights["patch_embed.proj.weight"].device

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """[sum(t*h*w) / merge^2, hidden_size]: the merged tokens of every image / video in turn.
        `pixel_values` [sum(t*h*w), patch_dim] as the image processor emits them."""
        cfg, grid_thw = self.cfg, [tuple(int(v) for v in g) for g in grid_thw]
        x = self._patch_embed(pixel_values, grid_thw)
        cos, sin = rotary_tables(cfg, patch_positions(grid_thw, cfg.spatial_merge_size).to(self.device))
        lengths = frame_lengths(grid_thw)
        for i in range(cfg.depth):
            x = self._block(x, f"blocks.{i}.", cos, sin, lengths)
        return self._merge(x)

    def _patch_embed(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """[N, embed_dim]: each patch through the patch embedding; ValueError when the pixel
        rows do not match the grids."""
        if pixel_values.shape != (sum(t * h * w for t, h, w in grid_thw), self.cfg.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match grids {grid_thw}")
        pixels = pixel_values.to(device=self.device, dtype=self.dtype)
        return F.linear(pixels, self.weights["patch_embed.proj.weight"])

    def _block(
        self, x: torch.Tensor, prefix: str, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self._attention(self._norm(x, prefix + "norm1"), prefix + "attn.", cos, sin, lengths)
        return x + self._mlp(self._norm(x, prefix + "norm2"), prefix + "mlp.")

    def _mlp(self, h: torch.Tensor, prefix: str) -> torch.Tensor:
        return self._linear(self.act(self._linear(h, prefix + "fc1")), prefix + "fc2")

    def _attention(
        self, h: torch.Tensor, prefix: str, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        n, heads, d = h.shape[0], self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self._linear(h, prefix + "qkv").view(n, 3, heads, d).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self._linear(frame_attention(q, k, v, lengths, d**-0.5), prefix + "proj")

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        window = self.cfg.spatial_merge_size**2
        h = self._norm(x, "merger.ln_q").reshape(-1, window * self.cfg.embed_dim)
        return self._linear(F.gelu(self._linear(h, "merger.mlp.0")), "merger.mlp.2")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.weights[name + ".weight"], self.weights.get(name + ".bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, b = self.weights[name + ".weight"], self.weights[name + ".bias"]
        return F.layer_norm(x, x.shape[-1:], w, b, _NORM_EPS)
