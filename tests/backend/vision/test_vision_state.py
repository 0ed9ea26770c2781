"""A vision request's engine state on its own: the prompt checked against its items, the block
keys that make the prefix cache know the pixels, the positions past the prompt, the encoder
budget's cut of a chunk, and the encoder cache's bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.contract import ContractError
from backend.contract.vision import VisionInfo, VisionItem
from backend.vision.encoder_cache import EncoderCache
from backend.vision.mrope import VisionRun, mrope_positions
from backend.vision.state import VisionState

INFO = VisionInfo("qwen2_vl", image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
IMG, VID = INFO.image_token_id, INFO.video_token_id


def item(kind="image", grid=(1, 4, 4), seed=0) -> VisionItem:
    t, h, w = grid
    pixels = np.random.default_rng(seed).standard_normal((t * h * w, INFO.patch_dim)).astype(np.float32)
    return VisionItem(kind, grid, pixels, 1.0 if kind == "video" else 0.0)


def prompt_with(*parts) -> list[int]:
    """Text ids and items: each item becomes start, its placeholders, end."""
    out = []
    for part in parts:
        if isinstance(part, VisionItem):
            out += [INFO.vision_start_token_id, *[INFO.placeholder_id(part.kind)] * part.num_tokens(2)]
            out.append(INFO.vision_end_token_id)
        else:
            out += list(part)
    return out


def test_positions_and_runs_follow_mrope():
    a, v = item(grid=(1, 4, 6)), item("video", (2, 4, 4), seed=1)
    prompt = prompt_with([1, 2, 3], a, [4, 5], v, [6])
    state = VisionState.of(prompt, (a, v), INFO)
    assert [(p.start, p.end) for p in state.placed] == [(4, 10), (14, 22)]
    expected, delta = mrope_positions(len(prompt), [VisionRun(4, a.grid), VisionRun(14, v.grid)], 2)
    assert torch.equal(state.positions, expected) and state.delta == delta
    past = state.positions_of(len(prompt) - 2, len(prompt) + 3)  # the prompt's last two, then three generated
    assert past[:, :2].tolist() == expected[:, -2:].tolist()
    assert past[0, 2:].tolist() == [len(prompt) + i + delta for i in range(3)]


@pytest.mark.parametrize(
    ("prompt", "items", "field"),
    [
        (prompt_with([1], item()), (), "prompt_tokens"),  # placeholders, no image
        ([1, 2, 3], (item(),), "prompt_tokens"),  # an image, no placeholders
        (prompt_with([1], item())[:-3] + [5, 6, 7], (item(),), "prompt_tokens"),  # too few placeholders
        (prompt_with([1], item("video", (2, 4, 4))), (item("image", (2, 4, 4)),), "prompt_tokens"),  # wrong kind
        ([1, IMG, IMG, IMG], (item(grid=(1, 3, 4)),), "vision_grids"),  # h not a multiple of the merge
    ],
)
def test_a_prompt_that_does_not_match_its_items_is_refused(prompt, items, field):
    with pytest.raises(ContractError) as info:
        VisionState.of(prompt, items, INFO)
    assert info.value.field == field


def test_wrong_patch_width_is_refused():
    bad = VisionItem("image", (1, 2, 2), np.zeros((4, 100), np.float32))
    with pytest.raises(ContractError) as info:
        VisionState.of([1, IMG], (bad,), INFO)
    assert info.value.field == "vision_pixels"


def test_block_keys_name_the_items_a_block_holds():
    a, b = item(seed=1), item(seed=2)
    state = VisionState.of(prompt_with([1] * 6, a, [2] * 3, b), (a, b), INFO)  # a at 7..10, b at 16..19
    assert state.block_keys(0, 4) == b""
    assert state.block_keys(4, 8) == bytes.fromhex(a.content_hash)
    assert state.block_keys(8, 16) == bytes.fromhex(a.content_hash)
    assert state.block_keys(8, 17) == bytes.fromhex(a.content_hash) + bytes.fromhex(b.content_hash)
    assert state.block_keys(20, 24) == b""


def test_the_encoder_budget_cuts_a_chunk_before_an_item_it_cannot_pay_for():
    a, b = item(grid=(1, 4, 4), seed=1), item(grid=(1, 8, 8), seed=2)  # 4 and 16 tokens
    state = VisionState.of(prompt_with([1] * 5, a, [2] * 5, b, [3]), (a, b), INFO)  # a at 6, b at 17
    never = lambda _: False  # noqa: E731
    assert state.fit_chunk(0, 40, 100, True, 2, never) == (40, 20)
    assert state.fit_chunk(0, 40, 10, True, 2, never) == (17, 4)  # b waits for a step with budget
    assert state.fit_chunk(17, 20, 10, True, 2, never) == (20, 16)  # first in a fresh step: it runs
    assert state.fit_chunk(17, 20, 10, False, 2, never) == (0, 0)  # the step's encoder is spent
    assert state.fit_chunk(0, 40, 0, False, 2, lambda h: True) == (40, 0)  # cached items cost nothing
    assert state.fit_chunk(0, 6, 0, False, 2, never) == (6, 0)  # text before any item


def test_the_encoder_cache_is_bounded_by_tokens_least_recent_out():
    cache = EncoderCache(max_tokens=10)
    cache.put("a", torch.zeros(4, 2))
    cache.put("b", torch.zeros(4, 2))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", torch.zeros(4, 2))
    assert "b" not in cache and "a" in cache and "c" in cache and cache.num_tokens == 8
    cache.put("huge", torch.zeros(30, 2))  # larger than the bound: kept alone
    assert list(cache._entries) == ["huge"] and cache.num_tokens == 30
    assert (cache.hits, cache.misses) == (1, 0)
