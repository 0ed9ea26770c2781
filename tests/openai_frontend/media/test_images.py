"""Image preprocessing for Qwen2-VL: equal to transformers' PIL image processor, data URLs
decoded or refused with a MediaError that says why."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image, ImageFile

from openai_frontend.media import MediaError, Qwen2VLImages, decode_image
from openai_frontend.media.sources import decode_data

MB = 1 << 20


def decode_data_url(url: str, max_bytes: int, **kwargs):
    """A data URL's picture, as the chat path reads one (media/sources.py, then decode_image)."""
    data = decode_data(url, max_bytes)
    return decode_image(data.raw, data.mime, **kwargs)


def picture(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    # smooth gradients plus noise, so a resize has something to interpolate
    ys, xs = np.mgrid[0:height, 0:width]
    pixels[..., 0] = ((xs * 255) // max(width - 1, 1)).astype(np.uint8) // 2 + pixels[..., 0] // 2
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


@pytest.fixture(scope="module")
def reference():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


def transformers_output(processor_class, image, **sizes):
    kwargs = {}
    if sizes:
        kwargs["size"] = {"shortest_edge": sizes["min_pixels"], "longest_edge": sizes["max_pixels"]}
    out = processor_class(**kwargs)(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


@pytest.mark.parametrize("size", [(200, 120), (28, 28), (1000, 300), (50, 900), (1, 1), (640, 481)])
@pytest.mark.parametrize("sizes", [{}, {"min_pixels": 128 * 28 * 28, "max_pixels": 256 * 28 * 28}])
def test_equal_to_transformers(reference, size, sizes):
    image = picture(*size, seed=size[0])
    expected, expected_grid = transformers_output(reference, image, **sizes)
    prepared = Qwen2VLImages().preprocess(image, **sizes)
    assert prepared.grid_thw == expected_grid
    assert prepared.pixel_values.dtype == np.float32
    assert prepared.pixel_values.shape == expected.shape == (np.prod(expected_grid), 3 * 2 * 14 * 14)
    np.testing.assert_allclose(prepared.pixel_values, expected, atol=1e-5, rtol=0)
    assert prepared.num_tokens == np.prod(expected_grid) // 4


def test_processor_built_with_sizes_equals_call_overrides(reference):
    image = picture(333, 222, seed=3)
    expected, grid = transformers_output(reference, image, min_pixels=3136, max_pixels=200704)
    prepared = Qwen2VLImages(min_pixels=3136, max_pixels=200704).preprocess(image)
    assert prepared.grid_thw == grid
    np.testing.assert_allclose(prepared.pixel_values, expected, atol=1e-5, rtol=0)


def test_rgba_and_palette_composited_on_white_like_transformers(reference):
    for image in (picture(90, 70, seed=5, mode="RGBA"), picture(90, 70, seed=6).convert("P")):
        expected, grid = transformers_output(reference, image)
        prepared = Qwen2VLImages().preprocess(image)
        assert prepared.grid_thw == grid
        np.testing.assert_allclose(prepared.pixel_values, expected, atol=1e-5, rtol=0)


def test_200x120_grid_and_tokens():
    prepared = Qwen2VLImages().preprocess(picture(200, 120))
    assert prepared.grid_thw == (1, 8, 14)
    assert prepared.num_tokens == 28
    assert prepared.pixel_values.shape == (112, 1176)


def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    images = Qwen2VLImages()
    for height, width in [(1, 1), (120, 200), (900, 50), (3000, 4000), (10, 1999), (28, 56), (7, 1400)]:
        for low, high in [(56 * 56, 28 * 28 * 1280), (4 * 28 * 28, 16 * 28 * 28)]:
            expected = smart_resize(height, width, factor=28, min_pixels=low, max_pixels=high)
            assert images.smart_resize(height, width, low, high) == expected


def test_aspect_ratio_over_200_refused_like_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    with pytest.raises(ValueError):
        smart_resize(1, 300)
    with pytest.raises(MediaError) as error:
        Qwen2VLImages().preprocess(picture(300, 1))
    assert error.value.reason == "aspect_ratio"
    assert "aspect ratio" in str(error.value)


def test_one_pixel_image_is_upscaled_to_min_pixels():
    # transformers' smart_resize accepts 1x1 (grows it to 56x56), so the frontend does too
    prepared = Qwen2VLImages().preprocess(picture(1, 1))
    assert prepared.grid_thw == (1, 4, 4)
    assert prepared.num_tokens == 4


def test_from_folder_reads_preprocessor_config(tmp_path):
    assert Qwen2VLImages.from_folder(tmp_path) == Qwen2VLImages()
    config = {
        "size": {"longest_edge": 200704, "shortest_edge": 3136},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    images = Qwen2VLImages.from_folder(tmp_path)
    assert (images.min_pixels, images.max_pixels) == (3136, 200704)
    assert images.mean == images.std == (0.5, 0.5, 0.5)
    config["max_pixels"] = 12845056  # Qwen2-VL's own configs: top-level keys win
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    assert Qwen2VLImages.from_folder(tmp_path).max_pixels == 12845056


def test_custom_mean_std_equals_transformers(reference):
    image = picture(100, 100, seed=9)
    out = reference(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])(images=[image], return_tensors="np")
    prepared = Qwen2VLImages(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)).preprocess(image)
    np.testing.assert_allclose(prepared.pixel_values, out["pixel_values"], atol=1e-5, rtol=0)


def test_content_hash_same_picture_any_encoding():
    image = picture(150, 100, seed=1)
    as_png = decode_data_url(data_url(encoded(image, "PNG")), max_bytes=MB)
    as_webp = decode_data_url(data_url(encoded(image, "WEBP", lossless=True), "image/webp"), max_bytes=MB)
    images = Qwen2VLImages()
    # the hash is the contract's VisionItem's, computed from what the item holds
    assert images.preprocess(as_png).item("image").content_hash == images.preprocess(as_webp).item("image").content_hash
    other = images.preprocess(picture(150, 100, seed=2)).item("image").content_hash
    assert other != images.preprocess(as_png).item("image").content_hash


def test_content_hash_depends_on_sizes():
    image = picture(300, 200, seed=1)
    images = Qwen2VLImages()
    smaller = images.preprocess(image, max_pixels=64 * 28 * 28)
    assert images.preprocess(image).item("image").content_hash != smaller.item("image").content_hash


@pytest.mark.parametrize(
    "fmt, mime, save",
    [("PNG", "image/png", {}), ("JPEG", "image/jpeg", {}), ("WEBP", "image/webp", {"lossless": True})],
)
def test_decode_formats(fmt, mime, save):
    image = picture(40, 30, seed=4)
    decoded = decode_data_url(data_url(encoded(image, fmt, **save), mime), max_bytes=MB)
    assert decoded.mode == "RGB" and decoded.size == (40, 30)
    if fmt != "JPEG":
        assert np.array_equal(np.asarray(decoded), np.asarray(image))


def test_decode_gif_first_frame():
    first, second = picture(20, 20, seed=1).convert("P"), picture(20, 20, seed=2).convert("P")
    raw = encoded(first, "GIF", save_all=True, append_images=[second])
    decoded = decode_data_url(data_url(raw, "image/gif"), max_bytes=MB)
    assert decoded.mode == "RGB"
    assert np.array_equal(np.asarray(decoded), np.asarray(first.convert("RGB")))


def test_decode_rgba_composited_on_white():
    transparent = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    decoded = decode_data_url(data_url(encoded(transparent)), max_bytes=MB)
    assert decoded.mode == "RGB"
    assert np.all(np.asarray(decoded) == 255)


def refused(url: str, max_bytes: int = MB, **kwargs) -> MediaError:
    with pytest.raises(MediaError) as error:
        decode_data_url(url, max_bytes=max_bytes, **kwargs)
    assert str(error.value)
    return error.value


def test_refuses_unsupported_mime_type():
    error = refused("data:text/plain;base64," + base64.b64encode(b"hello").decode())
    assert error.reason == "unsupported_type"
    assert "text/plain" in str(error)
    assert refused(data_url(encoded(picture(4, 4), "BMP"), "image/bmp")).reason == "unsupported_type"


def test_refuses_truncated_base64():
    url = data_url(encoded(picture(30, 30)))
    assert refused(url[:-3]).reason == "bad_base64"
    assert refused("data:image/png;base64,@@@@").reason == "bad_base64"
    assert refused("data:image/png," + "abc").reason == "bad_base64"


def test_refuses_truncated_image_data():
    raw = encoded(picture(64, 64, seed=8))
    cut = raw[: len(raw) // 2]
    cut = cut[: len(cut) // 3 * 3]  # valid base64 of an image cut in the middle
    assert refused(data_url(cut)).reason == "not_image"


def test_refuses_png_header_on_garbage():
    raw = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    assert refused(data_url(raw)).reason == "not_image"
    assert refused(data_url(b"just some text", "image/jpeg")).reason == "not_image"


def test_refuses_too_many_bytes():
    raw = encoded(picture(100, 100))
    assert refused(data_url(raw), max_bytes=len(raw) - 1).reason == "too_large"
    assert refused(data_url(raw * 4), max_bytes=len(raw)).reason == "too_large"
    assert decode_data_url(data_url(raw), max_bytes=len(raw)).size == (100, 100)


def test_refuses_decompression_bomb_without_decoding(monkeypatch):
    raw = encoded(Image.new("1", (10000, 10000)))
    assert len(raw) < 100_000

    def no_decoding(self):
        raise AssertionError("the image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    error = refused(data_url(raw))
    assert error.reason == "too_many_pixels"
    assert "10000x10000" in str(error)
    assert refused(data_url(encoded(picture(100, 100))), max_pixels=9999).reason == "too_many_pixels"


def reference_patches(frames: np.ndarray, p: int = 14, m: int = 2, tp: int = 2) -> np.ndarray:
    """Loops over transformers' layout: (t, window row, window col, row, col) x (C, frame, y, x)."""
    count, height, width, _ = frames.shape
    frames = np.concatenate([frames, frames[-1:].repeat(-count % tp, axis=0)])
    rows = []
    for t in range(frames.shape[0] // tp):
        for wy in range(height // p // m):
            for wx in range(width // p // m):
                for my in range(m):
                    for mx in range(m):
                        y, x = (wy * m + my) * p, (wx * m + mx) * p
                        block = frames[t * tp : (t + 1) * tp, y : y + p, x : x + p, :]
                        rows.append(block.transpose(3, 0, 1, 2).reshape(-1))
    return np.stack(rows)


def test_video_frames_pair_into_temporal_patches():
    images = Qwen2VLImages()
    frames = [picture(112, 56, seed=s) for s in range(3)]
    prepared = images.video_frames(frames)
    assert prepared.grid_thw == (2, 4, 8)  # 3 frames padded to 4 by repeating the last
    assert prepared.num_tokens == 16
    stack = np.stack([images._normalized(f, 56, 112) for f in frames])
    np.testing.assert_array_equal(prepared.pixel_values, reference_patches(stack))


def test_one_frame_video_is_the_image():
    images = Qwen2VLImages()
    image = picture(200, 120, seed=7)
    alone = images.preprocess(image)
    for frames in ([image], [image, image]):
        video = images.video_frames(frames)
        assert video.grid_thw == alone.grid_thw
        np.testing.assert_array_equal(video.pixel_values, alone.pixel_values)


def test_video_frames_refused():
    images = Qwen2VLImages()
    with pytest.raises(MediaError) as error:
        images.video_frames([])
    assert error.value.reason == "no_frames"
    with pytest.raises(MediaError) as error:
        images.video_frames([picture(56, 56), picture(60, 56)])
    assert error.value.reason == "frame_sizes"
