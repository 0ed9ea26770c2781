"""Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration on the tiny random build
(tests/helpers/vlm_models.py): our vision tower (backend/runner/models/qwen2_5_vl_vision.py:
window attention, full attention in block 1) for images of different sizes and a video; and
the whole model's prompt logits and greedy decoding with images and a video whose temporal
ids are spaced by tokens_per_second * seconds per grid (backend/vision/mrope.py)."""

from __future__ import annotations

import pytest
import torch

from backend.runner.loader import load_model
from backend.runner.models.qwen2_5_vl_vision import Qwen2_5VisionConfig, Qwen2_5VisionEncoder, window_order
from tests.backend.runner.test_qwen2_vl_lm import CPU, NEW_TOKENS, OurRun, expand, hf_inputs, images, video
from tests.helpers.vlm_models import write_tiny_qwen2_5_vl

SECONDS_PER_GRID = 0.75  # with 2 tokens per second: temporal ids 0, 1 (floor 1.5), 3, ...


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "tiny")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(folder):
    return load_model(folder, torch.float32, CPU)


def test_the_config_and_the_vision_tower_load(folder, ours):
    cfg, vision = ours.config, Qwen2_5VisionConfig.load(folder)
    assert cfg.architecture == "Qwen2_5_VLForConditionalGeneration" and cfg.mrope_section == (2, 3, 3)
    assert (cfg.vision.family, cfg.vision.tokens_per_second, cfg.vision.image_token_id) == ("qwen2_5_vl", 2.0, 250)
    assert isinstance(ours.visual, Qwen2_5VisionEncoder) and ours.visual.cfg == vision
    assert (vision.embed_dim, vision.hidden_size, vision.intermediate_size) == (32, 64, 64)
    assert (vision.window_side, vision.fullatt_block_indexes, vision.head_dim) == (2, (1,), 8)


def test_window_order_groups_merged_tokens_by_window():
    # one frame of 3 x 3 merged tokens (6 x 6 patches), windows of 2 x 2 merged tokens
    order, lengths = window_order([(1, 6, 6)], merge=2, side=2)
    assert order.tolist() == [0, 1, 3, 4, 2, 5, 6, 7, 8]
    assert lengths == [16, 8, 8, 4]  # patches per window: 4 merged tokens, 2, 2, 1
    order, lengths = window_order([(2, 4, 4), (1, 2, 2)], merge=2, side=2)
    assert order.tolist() == list(range(9)) and lengths == [16, 16, 4]


def _theirs(hf, pixel_values, grids):
    with torch.inference_mode():
        return hf.model.visual(pixel_values, grid_thw=torch.tensor(grids)).pooler_output


def test_the_vision_tower_equals_transformers_on_two_images(folder, hf, ours):
    a, b = images(folder, [(200, 120), (150, 150)])  # grids (1, 8, 14) and (1, 10, 10): partial windows
    pixels, grids = torch.cat([a.pixels, b.pixels]), [a.grid, b.grid]
    theirs = _theirs(hf, pixels, grids)
    mine = ours.visual(pixels, grids)
    assert mine.shape == (28 + 25, 64) and theirs.abs().mean() > 1e-2
    assert (mine - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("grids", [[(2, 6, 10)], [(1, 4, 4), (2, 8, 8), (1, 2, 6)]], ids=["video", "mixed"])
def test_the_vision_tower_equals_transformers_on_random_patches(hf, ours, grids):
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1176, generator=torch.Generator().manual_seed(3))
    assert (ours.visual(pixels, grids) - _theirs(hf, pixels, grids)).abs().max().item() <= 1e-4


def prompts(folder) -> dict[str, list]:
    a, b = images(folder, [(200, 120), (60, 90)])
    clip = video(folder, 112, 84, frames=6)  # grid t = 3: temporal ids 0, 1, 3 apart
    return {
        "one-image": [5, 6, a, 7, 8, 9],
        "two-images": [3, a, 4, 5, b, 6],
        "video-and-image": [4, clip, 5, b, 6, 7],
    }


def _time_steps(ours, media) -> list[float]:
    tokens_per_second = ours.config.vision.tokens_per_second
    return [tokens_per_second * SECONDS_PER_GRID if m.kind == "video" else 1.0 for m in media]


def _hf_inputs(tokens, types, media) -> dict:
    kwargs = hf_inputs(tokens, types, media)
    videos = [m for m in media if m.kind == "video"]
    if videos:
        kwargs["second_per_grid_ts"] = torch.tensor([SECONDS_PER_GRID] * len(videos))
    return kwargs


@pytest.mark.parametrize("name", ["one-image", "two-images", "video-and-image"])
def test_prompt_logits_equal_transformers(folder, hf, ours, name):
    tokens, types, media = expand(folder, prompts(folder)[name])
    hf.model.rope_deltas = None
    with torch.inference_mode():
        expected = hf(**_hf_inputs(tokens, types, media)).logits[0]
    got = OurRun(ours, tokens, media, _time_steps(ours, media)).prefill()
    assert expected.abs().max() > 0.1
    assert (got - expected).abs().max().item() <= 1e-4


def test_greedy_decoding_equals_transformers_generate(folder, hf, ours):
    tokens, types, media = expand(folder, prompts(folder)["video-and-image"])
    hf.model.rope_deltas = None
    with torch.inference_mode():
        out = hf.generate(**_hf_inputs(tokens, types, media), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    run = OurRun(ours, tokens, media, _time_steps(ours, media))
    got, logits = run.greedy(NEW_TOKENS)
    assert got == out.sequences[0, len(tokens) :].tolist()
    assert max((a - b[0]).abs().max().item() for a, b in zip(logits, out.logits, strict=True)) <= 1e-4
