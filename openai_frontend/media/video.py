"""Videos in chat messages: an MP4 or WebM file decoded with PyAV, or a list of frames.

A file is sampled as transformers' Qwen2-VL video processor samples with `fps`: the video's
duration times VIDEO_FPS frames (at least 1, at most VIDEO_MAX_FRAMES and the frames it
has), at indices i * total / count, so a long video is spread, not cut. An odd count is
padded to whole temporal patches by repeating the last frame (media/images.py `patchify`,
as the processor's patchify does). The first pass reads packets only (no decoding) to
count frames; the second decodes and keeps the sampled ones.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import av
from PIL import Image

from openai_frontend.media.images import MediaError

VIDEO_MIMES = ("video/mp4", "video/webm")


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    """The sampled frames, and the seconds between two of them in the source."""

    frames: list[Image.Image]
    seconds_per_frame: float


def decode_video(raw: bytes, mime: str | None, fps: float, max_frames: int, max_pixels: int) -> DecodedVideo:
    """The frames of an MP4 or WebM file sampled at `fps` (blocking: run it in a thread)."""
    if mime is not None and mime not in VIDEO_MIMES:
        raise MediaError("unsupported_type", f"unsupported video type {mime!r}; accepted: {', '.join(VIDEO_MIMES)}")
    try:
        return _decode(raw, fps, max_frames, max_pixels)
    except (av.FFmpegError, EOFError, ValueError) as e:
        if isinstance(e, MediaError):
            raise
        raise MediaError("not_video", f"the data is not a decodable MP4 or WebM video: {e}") from None


def _decode(raw: bytes, fps: float, max_frames: int, max_pixels: int) -> DecodedVideo:
    with av.open(io.BytesIO(raw), mode="r") as container:
        stream = _video_stream(container, max_pixels)
        total = sum(1 for packet in container.demux(stream) if packet.size)
        if total == 0:
            raise MediaError("no_frames", "the video has no frames")
        duration = _duration(stream, container, total)
    count = max(1, min(max_frames, total, round(duration * fps)))
    wanted = {math.floor(i * total / count) for i in range(count)}
    with av.open(io.BytesIO(raw), mode="r") as container:
        stream = container.streams.video[0]
        frames = [frame.to_image() for i, frame in enumerate(container.decode(stream)) if i in wanted]
    if not frames:
        raise MediaError("no_frames", "no frame of the video could be decoded")
    return DecodedVideo(frames, duration / count)


def _video_stream(container, max_pixels: int):
    if not container.streams.video:
        raise MediaError("not_video", "the file holds no video stream")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > max_pixels:
        raise MediaError("too_many_pixels", f"the video is {width}x{height}, more than {max_pixels} pixels a frame")
    return stream


def _duration(stream, container, total: int) -> float:
    """Seconds: from the frame rate where the file has one, else its stated duration."""
    rate = stream.average_rate or stream.guessed_rate
    if rate and float(rate) > 0:
        return total / float(rate)
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / av.time_base
    return total / 25.0  # no timing at all: PyAV's default rate


def check_frame_count(count: int, max_frames: int) -> None:
    """A list of frames must hold 1..VIDEO_MAX_FRAMES of them."""
    if count == 0:
        raise MediaError("no_frames", "a video needs at least one frame")
    if count > max_frames:
        raise MediaError("too_many_frames", f"the video has {count} frames; at most {max_frames} (VIDEO_MAX_FRAMES)")
