"""M-RoPE positions and angles against transformers' Qwen2-VL (get_rope_index and the
rotary embedding) on a tiny config: text, images of different grids and a video, in any
order."""

from __future__ import annotations

import pytest
import torch

from backend.vision.mrope import decode_positions, mrope_cos_sin, mrope_positions, vision_runs

IMAGE, VIDEO, START, END = 250, 251, 248, 249
MERGE = 2


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen2VLConfig, Qwen2VLModel

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3]})  # fmt: skip
    vision = dict(depth=1, embed_dim=32, num_heads=4, hidden_size=64, spatial_merge_size=MERGE)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                           vision_start_token_id=START, vision_end_token_id=END)  # fmt: skip
    return Qwen2VLModel(config).eval()


def _prompt(parts):
    """parts: ints (text tokens) and ("image" | "video", grid); -> (ids, token types, grids in order)."""
    ids, types, grids = [], [], []
    for part in parts:
        if isinstance(part, int):
            ids.append(part)
            types.append(0)
            continue
        kind, grid = part
        n = grid[0] * (grid[1] // MERGE) * (grid[2] // MERGE)
        ids += [START, *([IMAGE if kind == "image" else VIDEO] * n), END]
        types += [0, *([1 if kind == "image" else 2] * n), 0]
        grids.append((kind, grid))
    return ids, types, grids


PROMPTS = [
    [5, 6, ("image", (1, 8, 14)), 7, 8, 9],
    [1, ("image", (1, 4, 6)), 3, ("video", (2, 4, 4)), 4, 4, ("image", (1, 10, 8)), 9],
    [("image", (1, 6, 6)), ("image", (1, 2, 12))],
    [10, 11, 12, 13],
]


@pytest.mark.parametrize("parts", PROMPTS)
def test_positions_and_delta_equal_get_rope_index(hf, parts):
    ids, types, grids = _prompt(parts)
    images = [g for k, g in grids if k == "image"]
    videos = [g for k, g in grids if k == "video"]
    with torch.no_grad():
        theirs, delta = hf.get_rope_index(
            torch.tensor([ids]), torch.tensor([types]),
            torch.tensor(images) if images else None, torch.tensor(videos) if videos else None,
        )  # fmt: skip
    runs = vision_runs(ids, (IMAGE, VIDEO), [g for _, g in grids], MERGE)
    ours, our_delta = mrope_positions(len(ids), runs, MERGE)
    assert torch.equal(ours, theirs[:, 0]) and our_delta == int(delta)
    assert torch.equal(decode_positions(torch.tensor([len(ids), len(ids) + 1]), our_delta)[:, 0],
                       torch.full((3,), len(ids) + our_delta))  # fmt: skip


def test_angles_equal_the_rotary_embedding(hf):
    ids, types, grids = _prompt(PROMPTS[1])
    images = torch.tensor([g for k, g in grids if k == "image"])
    videos = torch.tensor([g for k, g in grids if k == "video"])
    with torch.no_grad():
        positions, _ = hf.get_rope_index(torch.tensor([ids]), torch.tensor([types]), images, videos)
        cos, sin = hf.language_model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    rotary = hf.language_model.rotary_emb
    our_cos, our_sin = mrope_cos_sin(positions[:, 0], rotary.inv_freq, rotary.mrope_section)
    assert torch.allclose(our_cos, cos[0], atol=1e-6) and torch.allclose(our_sin, sin[0], atol=1e-6)


def test_placeholder_runs_must_match_the_grids():
    ids, _, grids = _prompt(PROMPTS[0])
    with pytest.raises(ValueError, match="placeholder"):
        vision_runs(ids, (IMAGE, VIDEO), [(1, 8, 16)], MERGE)  # one token more than the prompt holds
    with pytest.raises(ValueError, match="1 images and videos sent, 0"):
        vision_runs([1, 2, 3], (IMAGE, VIDEO), [(1, 2, 2)], MERGE)
    with pytest.raises(ValueError, match="more placeholder runs"):
        vision_runs(ids, (IMAGE, VIDEO), [], MERGE)


TOKENS_PER_SECOND = 2


@pytest.fixture(scope="module")
def hf25():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3]})  # fmt: skip
    vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=4,
                  spatial_merge_size=MERGE, tokens_per_second=TOKENS_PER_SECOND)  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START, vision_end_token_id=END)  # fmt: skip
    return Qwen2_5_VLModel(config).eval()


def _original_rope_index(hf25, parts, seconds):
    """The prompt's ids by the rule Qwen2.5-VL was released with (transformers 4.49's
    get_rope_index, and vLLM's): each run's ids as transformers lays them out
    (get_vision_position_ids, its time steps included), and the text after a run resuming at
    the run's largest id + 1. transformers 5.24 resumes at start + max(h, w) / merge instead,
    which differs once a video's time ids outgrow its grid's side."""
    pieces, position, seconds = [], 0, iter(seconds)
    for part in parts:
        if isinstance(part, int):
            pieces.append(torch.full((3, 1), position))
            position += 1
            continue
        kind, grid = part
        step = TOKENS_PER_SECOND * next(seconds) if kind == "video" else 1
        run = hf25.get_vision_position_ids(position, torch.tensor(grid), 1, MERGE, step, device="cpu")
        pieces += [torch.full((3, 1), position), run + 1]  # the vision start token, then the run
        position = int(run.max()) + 2
        pieces.append(torch.full((3, 1), position))  # the vision end token
        position += 1
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - positions.shape[1]


@pytest.mark.parametrize("seconds", [[0.5, 1.0], [0.7, 1.3], [2.0, 0.25], [4.0, 3.0]])
def test_video_time_steps_follow_qwen2_5_vl(hf25, seconds):
    """Qwen2.5-VL spaces a video's temporal ids by tokens_per_second * seconds per grid."""
    parts = [1, ("video", (4, 4, 4)), 3, ("image", (1, 4, 6)), 2, ("video", (3, 2, 6)), 7]
    ids, _, grids = _prompt(parts)
    expected, delta = _original_rope_index(hf25, parts, seconds)
    video_seconds = iter(seconds)
    steps = [TOKENS_PER_SECOND * next(video_seconds) if kind == "video" else 1.0 for kind, _ in grids]
    runs = vision_runs(ids, (IMAGE, VIDEO), [g for _, g in grids], MERGE)
    ours, our_delta = mrope_positions(len(ids), runs, MERGE, time_steps=steps)
    assert torch.equal(ours, expected) and our_delta == delta
    assert not torch.equal(ours, mrope_positions(len(ids), runs, MERGE)[0])  # the steps matter here


def test_images_and_short_videos_agree_with_transformers_5(hf25):
    """Where the two rules agree (every image; a video whose time ids stay within its side),
    ours equals transformers 5.24's get_rope_index too."""
    parts = [1, ("image", (1, 4, 6)), 3, ("video", (2, 6, 6)), 2]
    ids, types, grids = _prompt(parts)
    with torch.no_grad():
        theirs, delta = hf25.get_rope_index(
            torch.tensor([ids]), torch.tensor([types]), torch.tensor([grids[0][1]]), torch.tensor([grids[1][1]]),
            second_per_grid_ts=torch.tensor([0.5]),
        )  # fmt: skip
    runs = vision_runs(ids, (IMAGE, VIDEO), [g for _, g in grids], MERGE)
    ours, our_delta = mrope_positions(len(ids), runs, MERGE, time_steps=[1.0, TOKENS_PER_SECOND * 0.5])
    assert torch.equal(ours, theirs[:, 0]) and our_delta == int(delta)


def test_time_steps_must_match_the_runs():
    runs = vision_runs([START, IMAGE, END], (IMAGE, VIDEO), [(1, 2, 2)], MERGE)
    with pytest.raises(ValueError, match="time steps"):
        mrope_positions(3, runs, MERGE, time_steps=[1.0, 2.0])
