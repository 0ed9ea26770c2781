"""What the server lets a chat request bring as media: these environment variables, as
openai_frontend/settings.py passes them to `MediaSettings.from_env`.

- LIMIT_MM_PER_PROMPT: items per request by kind, vLLM's syntax: `image=8,video=1` (the
  default); a kind left out keeps its default, 0 refuses that kind.
- MAX_IMAGE_PIXELS: decoded pixels (width x height) of an image or of a video frame, before
  any resize, checked from the file's header (default 32 Mi: a decompression bomb is refused
  unread).
- MAX_MEDIA_BYTES: the encoded bytes of one image, video or frame, whatever its source
  (default 20 MiB). A data URL is also bounded by the body's MAX_REQUEST_BYTES.
- ALLOWED_LOCAL_MEDIA_PATH: `file://` URLs may name files under this folder (symlinks and
  `..` resolved first); unset (the default): every file:// URL is refused.
- ALLOWED_MEDIA_DOMAINS: comma-separated host names `http(s)://` URLs may name (exact
  match, any port); unset (the default): the server never fetches.
- MEDIA_FETCH_TIMEOUT_S: the whole of one download, connect to last byte (default 5).
- VIDEO_FPS: frames sampled per second of a video file (default 2), VIDEO_MAX_FRAMES at
  most (default 32), spread over the whole video when it is longer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from openai_frontend.media.images import DEFAULT_MAX_PIXELS

MEDIA_KINDS = ("image", "video")
DEFAULT_LIMITS = {"image": 8, "video": 1}
ENV_NAMES = (
    "LIMIT_MM_PER_PROMPT", "MAX_IMAGE_PIXELS", "MAX_MEDIA_BYTES", "ALLOWED_LOCAL_MEDIA_PATH",
    "ALLOWED_MEDIA_DOMAINS", "MEDIA_FETCH_TIMEOUT_S", "VIDEO_FPS", "VIDEO_MAX_FRAMES",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class MediaSettings:
    limit_per_prompt: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    max_media_bytes: int = 20 * 2**20
    allowed_local_media_path: Path | None = None
    allowed_media_domains: frozenset[str] = frozenset()
    fetch_timeout_s: float = 5.0
    video_fps: float = 2.0
    video_max_frames: int = 32

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> MediaSettings:
        """The settings `environ` gives; a ValueError naming a malformed variable."""

        def raw(name: str) -> str:
            return environ.get(name, "").strip()

        values: dict = {"limit_per_prompt": parse_limits(raw("LIMIT_MM_PER_PROMPT"))}
        for name, attr, kind in (
            ("MAX_IMAGE_PIXELS", "max_image_pixels", int), ("MAX_MEDIA_BYTES", "max_media_bytes", int),
            ("MEDIA_FETCH_TIMEOUT_S", "fetch_timeout_s", float), ("VIDEO_FPS", "video_fps", float),
            ("VIDEO_MAX_FRAMES", "video_max_frames", int),
        ):  # fmt: skip
            if raw(name):
                values[attr] = _positive(name, raw(name), kind)
        if raw("ALLOWED_LOCAL_MEDIA_PATH"):
            values["allowed_local_media_path"] = Path(raw("ALLOWED_LOCAL_MEDIA_PATH")).resolve()
        domains = (d.strip().lower() for d in raw("ALLOWED_MEDIA_DOMAINS").split(","))
        values["allowed_media_domains"] = frozenset(d for d in domains if d)
        return cls(**values)

    def limit(self, kind: str) -> int:
        return self.limit_per_prompt.get(kind, 0)


def parse_limits(text: str) -> dict[str, int]:
    """`image=8,video=1` -> {"image": 8, "video": 1}, over the defaults."""
    limits = dict(DEFAULT_LIMITS)
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, count = item.partition("=")
        kind = kind.strip()
        if kind not in MEDIA_KINDS or not count.strip().isdigit():
            raise ValueError(f"LIMIT_MM_PER_PROMPT: expected kind=count with a kind of {MEDIA_KINDS}, got {item!r}")
        limits[kind] = int(count)
    return limits


def _positive(name: str, raw: str, kind: type) -> int | float:
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be greater than 0, got {raw!r}")
    return value
