"""Our Qwen2-VL vision encoder against transformers' vision tower on a tiny random Qwen2-VL
(tests/helpers/vlm_models.py): one image, two images of different sizes in one call, a
two-frame video, and a real PIL image through Qwen2-VL's PIL image processor."""

from __future__ import annotations

import pytest
import torch

from backend.runner.models.qwen2_vl_vision import Qwen2VisionConfig, Qwen2VisionEncoder, patch_positions
from tests.helpers.vlm_models import write_tiny_qwen2_vl


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl") / "tiny")


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(folder):
    return Qwen2VisionEncoder.load(folder)


def _theirs(reference, pixel_values, grids):
    with torch.inference_mode():
        out = reference.model.visual(pixel_values, grid_thw=torch.tensor(grids))
    return out.pooler_output


def _random_pixels(cfg: Qwen2VisionConfig, grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, cfg.patch_dim, generator=torch.Generator().manual_seed(seed))


def test_config_reads_the_vision_config(folder):
    cfg = Qwen2VisionConfig.load(folder)
    assert (cfg.depth, cfg.embed_dim, cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (2, 32, 64, 4, 8)
    assert cfg.patch_dim == 3 * 2 * 14 * 14 and cfg.rope_theta == 10000.0 and cfg.hidden_act == "quick_gelu"
    assert cfg.num_tokens((1, 8, 14)) == 28 and cfg.num_tokens((2, 4, 4)) == 8


def test_patch_positions_follow_merge_windows():
    rows_cols = patch_positions([(1, 2, 4)], 2).tolist()
    assert rows_cols == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]


@pytest.mark.parametrize(
    "grids",
    [[(1, 8, 14)], [(1, 4, 6), (1, 10, 8)], [(2, 4, 4)], [(2, 4, 4), (1, 6, 4)]],
    ids=["one-image", "two-images", "video", "video-and-image"],
)
def test_the_encoder_equals_transformers(reference, ours, grids):
    pixel_values = _random_pixels(ours.cfg, grids)
    theirs = _theirs(reference, pixel_values, grids)
    mine = ours(pixel_values, grids)
    assert mine.shape == (sum(ours.cfg.num_tokens(g) for g in grids), 64)
    assert theirs.abs().mean() > 1e-2 and torch.isfinite(mine).all()  # not vanishing activations
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_two_images_in_one_call_equal_each_alone(ours):
    grids = [(1, 4, 6), (1, 10, 8)]
    pixel_values = _random_pixels(ours.cfg, grids, seed=1)
    together = ours(pixel_values, grids)
    first, second = ours(pixel_values[:24], grids[:1]), ours(pixel_values[24:], grids[1:])
    torch.testing.assert_close(together, torch.cat([first, second]), atol=1e-6, rtol=1e-6)


def test_a_pil_image_through_the_image_processor(folder, reference, ours):
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    gradient = torch.linspace(0, 255, 200).view(1, 200, 1).expand(120, 200, 3).clone()
    gradient[..., 1] = torch.linspace(255, 0, 120).view(120, 1)
    image = Image.fromarray(gradient.to(torch.uint8).numpy(), "RGB")  # 200 wide, 120 high
    processed = Qwen2VLImageProcessorPil.from_pretrained(folder)(images=[image], return_tensors="pt")
    grids = [tuple(g) for g in processed["image_grid_thw"].tolist()]
    assert grids == [(1, 8, 14)]
    pixel_values = processed["pixel_values"]
    torch.testing.assert_close(ours(pixel_values, grids), _theirs(reference, pixel_values, grids), atol=1e-5, rtol=1e-5)


def test_wrong_pixel_shape_is_refused(ours):
    with pytest.raises(ValueError, match="do not match"):
        ours(torch.zeros(10, ours.cfg.patch_dim), [(1, 4, 4)])
