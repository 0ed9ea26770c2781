"""Videos (media/video.py): MP4 and WebM files encoded here with PyAV, decoded and sampled
at VIDEO_FPS as transformers' Qwen2-VL video processor samples (indices i * total / count)."""

from __future__ import annotations

import numpy as np
import pytest

from openai_frontend.media import MediaError, Qwen2VLImages
from openai_frontend.media.video import check_frame_count, decode_video
from tests.helpers.media import video_bytes

BIG = 10**8


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_sampled_at_the_fps(fmt):
    raw = video_bytes(30, rate=10, fmt=fmt)  # 3 seconds
    video = decode_video(raw, f"video/{fmt}", fps=2.0, max_frames=32, max_pixels=BIG)
    assert len(video.frames) == 6 and video.seconds_per_frame == pytest.approx(0.5)
    # frames 0, 5, 10, ...: gray level 8 * index (lossy codecs: within a few levels)
    levels = [int(np.asarray(frame)[10, 10, 0]) for frame in video.frames]
    assert all(abs(level - 40 * i) <= 4 for i, level in enumerate(levels)), levels
    assert video.frames[0].size == (64, 48)


def test_a_long_video_is_spread_over_max_frames():
    video = decode_video(video_bytes(30, rate=10), None, fps=2.0, max_frames=4, max_pixels=BIG)
    assert len(video.frames) == 4 and video.seconds_per_frame == pytest.approx(0.75)
    levels = [int(np.asarray(frame)[10, 10, 0]) for frame in video.frames]
    assert all(abs(level - 8 * index) <= 4 for level, index in zip(levels, (0, 7, 15, 22), strict=True)), levels


def test_an_odd_frame_count_is_padded_with_the_last_frame():
    video = decode_video(video_bytes(15, rate=10), None, fps=2.0, max_frames=32, max_pixels=BIG)
    assert len(video.frames) == 3  # 1.5 s at 2 fps (round half to even: 3 is round(3.0))
    images = Qwen2VLImages()
    prepared = images.video_frames(video.frames)
    padded = images.video_frames([*video.frames, video.frames[-1]])
    assert prepared.grid_thw[0] == 2
    np.testing.assert_array_equal(prepared.pixel_values, padded.pixel_values)


def test_a_short_video_has_at_least_one_frame():
    video = decode_video(video_bytes(2, rate=10), None, fps=2.0, max_frames=32, max_pixels=BIG)
    assert len(video.frames) == 1


@pytest.mark.parametrize(
    ("raw", "mime", "reason"),
    [
        (b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 20, "video/mp4", "not_video"),
        (b"not a video at all", None, "not_video"),
        (b"x", "video/avi", "unsupported_type"),
        (b"x", "image/png", "unsupported_type"),
    ],
)
def test_bad_videos(raw, mime, reason):
    with pytest.raises(MediaError) as refused:
        decode_video(raw, mime, fps=2.0, max_frames=32, max_pixels=BIG)
    assert refused.value.reason == reason


def test_too_many_pixels_a_frame_is_refused_before_decoding():
    with pytest.raises(MediaError) as refused:
        decode_video(video_bytes(4, rate=10), None, fps=2.0, max_frames=32, max_pixels=64 * 48 - 1)
    assert refused.value.reason == "too_many_pixels"


def test_frame_lists_hold_one_to_max_frames():
    check_frame_count(1, 4)
    check_frame_count(4, 4)
    for count, reason in ((0, "no_frames"), (5, "too_many_frames")):
        with pytest.raises(MediaError) as refused:
            check_frame_count(count, 4)
        assert refused.value.reason == reason
