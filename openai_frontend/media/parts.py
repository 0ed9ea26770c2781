"""A chat request's images and videos: found in its messages, checked, loaded and
preprocessed into the contract's VisionItems, and their placeholders expanded in the prompt.

The chat path calls, in order:

1. `media_parts(messages)`: every image and video part in prompt order (any role; the chat
   template renders them all), each with the `messages[i].content[j]` an error names;
2. `check_parts(parts, info, settings)`: a 400 for media sent to a text-only model, and for
   more items of a kind than LIMIT_MM_PER_PROMPT allows, before anything is read;
3. `await prepare_items(parts, ...)`: each part loaded (media/sources.py), decoded and
   preprocessed off the event loop (asyncio.to_thread), refused where it is bad;
4. `expand_placeholders(prompt, items, vision)`: the template's single `<|image_pad|>` (or
   `<|video_pad|>`) of each item becomes `item.num_tokens(merge_size)` of them.

Every refusal is a 400 whose param is the part's `messages[i].content[j]` (or `messages`
for a prompt whose placeholders do not match its items), so nothing bad reaches the engine.

`detail: "low"` caps an image at LOW_DETAIL_MAX_PIXELS (256 merged tokens, about 448x448:
near the 512x512 view OpenAI's low detail describes); "auto" and "high" use the model's
bounds. mm_processor_kwargs' min_pixels / max_pixels replace the model's for the request.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from backend.contract import ModelInfo
from backend.contract.vision import VisionInfo, VisionItem
from openai_frontend.api.errors import OpenAIError, bad_request
from openai_frontend.media.images import MediaError, Qwen2VLImages, decode_image
from openai_frontend.media.settings import MediaSettings
from openai_frontend.media.sources import MediaBytes, load_url
from openai_frontend.media.video import check_frame_count, decode_video

LOW_DETAIL_MAX_PIXELS = 28 * 28 * 256


@dataclass(frozen=True, slots=True)
class MediaPart:
    """One image or video part: where it is, what it is, and its URLs (a video given as
    frames has one per frame)."""

    param: str  # messages[i].content[j]
    kind: str  # "image" | "video"
    urls: tuple[str, ...]
    as_frames: bool = False
    detail: str | None = None


def media_parts(messages) -> list[MediaPart]:
    """The messages' image and video parts, in the order the template renders them."""
    parts = []
    for i, message in enumerate(messages):
        content = message.content if isinstance(message.content, list) else []
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            if part.type == "image_url":
                parts.append(MediaPart(param, "image", (part.image_url.url,), detail=part.image_url.detail))
            elif part.type == "video_url":
                parts.append(MediaPart(param, "video", (part.video_url.url,)))
            elif part.type == "video":
                parts.append(MediaPart(param, "video", tuple(part.video), as_frames=True))
    return parts


def check_parts(parts: list[MediaPart], info: ModelInfo, settings: MediaSettings) -> None:
    """A 400 for the first part a text-only model cannot take or a limit refuses."""
    counts = dict.fromkeys(("image", "video"), 0)
    for part in parts:
        if info.vision is None:
            raise _refused(part, f"this model takes text only: it cannot read {part.kind}s")
        counts[part.kind] += 1
        limit = settings.limit(part.kind)
        if counts[part.kind] > limit:
            raise _refused(part, f"at most {limit} {part.kind}(s) per request (LIMIT_MM_PER_PROMPT)")


def processor_for(images: Qwen2VLImages, vision: VisionInfo, kwargs: Mapping[str, int] | None) -> Qwen2VLImages:
    """The model folder's processor with the engine's patch facts and the request's bounds."""
    bounds = {name: value for name, value in (kwargs or {}).items() if name in ("min_pixels", "max_pixels")}
    return replace(
        images, patch_size=vision.patch_size, merge_size=vision.merge_size,
        temporal_patch_size=vision.temporal_patch_size, **bounds,
    )  # fmt: skip


async def prepare_items(
    parts: list[MediaPart], processor: Qwen2VLImages, settings: MediaSettings, max_model_len: int
) -> tuple[VisionItem, ...]:
    """Each part's VisionItem, in order; a 400 naming the first part that cannot be one.
    Items together must leave room in the context: an item over it is refused before
    its resize (a huge min_pixels cannot make the server allocate a huge picture)."""
    items, room = [], max_model_len - 1
    for part in parts:
        try:
            item = await _item(part, processor, settings, room)
        except MediaError as e:
            raise _refused(part, e.message) from None
        room -= item.num_tokens(processor.merge_size)
        items.append(item)
    return tuple(items)


async def _item(part: MediaPart, processor: Qwen2VLImages, settings: MediaSettings, room: int) -> VisionItem:
    if part.as_frames:
        check_frame_count(len(part.urls), settings.video_max_frames)
    files = [await load_url(url, settings) for url in part.urls]
    if part.kind == "image":
        return await asyncio.to_thread(_image_item, files[0], part.detail, processor, settings, room)
    if part.as_frames:
        return await asyncio.to_thread(_frames_item, files, processor, settings, room)
    return await asyncio.to_thread(_video_item, files[0], processor, settings, room)


def _image_item(
    file: MediaBytes, detail: str | None, processor: Qwen2VLImages, settings: MediaSettings, room: int
) -> VisionItem:
    if detail == "low":
        max_pixels = min(processor.max_pixels, LOW_DETAIL_MAX_PIXELS)
        processor = replace(processor, max_pixels=max_pixels, min_pixels=min(processor.min_pixels, max_pixels))
    image = decode_image(file.raw, file.mime, settings.max_image_pixels)
    _check_tokens(processor, image.size, 1, room)
    return processor.preprocess(image).item("image")


def _frames_item(files: list[MediaBytes], processor: Qwen2VLImages, settings: MediaSettings, room: int) -> VisionItem:
    """A video given as frames: taken as sampled at VIDEO_FPS."""
    frames = [decode_image(file.raw, file.mime, settings.max_image_pixels) for file in files]
    _check_tokens(processor, frames[0].size, len(frames), room)
    seconds = processor.temporal_patch_size / settings.video_fps
    return processor.video_frames(frames).item("video", seconds)


def _video_item(file: MediaBytes, processor: Qwen2VLImages, settings: MediaSettings, room: int) -> VisionItem:
    video = decode_video(file.raw, file.mime, settings.video_fps, settings.video_max_frames, settings.max_image_pixels)
    _check_tokens(processor, video.frames[0].size, len(video.frames), room)
    seconds = processor.temporal_patch_size * video.seconds_per_frame
    return processor.video_frames(video.frames).item("video", seconds)


def _check_tokens(processor: Qwen2VLImages, size: tuple[int, int], frames: int, room: int) -> None:
    """A MediaError for a picture smaller than one vision patch (a 1x1 image: transformers
    would blow it up to 56x56 of one colour, which tells the model nothing), or when the
    item's tokens would not fit what the context has left."""
    width, height = size
    if min(width, height) < processor.patch_size:
        side = processor.patch_size
        raise MediaError("too_small", f"it is {width}x{height} pixels; each side must be at least {side} (one patch)")
    h, w = processor.smart_resize(height, width)
    merged = processor.patch_size * processor.merge_size
    tokens = math.ceil(frames / processor.temporal_patch_size) * (h // merged) * (w // merged)
    if tokens > room:
        raise MediaError(
            "too_many_tokens",
            f"it would take {tokens} tokens ({w}x{h} after resizing), and the context has {max(room, 0)} left; "
            "send a smaller image, or lower mm_processor_kwargs.max_pixels or use detail: low",
        )


def expand_placeholders(prompt: list[int], items: tuple[VisionItem, ...], vision: VisionInfo) -> list[int]:
    """The prompt with each item's one placeholder token repeated num_tokens times; a 400
    when the placeholders in the prompt do not match the items one to one (a template that
    renders no placeholder, or a text that spells one out)."""
    kinds = {vision.image_token_id: "image", vision.video_token_id: "video"}
    expanded, used = [], 0
    for token in prompt:
        kind = kinds.get(token)
        if kind is None:
            expanded.append(token)
            continue
        if used >= len(items) or items[used].kind != kind:
            raise _mismatch(prompt, items, kinds)
        expanded.extend([token] * items[used].num_tokens(vision.merge_size))
        used += 1
    if used != len(items):
        raise _mismatch(prompt, items, kinds)
    return expanded


def _mismatch(prompt: list[int], items: tuple[VisionItem, ...], kinds: dict[int, str]) -> OpenAIError:
    placed = [kinds[token] for token in prompt if token in kinds]
    message = (
        f"messages: the chat template placed {len(placed)} image/video placeholders ({', '.join(placed) or 'none'}) "
        f"for {len(items)} image/video parts ({', '.join(item.kind for item in items) or 'none'}); a text must "
        "not spell out a placeholder token such as <|image_pad|>"
    )
    return bad_request("messages", message)


def _refused(part: MediaPart, why: str) -> OpenAIError:
    return bad_request(part.param, f"{part.param}: {why}")
