"""Our engine on a tiny random Qwen2-VL (tests/helpers/vlm_models.py) against transformers'
`Qwen2VLForConditionalGeneration.generate` on the same weights: greedy tokens equal for
prompts with no image, one, three of different sizes with text between them, a short video,
and a batch mixing text and image requests; chunked prefill splitting images across steps
and the encoder budget; the prefix cache knowing the pixels; and what the engine refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.contract import ContractError, GenerationRequest, SamplingParams
from backend.contract.vision import VisionItem
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.vlm_models import vision_token_ids, write_tiny_qwen2_5_vl, write_tiny_qwen2_vl

MAX_TOKENS = 8
MERGE = 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl", seed=3)


@pytest.fixture(scope="module")
def ids(folder):
    return vision_token_ids(folder)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def make_engine(folder, **overrides) -> LLMEngine:
    config = EngineConfig(str(folder), dtype="float32", device="cpu", num_blocks=256, max_num_batched_tokens=64,
                          speculative="off", max_loras=0)  # fmt: skip
    for name, value in overrides.items():
        setattr(config, name, value)
    return LLMEngine(config)


@pytest.fixture(scope="module")
def engine(folder):
    return make_engine(folder)


SECONDS_PER_GRID = 4.0  # a video's seconds per temporal patch (Qwen2.5-VL's time ids, 2 per second: 0, 8, 16)


def item(kind: str, grid: tuple[int, int, int], seed: int) -> VisionItem:
    t, h, w = grid
    pixels = np.random.default_rng(seed).standard_normal((t * h * w, 1176)).astype(np.float32)
    return VisionItem(kind, grid, pixels, SECONDS_PER_GRID if kind == "video" else 0.0)


def prompt_of(parts, ids) -> tuple[list[int], tuple[VisionItem, ...]]:
    """Text token lists and items, in order -> (the prompt with placeholders, the items)."""
    prompt, items = [], []
    for part in parts:
        if isinstance(part, VisionItem):
            pad = ids["image_token_id"] if part.kind == "image" else ids["video_token_id"]
            prompt += [ids["vision_start_token_id"], *[pad] * part.num_tokens(MERGE), ids["vision_end_token_id"]]
            items.append(part)
        else:
            prompt += part
    return prompt, tuple(items)


def hf_generate(hf, prompt, items, ids, with_logprobs: bool = False):
    kwargs, types = {}, [0] * len(prompt)
    for kind, code in (("image", 1), ("video", 2)):
        chosen = [i for i in items if i.kind == kind]
        if chosen:
            key = "pixel_values" if kind == "image" else "pixel_values_videos"
            kwargs[key] = torch.from_numpy(np.concatenate([i.pixels for i in chosen]))
            kwargs[f"{kind}_grid_thw"] = torch.tensor([list(i.grid) for i in chosen])
            if kind == "video" and hf.config.model_type == "qwen2_5_vl":
                kwargs["second_per_grid_ts"] = torch.tensor([i.seconds_per_grid for i in chosen])
            pad = ids[f"{kind}_token_id"]
            types = [code if t == pad else ty for t, ty in zip(prompt, types, strict=True)]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), mm_token_type_ids=torch.tensor([types]), max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, **kwargs)  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    if not with_logprobs:
        return tokens
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def request(prompt, items) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return GenerationRequest(prompt, sampling, vision=items)


CASES = {
    "text-only": [[5, 6, 7, 8, 9, 10]],
    "one-image": [[5, 6], ("image", (1, 8, 14), 1), [7, 8, 9]],
    "three-images": [
        [3],
        ("image", (1, 4, 6), 2),
        [4, 5],
        ("image", (1, 10, 8), 3),
        [6],
        ("image", (1, 6, 6), 4),
        [7, 8],
    ],  # fmt: skip
    "video": [[11, 12], ("video", (2, 4, 6), 5), [13, 14, 15]],
    "image-and-video": [("image", (1, 4, 4), 6), [9], ("video", (2, 6, 4), 7), [10]],
}


def parts_of(case):
    return [item(*p) if isinstance(p, tuple) else p for p in CASES[case]]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(engine, hf, ids, case):
    prompt, items = prompt_of(parts_of(case), ids)
    tokens, finals = run_to_completion(engine, {case: request(prompt, items)})
    assert tokens[case] == hf_generate(hf, prompt, items, ids)
    assert finals[case].num_prompt_tokens == len(prompt)


def test_a_batch_of_text_and_image_requests_gives_each_its_solo_tokens(folder, hf, ids):
    engine = make_engine(folder, max_num_batched_tokens=48)  # images split across chunks and steps
    requests, expected = {}, {}
    for case in CASES:
        prompt, items = prompt_of(parts_of(case), ids)
        requests[case], expected[case] = request(prompt, items), hf_generate(hf, prompt, items, ids)
    tokens, _ = run_to_completion(engine, requests)
    assert tokens == expected


def test_a_small_encoder_budget_still_runs_every_image(folder, hf, ids):
    """MAX_NUM_BATCHED_TOKENS below an image's tokens: the image runs alone in its step."""
    engine = make_engine(folder, max_num_batched_tokens=16, encoder_cache_tokens=32)
    prompt, items = prompt_of(parts_of("three-images"), ids)
    tokens, _ = run_to_completion(engine, {"r": request(prompt, items)})
    assert tokens["r"] == hf_generate(hf, prompt, items, ids)


def test_the_prefix_cache_knows_the_pixels(folder, ids):
    engine = make_engine(folder, block_size=16)
    picture, other = item("image", (1, 12, 12), 8), item("image", (1, 12, 12), 9)  # 36 tokens each
    text = [[5] * 20, None, [6] * 40]
    prompt, items = prompt_of([text[0], picture, text[2]], ids)
    _, first = run_to_completion(engine, {"a": request(prompt, items)})
    _, same = run_to_completion(engine, {"b": request(prompt, items)})
    other_prompt, other_items = prompt_of([text[0], other, text[2]], ids)
    _, different = run_to_completion(engine, {"c": request(other_prompt, other_items)})
    assert first["a"].num_cached_tokens == 0
    image_end = 20 + 1 + 36
    assert same["b"].num_cached_tokens >= image_end  # the image's blocks hit the cache
    assert different["c"].num_cached_tokens == 16  # only the block before the image's first one


def test_the_encoder_cache_spares_a_second_encode(folder, ids):
    engine = make_engine(folder, enable_prefix_caching=False)
    prompt, items = prompt_of([[5, 6], item("image", (1, 8, 8), 10), [7]], ids)
    run_to_completion(engine, {"a": request(prompt, items)})
    cache = engine.runner.encoder_cache
    misses = cache.misses
    run_to_completion(engine, {"b": request(prompt, items)})
    assert cache.misses == misses and cache.hits >= 1


def test_mismatched_placeholders_and_text_models_are_refused(engine, ids, folder):
    prompt, items = prompt_of([[5], item("image", (1, 4, 4), 11), [6]], ids)
    with pytest.raises(ContractError) as info:
        engine.add_request("short", request(prompt[:-3] + [6, 6], items))
    assert info.value.field == "prompt_tokens"
    with pytest.raises(ContractError) as info:
        engine.add_request("none", request(prompt, ()))
    assert info.value.field == "prompt_tokens"
    assert not engine.has_unfinished_requests()


def test_model_info_names_the_vision_tokens(engine, ids):
    vision = engine.model_info().vision
    assert vision is not None and vision.image_token_id == ids["image_token_id"]
    assert (vision.merge_size, vision.patch_size, vision.temporal_patch_size) == (2, 14, 2)


def hf_greedy_at(hf, prompt, items, ids, positions, delta):
    """Greedy tokens and their logprobs by transformers' forward over the whole sequence each
    step, at the M-RoPE ids given (the prompt's, then p + delta): the released rule, where
    transformers 5.24's get_rope_index differs (tests/backend/vision/test_mrope.py)."""
    kwargs = {}
    for kind in ("image", "video"):
        chosen = [i for i in items if i.kind == kind]
        if chosen:
            key = "pixel_values" if kind == "image" else "pixel_values_videos"
            kwargs[key] = torch.from_numpy(np.concatenate([i.pixels for i in chosen]))
            kwargs[f"{kind}_grid_thw"] = torch.tensor([list(i.grid) for i in chosen])
    tokens, logprobs = [], []
    for _ in range(MAX_TOKENS):
        length = len(prompt) + len(tokens)
        past = torch.arange(len(prompt), length) + delta
        at = torch.cat((positions, past.expand(3, -1)), dim=1)[:, None, :]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + tokens]), position_ids=at, **kwargs).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(torch.log_softmax(logits.float(), -1)[token].item())
    return tokens, logprobs


def released_positions(hf, prompt, items, ids) -> tuple[torch.Tensor, int]:
    """The prompt's M-RoPE ids by Qwen2.5-VL's released rule (as in tests/backend/vision/
    test_mrope.py): transformers lays out each run (get_vision_position_ids, time steps
    included), and the text after a run resumes at its largest id + 1."""
    per_second = hf.config.vision_config.tokens_per_second
    pieces, position, at, runs = [], 0, 0, iter(items)
    pads = (ids["image_token_id"], ids["video_token_id"])
    while at < len(prompt):
        if prompt[at] not in pads:
            pieces.append(torch.full((3, 1), position))
            position, at = position + 1, at + 1
            continue
        run = next(runs)
        step = per_second * run.seconds_per_grid if run.kind == "video" else 1
        ids_ = hf.model.get_vision_position_ids(position, torch.tensor(run.grid), 1, MERGE, step, device="cpu")
        pieces.append(ids_)
        position, at = int(ids_.max()) + 1, at + run.num_tokens(MERGE)
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - len(prompt)


def test_qwen2_5_vl_with_a_timed_video_equals_transformers(tmp_path_factory):
    """Qwen2.5-VL: window attention in the tower, and a video's temporal ids spaced by its time."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vlm25") / "tiny-qwen2.5-vl", seed=4)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    ids, engine = vision_token_ids(folder), make_engine(folder)
    parts = [[3, 4], item("video", (3, 4, 6), 12), [5], item("image", (1, 8, 10), 13), [6, 7]]
    prompt, items = prompt_of(parts, ids)
    asked = request(prompt, items)
    asked.sampling.logprobs = True
    engine.add_request("r", asked)
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
    positions, delta = released_positions(hf, prompt, items, ids)
    expected_tokens, expected_logprobs = hf_greedy_at(hf, prompt, items, ids, positions, delta)
    assert tokens == expected_tokens
    assert np.allclose(logprobs, expected_logprobs, atol=1e-4)


def test_beam_search_with_an_image_equals_transformers(engine, hf, ids):
    """A beam request's rows share the prompt's images (computed once, by the lead) and decode
    at the prompt's M-RoPE delta."""
    from tests.helpers.beams import beam_request, generate_beams, run_outputs

    picture = item("image", (1, 8, 10), 14)
    prompt, items = prompt_of([[5, 6], picture, [7, 8]], ids)
    asked = beam_request(prompt, 3, 2, 6, 1.0, "false")
    asked.vision = items
    out = run_outputs(engine, {"beams": asked})["beams"]
    ours = [(h.token_ids, h.score) for h in out.hypotheses]
    media = {"pixel_values": torch.from_numpy(picture.pixels), "image_grid_thw": torch.tensor([list(picture.grid)])}
    types = torch.tensor([[1 if t == ids["image_token_id"] else 0 for t in prompt]])
    theirs = generate_beams(hf, prompt, 3, 2, 6, 1.0, False, hf.config.eos_token_id, mm_token_type_ids=types, **media)
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]
    assert np.allclose([s for _, s in ours], [s for _, s in theirs], atol=1e-4)
