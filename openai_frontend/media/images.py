"""Images sent in chat messages, made ready for Qwen2-VL's vision tower.

`decode_image` turns an image's bytes (a data URL's, a file's, a download's: media/sources.py)
into an RGB picture, refusing anything that is not a small enough PNG, JPEG, WebP or GIF. `Qwen2VLImages` resizes,
normalizes and cuts a picture (or a list of video frames) into the flattened patches the
vision encoder takes, in the same order and with the same values as transformers'
Qwen2-VL PIL image processor.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from backend.contract.vision import VisionItem

# OpenAI CLIP's normalization, Qwen2-VL's default
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# the mime types accepted, and the one PIL decoder each may use
MIME_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
DEFAULT_MAX_PIXELS = 32 * 1024 * 1024  # of a decoded picture, before any resize
MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses beyond this


class MediaError(ValueError):
    """A picture that cannot be used; `reason` is a short code, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def decode_image(raw: bytes, mime: str | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """The RGB picture in `raw` (a GIF's first frame). `mime`: the type its source declared
    (a data URL's), tried first; None (a file, a download): PNG, JPEG, WebP or GIF, sniffed."""
    if mime is not None and mime not in MIME_FORMATS:
        accepted = ", ".join(sorted(set(MIME_FORMATS) - {"image/jpg"}))
        raise MediaError("unsupported_type", f"unsupported image type {mime!r}; accepted: {accepted}")
    return to_rgb(_open_image(raw, MIME_FORMATS[mime] if mime else "PNG", max_pixels))


def _open_image(raw: bytes, declared: str, max_pixels: int) -> Image.Image:
    """Decode `raw`, after checking its size from the header alone."""
    formats = [declared, *sorted(set(MIME_FORMATS.values()) - {declared})]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=formats)  # reads the header only
    except Image.DecompressionBombError as e:
        raise MediaError("too_many_pixels", f"the image has too many pixels: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError("not_image", f"the data is not a PNG, JPEG, WebP or GIF image: {e}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError("too_many_pixels", f"the image is {width}x{height}, more than {max_pixels} pixels")
    try:
        image.seek(0)
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError("not_image", f"the image data is truncated or corrupt: {e}") from None
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (as transformers does)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class PreparedImage:
    """A picture (or video) as the vision encoder takes it.

    pixel_values: [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] float32
    grid_thw: (grid_t, grid_h, grid_w) in patches
    num_tokens: placeholder tokens in the prompt, grid_t * grid_h * grid_w / merge_size**2
    """

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_tokens: int

    def item(self, kind: str, seconds_per_grid: float = 0.0) -> VisionItem:
        """The contract's item (which computes the content hash) of this image or video."""
        return VisionItem(kind, self.grid_thw, self.pixel_values, seconds_per_grid)


@dataclass(frozen=True)
class Qwen2VLImages:
    """Qwen2-VL's image preprocessing (resize, rescale, normalize, patchify)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_folder(cls, path: str | Path) -> Qwen2VLImages:
        """Settings from a model folder's preprocessor_config.json; defaults without one."""
        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            return cls()
        return cls.from_config(json.loads(file.read_text()))

    @classmethod
    def from_config(cls, config: dict) -> Qwen2VLImages:
        """Settings from a preprocessor config; top-level min/max_pixels win over `size`."""
        size = config.get("size") or {}
        fields = {
            "min_pixels": config.get("min_pixels", size.get("shortest_edge", size.get("min_pixels"))),
            "max_pixels": config.get("max_pixels", size.get("longest_edge", size.get("max_pixels"))),
            "mean": _triple(config.get("image_mean")),
            "std": _triple(config.get("image_std")),
        }
        for name in ("patch_size", "merge_size", "temporal_patch_size", "rescale_factor"):
            fields[name] = config.get(name)
        return replace(cls(), **{k: v for k, v in fields.items() if v is not None})

    def smart_resize(
        self, height: int, width: int, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> tuple[int, int]:
        """The (height, width) to resize to: multiples of patch_size * merge_size, about the
        same aspect ratio, with an area within [min_pixels, max_pixels]."""
        min_pixels = self.min_pixels if min_pixels is None else min_pixels
        max_pixels = self.max_pixels if max_pixels is None else max_pixels
        if height < 1 or width < 1:
            raise MediaError("bad_size", f"the image is {width}x{height}")
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise MediaError(
                "aspect_ratio", f"the image is {width}x{height}: its aspect ratio must be at most {MAX_ASPECT_RATIO}"
            )
        factor = self.patch_size * self.merge_size
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > max_pixels:
            beta = math.sqrt(height * width / max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < min_pixels:
            beta = math.sqrt(min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def preprocess(
        self, image: Image.Image, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> PreparedImage:
        """One picture, its frame repeated to fill a temporal patch (grid_t = 1)."""
        return self.video_frames([image], min_pixels=min_pixels, max_pixels=max_pixels)

    def video_frames(
        self, frames: list[Image.Image], min_pixels: int | None = None, max_pixels: int | None = None
    ) -> PreparedImage:
        """Frames of one video, all of one size: each temporal_patch_size frames make one
        temporal patch, the last frame repeated to fill the last one."""
        if not frames:
            raise MediaError("no_frames", "a video needs at least one frame")
        sizes = {frame.size for frame in frames}
        if len(sizes) > 1:
            raise MediaError("frame_sizes", f"a video's frames must share one size, got {sorted(sizes)}")
        width, height = frames[0].size
        h, w = self.smart_resize(height, width, min_pixels, max_pixels)
        stack = np.stack([self._normalized(frame, h, w) for frame in frames])
        return self._prepared(stack)

    def _normalized(self, image: Image.Image, height: int, width: int) -> np.ndarray:
        """[height, width, 3] float32: bicubic resize, rescale, then (x - mean) / std."""
        resized = to_rgb(image).resize((width, height), resample=Image.Resampling.BICUBIC)
        scaled = (np.asarray(resized, dtype=np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        return (scaled - mean) / std

    def _prepared(self, frames: np.ndarray) -> PreparedImage:
        """Flattened patches of [frames, H, W, 3], and their grid."""
        patches, grid = patchify(frames, self.patch_size, self.merge_size, self.temporal_patch_size)
        num_tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
        return PreparedImage(patches, grid, num_tokens)


def patchify(
    frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[F, H, W, C] -> ([t*h*w, C*tp*p*p], (t, h, w)).

    Rows go temporal patch, then merge window (row-major over the windows), then the
    merge_size x merge_size patches inside a window (row-major); a row holds channel,
    then frame within the temporal patch, then patch row, then patch column.
    """
    count, height, width, channels = frames.shape
    if pad := -count % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    p, m = patch_size, merge_size
    grid_t, grid_h, grid_w = frames.shape[0] // temporal_patch_size, height // p, width // p
    blocks = frames.reshape(grid_t, temporal_patch_size, grid_h // m, m, p, grid_w // m, m, p, channels)
    # -> (t, window row, window col, row in window, col in window, C, frame, patch row, patch col)
    blocks = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    flat = np.ascontiguousarray(blocks.reshape(grid_t * grid_h * grid_w, channels * temporal_patch_size * p * p))
    return flat, (grid_t, grid_h, grid_w)


def _triple(values) -> tuple[float, float, float] | None:
    if values is None:
        return None
    if isinstance(values, (int, float)):
        return (float(values),) * 3
    return tuple(float(v) for v in values)
