"""The vision field on the wire: VisionItems out as four named tensors and back, their content
hashes computed from what they hold, and every malformed combination refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from backend.contract import ContractError, GenerationRequest, ModelInfo, apply_inputs, decode_request, encode_request
from backend.contract.vision import VisionInfo, VisionItem

RNG = np.random.default_rng(0)


def item(kind="image", grid=(1, 4, 6), seconds=0.0, pixels=None) -> VisionItem:
    t, h, w = grid
    values = RNG.standard_normal((t * h * w, 1176)).astype(np.float32) if pixels is None else pixels
    return VisionItem(kind, grid, values, seconds)


def test_items_round_trip_in_order():
    items = (item(), item("video", (2, 4, 4), 1.0), item(grid=(1, 2, 2)))
    request = GenerationRequest([1, 2, 3], vision=items)
    arrays = encode_request(request)
    assert arrays["vision_pixels"].shape == (24 + 32 + 4, 1176)
    assert arrays["vision_grids"].tolist() == [[1, 4, 6], [2, 4, 4], [1, 2, 2]]
    back = decode_request(arrays).vision
    assert [(b.kind, b.grid, b.seconds_per_grid) for b in back] == [(i.kind, i.grid, i.seconds_per_grid) for i in items]
    for b, i in zip(back, items, strict=True):
        assert np.array_equal(b.pixels, i.pixels) and b.content_hash == i.content_hash


def test_a_request_without_media_sends_no_vision_tensors():
    assert not any(name.startswith("vision_") for name in encode_request(GenerationRequest([1])))


def test_the_hash_is_the_content():
    pixels = RNG.standard_normal((24, 1176)).astype(np.float32)
    same = item(pixels=pixels.copy())
    assert item(pixels=pixels).content_hash == same.content_hash
    changed = pixels.copy()
    changed[3, 7] += 1e-3
    assert item(pixels=changed).content_hash != same.content_hash
    assert item("video", pixels=pixels).content_hash != same.content_hash  # another placeholder, another item
    assert item(grid=(1, 6, 4), pixels=pixels).content_hash != same.content_hash  # the same numbers, another shape


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (item("audio"), "vision_kinds"),
        (VisionItem("image", (1, 4, 6), np.zeros((23, 1176), np.float32)), "vision_pixels"),
        (VisionItem("image", (1, 4, 6), np.full((24, 1176), np.nan, np.float32)), "vision_pixels"),
        (item(seconds=1.0), "vision_seconds"),
        (item("video", seconds=-1.0), "vision_seconds"),
    ],
)
def test_a_bad_item_is_refused_by_name(bad, field):
    with pytest.raises(ContractError) as info:
        GenerationRequest([1], vision=(bad,)).validate()
    assert info.value.field == field


def test_tensors_that_disagree_are_refused_by_name():
    arrays = encode_request(GenerationRequest([1], vision=(item(), item())))
    cases = {
        "vision_grids": {**arrays, "vision_grids": arrays["vision_grids"][:1]},
        "vision_pixels": {**arrays, "vision_pixels": arrays["vision_pixels"][:-1]},
        "vision_seconds": {**arrays, "vision_seconds": arrays["vision_seconds"][:1]},
        "vision_kinds": {name: value for name, value in arrays.items() if name != "vision_pixels"},
    }
    for field, broken in cases.items():
        with pytest.raises(ContractError) as info:
            decode_request(broken)
        assert info.value.field == field


def test_vision_tensors_are_not_extension_fields():
    with pytest.raises(ContractError) as info:
        apply_inputs(GenerationRequest([1]), {"vision_pixels": [[0.0]]})
    assert info.value.field == "vision_pixels"


def test_model_info_carries_the_vision_facts():
    vision = VisionInfo("qwen2_vl", image_token_id=7, video_token_id=8, vision_start_token_id=5, vision_end_token_id=6)
    info = ModelInfo.decode(ModelInfo(100, 10, vision=vision).encode())
    assert info.vision == vision and info.takes_vision and vision.patch_dim == 1176
    assert not ModelInfo.decode(ModelInfo(100, 10).encode()).takes_vision
