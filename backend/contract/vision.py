"""Images and videos of a request, preprocessed: one `VisionItem` each, in prompt order.

The frontend decodes and preprocesses the media (resize, normalize, cut into patches)
and expands each item's placeholder in the prompt to one token per merged patch; the
engine's vision encoder turns an item's `pixels` into the embeddings of those tokens.
So what crosses the wire is numbers, never encoded files.

On the wire (backend.contract.tensors): `vision_kinds` (one per item), `vision_grids`
[items, 3], `vision_pixels` [sum of t*h*w, patch_dim] (every item's patches one after
another) and `vision_seconds` (a video's seconds per temporal patch, 0 for an image).

An item's `content_hash` is computed from what it holds (kind, grid and pixel bytes),
never taken from a client: the prefix cache and the encoder cache trust it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from backend.contract.errors import ContractError

VISION_KINDS = ("image", "video")

Grid = tuple[int, int, int]  # (t, h, w) in patches, before the 2x2 merge


@dataclass(frozen=True, slots=True, eq=False)
class VisionItem:
    kind: str  # VISION_KINDS
    grid: Grid
    pixels: np.ndarray  # [t * h * w, patch_dim] float32: the flattened patches, the processor's order
    seconds_per_grid: float = 0.0  # a video's seconds per temporal patch (Qwen2.5-VL time ids); 0: an image
    content_hash: str = field(init=False, default="")

    def __post_init__(self) -> None:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{self.kind}\0{self.grid}\0{self.seconds_per_grid!r}\0".encode())
        digest.update(np.ascontiguousarray(self.pixels, dtype=np.float32).tobytes())
        object.__setattr__(self, "content_hash", digest.hexdigest())

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def num_tokens(self, merge: int) -> int:
        """Its placeholder tokens in the prompt: one per merged merge x merge patch."""
        t, h, w = self.grid
        return t * (h // merge) * (w // merge)


def vision_checks(items: tuple[VisionItem, ...]) -> Iterator[tuple[str, bool, str]]:
    """The checks that need no model facts (backend.contract.request's Check)."""
    for i, item in enumerate(items):
        yield ("vision_kinds", item.kind in VISION_KINDS, f"item {i}: must be one of {VISION_KINDS}")
        yield ("vision_grids", len(item.grid) == 3 and min(item.grid) >= 1, f"item {i}: (t, h, w) must each be >= 1")
        shape = tuple(item.pixels.shape)
        fits = item.pixels.ndim == 2 and shape[0] == item.num_patches and shape[1] >= 1
        yield ("vision_pixels", fits, f"item {i}: {shape} does not hold t*h*w = {item.num_patches} patches")
        yield ("vision_pixels", bool(np.isfinite(item.pixels).all()), f"item {i}: must be finite numbers")
        seconds_ok = item.seconds_per_grid >= 0.0 and (item.kind == "video" or item.seconds_per_grid == 0.0)
        yield ("vision_seconds", seconds_ok, f"item {i}: must be >= 0, and 0 for an image")


@dataclass(frozen=True, slots=True)
class VisionInfo:
    """A vision-language model's facts (ModelInfo.vision): how the frontend builds items."""

    family: str  # "qwen2_vl" | "qwen2_5_vl": the preprocessing and position scheme
    image_token_id: int  # the placeholder of one image token (<|image_pad|>)
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: float = 0.0  # Qwen2.5-VL's video time ids (0: Qwen2-VL, none)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def placeholder_id(self, kind: str) -> int:
        return self.image_token_id if kind == "image" else self.video_token_id


# -- the wire -----------------------------------------------------------------------


def encode_vision(items: tuple[VisionItem, ...]) -> dict[str, np.ndarray]:
    """The items' named arrays (none for a request without media)."""
    if not items:
        return {}
    return {
        "vision_kinds": np.array([item.kind.encode() for item in items], dtype=np.object_),
        "vision_grids": np.array([list(item.grid) for item in items], dtype=np.int32),
        "vision_pixels": np.concatenate([np.asarray(item.pixels, dtype=np.float32) for item in items]),
        "vision_seconds": np.array([item.seconds_per_grid for item in items], dtype=np.float64),
    }


def decode_vision(arrays) -> tuple[VisionItem, ...]:
    """Items from named arrays (None where absent); ContractError when they disagree."""
    kinds, grids = arrays.get("vision_kinds"), arrays.get("vision_grids")
    pixels, seconds = arrays.get("vision_pixels"), arrays.get("vision_seconds")
    if kinds is None and grids is None and pixels is None and seconds is None:
        return ()
    if kinds is None or grids is None or pixels is None:
        raise ContractError("vision_kinds", "vision_kinds, vision_grids and vision_pixels come together")
    kinds = [bytes(k).decode(errors="replace") if not isinstance(k, str) else k for k in np.asarray(kinds).reshape(-1)]
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3) if np.asarray(grids).size % 3 == 0 else None
    if grids is None or len(grids) != len(kinds):
        raise ContractError("vision_grids", f"must be [{len(kinds)}, 3]: one (t, h, w) per item in vision_kinds")
    pixels = np.asarray(pixels, dtype=np.float32)
    seconds = np.zeros(len(kinds)) if seconds is None else np.asarray(seconds, dtype=np.float64).reshape(-1)
    if len(seconds) != len(kinds):
        raise ContractError("vision_seconds", f"must hold one value per item ({len(kinds)})")
    return _split(kinds, grids, pixels, seconds)


def _split(kinds, grids, pixels, seconds) -> tuple[VisionItem, ...]:
    sizes = [int(t) * int(h) * int(w) if min(t, h, w) >= 1 else 0 for t, h, w in grids]
    if pixels.ndim != 2 or pixels.shape[0] != sum(sizes):
        raise ContractError("vision_pixels", f"must be [{sum(sizes)}, patch_dim]: the grids' patches one after another")
    items, at = [], 0
    for kind, grid, size, second in zip(kinds, grids, sizes, seconds, strict=True):
        t, h, w = (int(v) for v in grid)
        items.append(VisionItem(kind, (t, h, w), pixels[at : at + size], float(second)))
        at += size
    return tuple(items)
