"""Our Qwen2-VL language model (backend/runner/models/llama.py with M-RoPE, loaded by
backend/runner/loader.py with its vision tower in `model.visual`) against transformers'
Qwen2VLForConditionalGeneration on the tiny random build (tests/helpers/vlm_models.py):
prompt logits with 0, 1 and 3 images of different sizes and with a 4-frame video, through the
paged KV cache; then greedy decoding, whose positions continue from the prompt's delta.

The helpers below (media, prompt expansion, our prefill and decode) serve
tests/backend/runner/test_qwen2_5_vl.py too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from backend.runner.drafters import allocate_kv
from backend.runner.forward_batch import Span, build_forward_batch
from backend.runner.loader import load_model
from backend.runner.models.llama import LlamaForCausalLM
from backend.vision.mrope import decode_positions, mrope_positions, vision_runs
from tests.helpers.vlm_models import vision_token_ids, write_tiny_qwen2_vl

CPU = torch.device("cpu")
BLOCK_SIZE = 16
NEW_TOKENS = 8


@dataclass
class Media:
    """One image or video, preprocessed: its pixel rows and grid."""

    kind: str  # "image" | "video"
    pixels: torch.Tensor  # [t*h*w, patch_dim] float32
    grid: tuple[int, int, int]


def picture(width: int, height: int, seed: int):
    """A PIL image: smooth colour ramps plus noise, so patches differ."""
    from PIL import Image

    gen = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    ramp[..., 1] = np.linspace(255, 0, height)[:, None]
    pixels = np.clip(ramp + gen.normal(0, 30, ramp.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def images(folder, sizes: list[tuple[int, int]]) -> list[Media]:
    """Pictures of these (width, height) through transformers' Qwen2-VL PIL image processor."""
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    out = processor(images=[picture(w, h, i) for i, (w, h) in enumerate(sizes)], return_tensors="pt")
    grids = [tuple(g) for g in out["image_grid_thw"].tolist()]
    rows = out["pixel_values"].split([t * h * w for t, h, w in grids])
    return [Media("image", r, g) for r, g in zip(rows, grids, strict=True)]


def video(folder, width: int, height: int, frames: int) -> Media:
    """A short video through our frontend's preprocessing (openai_frontend/media/images.py)."""
    from openai_frontend.media.images import Qwen2VLImages

    clip = [picture(width, height, 100 + i) for i in range(frames)]
    prepared = Qwen2VLImages.from_folder(folder).video_frames(clip)
    return Media("video", torch.from_numpy(prepared.pixel_values), prepared.grid_thw)


def expand(folder, parts: list, merge: int = 2) -> tuple[list[int], list[int], list[Media]]:
    """parts: ints (text tokens) and Media -> (prompt ids with each medium's placeholders
    expanded to vision_start, N x pad, vision_end; mm_token_type_ids; the media in order)."""
    ids = vision_token_ids(folder)
    tokens, types, media = [], [], []
    for part in parts:
        if isinstance(part, int):
            tokens.append(part)
            types.append(0)
            continue
        t, h, w = part.grid
        pad, kind = (ids["image_token_id"], 1) if part.kind == "image" else (ids["video_token_id"], 2)
        count = t * (h // merge) * (w // merge)
        tokens += [ids["vision_start_token_id"], *[pad] * count, ids["vision_end_token_id"]]
        types += [0, *[kind] * count, 0]
        media.append(part)
    return tokens, types, media


def hf_inputs(tokens: list[int], types: list[int], media: list[Media]) -> dict:
    """transformers' forward / generate kwargs for this prompt."""
    kwargs = {"input_ids": torch.tensor([tokens]), "mm_token_type_ids": torch.tensor([types])}
    for kind, pixels_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                       ("video", "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        chosen = [m for m in media if m.kind == kind]
        if chosen:
            kwargs[pixels_key] = torch.cat([m.pixels for m in chosen])
            kwargs[grid_key] = torch.tensor([m.grid for m in chosen])
    return kwargs


class OurRun:
    """One sequence through our model and a paged KV cache: prefill the whole prompt (its
    vision embeddings from `model.visual`), then decode a token at a time."""

    def __init__(self, model: LlamaForCausalLM, tokens: list[int], media: list[Media], time_steps=None):
        cfg = model.config
        self.model, self.tokens = model, list(tokens)
        self.kv = allocate_kv(cfg, cfg.num_layers, 64, BLOCK_SIZE, torch.float32, CPU)
        self.table = list(range(-(-(len(tokens) + NEW_TOKENS + 1) // BLOCK_SIZE)))
        vision = cfg.vision
        runs = vision_runs(tokens, (vision.image_token_id, vision.video_token_id), [m.grid for m in media], 2)
        self.positions, self.delta = mrope_positions(len(tokens), runs, vision.merge_size, time_steps)
        self.media = media

    def prefill(self) -> torch.Tensor:
        """Logits [len(prompt), vocab] of every prompt token."""
        batch = build_forward_batch([Span(self.tokens, 0, self.table, len(self.tokens))], BLOCK_SIZE, CPU)
        if self.media:  # a text-only prompt keeps 1-D `positions` (the model expands them)
            batch.mrope_positions = self.positions
            pad = {self.model.config.vision.image_token_id, self.model.config.vision.video_token_id}
            batch.embeds_rows = torch.tensor([i for i, t in enumerate(self.tokens) if t in pad])
            batch.embeds = self.model.visual(torch.cat([m.pixels for m in self.media]), [m.grid for m in self.media])
        hidden = self.model(batch, self.kv)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def decode(self, token: int) -> torch.Tensor:
        """Logits [vocab] after appending `token`, at its 1-D position shifted by the delta."""
        start = len(self.tokens)
        self.tokens.append(token)
        batch = build_forward_batch([Span([token], start, self.table, 1)], BLOCK_SIZE, CPU)
        batch.mrope_positions = decode_positions(batch.positions, self.delta)
        return self.model.compute_logits(self.model(batch, self.kv))[0]

    def greedy(self, count: int) -> tuple[list[int], list[torch.Tensor]]:
        logits = [self.prefill()[-1]]
        out = [int(logits[-1].argmax())]
        while len(out) < count:
            logits.append(self.decode(out[-1]))
            out.append(int(logits[-1].argmax()))
        return out, logits


def hf_logits(hf, tokens, types, media) -> torch.Tensor:
    hf.model.rope_deltas = None  # no delta left over from an earlier prompt
    with torch.inference_mode():
        return hf(**hf_inputs(tokens, types, media)).logits[0]


def hf_greedy(hf, tokens, types, media, count: int) -> tuple[list[int], list[torch.Tensor]]:
    hf.model.rope_deltas = None
    with torch.inference_mode():
        out = hf.generate(**hf_inputs(tokens, types, media), max_new_tokens=count, min_new_tokens=count,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(tokens) :].tolist(), [step[0] for step in out.logits]


# ---------------------------------------------------------------- Qwen2-VL


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl_lm") / "tiny")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(folder):
    return load_model(folder, torch.float32, CPU)


def prompts(folder) -> dict[str, list]:
    """Named prompts: text and media parts (text ids from 3: 0-2 are bos, eos and pad, and
    generate() masks pad tokens out)."""
    a, b, c = images(folder, [(200, 120), (60, 90), (150, 150)])
    clip = video(folder, 112, 84, frames=4)
    return {
        "text-only": [5, 6, 7, 8, 9, 10, 11],
        "one-image": [5, 6, a, 7, 8, 9],
        "three-images": [3, a, 4, 5, b, 6, c, 7, 8],
        "video": [9, clip, 10, 11, 12],
        "video-and-image": [4, b, 5, clip, 6],
    }


NAMES = ["text-only", "one-image", "three-images", "video", "video-and-image"]


def test_the_config_and_the_vision_tower_load(ours):
    cfg = ours.config
    assert cfg.architecture == "Qwen2VLForConditionalGeneration" and cfg.mrope_section == (2, 3, 3)
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.tie_word_embeddings
    assert (cfg.vision.family, cfg.vision.image_token_id, cfg.vision.video_token_id) == ("qwen2_vl", 250, 251)
    assert (cfg.vision.vision_start_token_id, cfg.vision.vision_end_token_id) == (252, 253)
    assert type(ours.visual).__name__ == "Qwen2VisionEncoder"


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_equal_transformers(folder, hf, ours, name):
    tokens, types, media = expand(folder, prompts(folder)[name])
    expected = hf_logits(hf, tokens, types, media)
    got = OurRun(ours, tokens, media).prefill()
    assert expected.abs().max() > 0.1  # not vanishing logits
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["three-images", "video-and-image"])
def test_greedy_decoding_equals_transformers_generate(folder, hf, ours, name):
    tokens, types, media = expand(folder, prompts(folder)[name])
    expected, expected_logits = hf_greedy(hf, tokens, types, media, NEW_TOKENS)
    got, logits = OurRun(ours, tokens, media).greedy(NEW_TOKENS)
    assert got == expected
    assert max((a - b).abs().max().item() for a, b in zip(logits, expected_logits, strict=True)) <= 1e-4


# ---------------------------------------------------------------- other checkpoint layouts


def _rewrite(source, dest, config: dict, rename) -> None:
    """A copy of the build in `dest` with this config.json and its tensors renamed by
    `rename(name) -> name | None` (None: left out)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir()
    shutil.copy(source / "preprocessor_config.json", dest)
    tensors = load_file(source / "model.safetensors")
    save_file({rename(n): t for n, t in tensors.items() if rename(n)}, dest / "model.safetensors")
    (dest / "config.json").write_text(json.dumps(config))


def test_the_released_layout_loads_tied(folder, hf, tmp_path):
    """Qwen2-VL-2B's config.json: text settings top-level, `rope_scaling: {type: mrope}`,
    rope_theta top-level, tied embeddings (no lm_head.weight)."""
    import json

    raw = json.loads((folder / "config.json").read_text())
    text = raw.pop("text_config")
    params = text.pop("rope_parameters")
    raw.update(text, model_type="qwen2_vl", tie_word_embeddings=True, rope_theta=params["rope_theta"],
               rope_scaling={"type": "mrope", "mrope_section": params["mrope_section"]})  # fmt: skip
    _rewrite(folder, tmp_path / "released", raw, lambda n: None if n == "lm_head.weight" else n)
    ours = load_model(tmp_path / "released", torch.float32, CPU)
    assert ours.config.tie_word_embeddings and ours.config.mrope_section == (2, 3, 3)
    assert (ours.config.rope.rope_type, ours.config.rope.theta) == ("default", 1000000.0)
    tokens, types, media = expand(folder, prompts(folder)["one-image"])
    got = OurRun(ours, tokens, media).prefill()
    with torch.no_grad():  # transformers' model with lm_head tied to the embeddings
        hf.lm_head.weight, untied = hf.model.language_model.embed_tokens.weight, hf.lm_head.weight
        try:
            expected = hf_logits(hf, tokens, types, media)
        finally:
            hf.lm_head.weight = untied
    assert (got - expected).abs().max().item() <= 1e-4


def test_transformers_5_prefixes_load(folder, ours, tmp_path):
    """Weights saved as model.language_model.* and model.visual.* load like model.* and visual.*."""
    import json

    def rename(name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name

    _rewrite(folder, tmp_path / "v5", json.loads((folder / "config.json").read_text()), rename)
    renamed = load_model(tmp_path / "v5", torch.float32, CPU)
    tokens, _, media = expand(folder, prompts(folder)["video-and-image"])
    assert torch.equal(OurRun(renamed, tokens, media).prefill(), OurRun(ours, tokens, media).prefill())
