"""Images and videos through /v1/chat/completions, in-process with the tiny Qwen2-VL's
tokenizer and a fake engine: the prompt and VisionItems the engine gets (placeholders
expanded as transformers' Qwen2-VL processor expands them), and the 400s that name
`messages[i].content[j]`, with nothing sent to the engine."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from backend.contract import ModelInfo
from backend.contract.vision import VisionInfo
from openai_frontend.app import Settings, create_app
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.media.parts import LOW_DETAIL_MAX_PIXELS
from tests.helpers.fake_engine import DEFAULT_INFO, FakeEngine
from tests.helpers.media import data_url, encoded, image_url, picture, video_bytes
from tests.helpers.vlm_models import vision_token_ids, write_tiny_qwen2_vl

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from backend.runner.convert import ensure_default_model

    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"), tokenizer_from=ensure_default_model())


@pytest.fixture(scope="module")
def vl_tokenization(folder):
    return Tokenization(folder)


@pytest.fixture(scope="module")
def info(folder, vl_tokenization):
    vision = VisionInfo("qwen2_vl", **vision_token_ids(folder))
    return ModelInfo(max_model_len=4096, vocab_size=len(vl_tokenization.tokenizer), vision=vision)


@pytest.fixture
def post(vl_tokenization, info):
    """POST a chat body to a fresh app (made with `env`); (the response, the engine)."""

    def run(body, env=None, model_info=None):
        environ = {name: str(value) for name, value in (env or {}).items()}
        app = create_app(Settings.from_env(environ, "unused", "vl"), tokenization=vl_tokenization)
        engine = FakeEngine([5, 6], info=model_info or info)
        app.state.serving.engine = engine

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await client.post(CHAT, json={"max_tokens": 2, **body})

        return asyncio.run(go()), engine

    return run


def user(*parts):
    return {"messages": [{"role": "user", "content": list(parts)}]}


def text(value):
    return {"type": "text", "text": value}


def image(url, **extra):
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def reference_prompt(tokenizer, messages, grids, merge=2):
    """What transformers' Qwen2VLProcessor builds: the rendered template, each
    <|image_pad|> / <|video_pad|> repeated grid.prod() // merge**2 times, tokenized."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    first, *rest = rendered.split("<|image_pad|>")
    pads = ["<|image_pad|>" * (int(np.prod(grid)) // merge**2) for grid in grids]
    text = first + "".join(pad + piece for pad, piece in zip(pads, rest, strict=True))
    return tokenizer.encode(text, add_special_tokens=False)


def test_images_interleaved_with_text_match_transformers(post, vl_tokenization, folder):
    pictures = [picture(150, 100, seed=1), picture(300, 220, seed=2)]
    body = user(text("Compare"), image(data_url(encoded(pictures[0]))), text("with"),
                image(data_url(encoded(pictures[1], "JPEG"), "image/jpeg")), text("please."))  # fmt: skip
    response, engine = post(body)
    assert response.status_code == 200, response.text
    request = engine.requests[0]
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(folder))
    jpeg = Image.open(io.BytesIO(encoded(pictures[1], "JPEG"))).convert("RGB")  # as the server decodes it
    expected = [processor(images=[p], return_tensors="np") for p in (pictures[0], jpeg)]
    grids = [tuple(int(v) for v in out["image_grid_thw"][0]) for out in expected]
    assert [item.grid for item in request.vision] == grids and [item.kind for item in request.vision] == ["image"] * 2
    for item, out in zip(request.vision, expected, strict=True):
        np.testing.assert_allclose(item.pixels, out["pixel_values"], atol=1e-5, rtol=0)
    template_messages = [{"role": "user", "content": [text("Compare"), {"type": "image"}, text("with"),
                                                      {"type": "image"}, text("please.")]}]  # fmt: skip
    assert request.prompt_tokens == reference_prompt(vl_tokenization.tokenizer, template_messages, grids)
    assert response.json()["usage"]["prompt_tokens"] == len(request.prompt_tokens)


def test_a_video_file_and_a_frames_list(post, info):
    frames = [image_url(56, 56, seed=s, fmt="JPEG") for s in range(3)]
    body = user({"type": "video_url", "video_url": {"url": data_url(video_bytes(30, rate=10), "video/mp4")}},
                {"type": "video", "video": frames}, text("what happens?"))  # fmt: skip
    response, engine = post(body, env={"VIDEO_FPS": 2, "LIMIT_MM_PER_PROMPT": "video=2"})
    assert response.status_code == 200, response.text
    file_item, frames_item = engine.requests[0].vision
    # 3 s at 2 fps: 6 frames, 3 temporal patches; 64x48 resizes to 56x56 (min_pixels 56*56)
    assert (file_item.kind, file_item.grid, file_item.seconds_per_grid) == ("video", (3, 4, 4), pytest.approx(1.0))
    assert (frames_item.grid, frames_item.seconds_per_grid) == ((2, 4, 4), 1.0)  # 3 frames padded to 4
    prompt = engine.requests[0].prompt_tokens
    assert prompt.count(info.vision.video_token_id) == 3 * 4 + 2 * 4
    assert prompt.count(info.vision.image_token_id) == 0


def test_detail_low_and_mm_processor_kwargs_bound_the_resize(post):
    big = image_url(900, 700, seed=3)
    response, engine = post(user(image(big, detail="low")))
    assert response.status_code == 200, response.text
    t, h, w = engine.requests[0].vision[0].grid
    assert h * w * 14 * 14 <= LOW_DETAIL_MAX_PIXELS
    response, engine = post({**user(image(big)), "mm_processor_kwargs": {"max_pixels": 28 * 28 * 16}})
    t, h, w = engine.requests[0].vision[0].grid
    assert h * w // 4 <= 16
    response, engine = post({**user(image(image_url(30, 30))), "mm_processor_kwargs": {"min_pixels": 28 * 28 * 100}})
    assert engine.requests[0].vision[0].num_tokens(2) >= 100


@pytest.mark.parametrize("size", [(1, 1), (13, 40), (300, 5)])
def test_an_image_smaller_than_a_patch_is_refused(post, size):
    response, engine = post(user(text("see"), image(data_url(encoded(picture(*size))))))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "at least 14" in error["message"]
    assert not engine.requests


def test_a_one_patch_image_is_resized_as_transformers_does(post, folder):
    small = picture(14, 14)
    response, engine = post(user(image(data_url(encoded(small)))))
    assert response.status_code == 200, response.text
    out = Qwen2VLImageProcessorPil.from_pretrained(str(folder))(images=[small], return_tensors="np")
    assert engine.requests[0].vision[0].grid == tuple(int(v) for v in out["image_grid_thw"][0]) == (1, 4, 4)


def test_images_in_any_role_are_taken(post):
    body = {"messages": [{"role": "system", "content": [text("look"), image(image_url())]},
                         {"role": "user", "content": "and?"}]}  # fmt: skip
    response, engine = post(body)
    assert response.status_code == 200, response.text
    assert len(engine.requests[0].vision) == 1


PNG_HEADER_GARBAGE = data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
TRUNCATED = data_url(encoded(picture(200, 200))[:300])


@pytest.mark.parametrize(
    ("part", "env", "says"),
    [
        (image(PNG_HEADER_GARBAGE), {}, "not a PNG"),
        (image(TRUNCATED), {}, "truncated"),
        (image("data:image/png;base64,iVBORw0KGgoAAAANSUhEU"), {}, "base64"),
        (image("data:image/bmp;base64,Qk0="), {}, "unsupported image type"),
        (image(data_url(b"x", "text/plain")), {}, "unsupported image type"),
        (image("https://example.com/cat.png"), {}, "does not fetch from host"),
        (image("file:///etc/passwd"), {}, "file:// URLs are not allowed"),
        (image("file:///etc/passwd"), {"ALLOWED_LOCAL_MEDIA_PATH": "/tmp"}, "not a file under the allowed path"),
        (image(image_url(300, 300)), {"MAX_IMAGE_PIXELS": 300 * 300 - 1}, "more than"),
        (image(image_url(300, 300)), {"MAX_MEDIA_BYTES": 1000}, "MAX_MEDIA_BYTES"),
        (image(image_url(3000, 14)), {}, "aspect ratio"),
        ({"type": "video", "video": []}, {}, "at least one frame"),
        ({"type": "video", "video": [image_url(56, 56), image_url(84, 56)]}, {}, "one size"),
        ({"type": "video", "video": [image_url(56, 56)] * 3}, {"VIDEO_MAX_FRAMES": 2}, "VIDEO_MAX_FRAMES"),
        ({"type": "video_url", "video_url": {"url": data_url(b"junk", "video/mp4")}}, {}, "not a decodable"),
        ({"type": "video_url", "video_url": {"url": image_url()}}, {}, "unsupported video type"),
    ],
)
def test_bad_media_is_a_400_naming_the_part(post, part, env, says):
    response, engine = post({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "user", "content": [text("see"), part]}]}, env=env)  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[1].content[1]" and error["type"] == "invalid_request_error"
    assert says in error["message"], error["message"]
    assert engine.requests == []


def test_limits_per_prompt(post):
    three = user(image(image_url(seed=1)), image(image_url(seed=2)), image(image_url(seed=3)))
    response, engine = post(three, env={"LIMIT_MM_PER_PROMPT": "image=2"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[2]"
    assert "LIMIT_MM_PER_PROMPT" in response.json()["error"]["message"] and engine.requests == []
    video = {"type": "video", "video": [image_url(56, 56)]}
    response, _ = post(user(video, video))  # the default: one video
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[1]"
    response, _ = post(three)  # the default: 8 images
    assert response.status_code == 200, response.text


def test_images_past_the_context_are_refused(post, info):
    small = ModelInfo(max_model_len=120, vocab_size=info.vocab_size, vision=info.vision)
    body = {**user(image(image_url(seed=1)), image(image_url(600, 600))), "mm_processor_kwargs": {"max_pixels": 10**6}}
    response, engine = post(body, model_info=small)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[1]"
    assert "context" in response.json()["error"]["message"] and engine.requests == []
    # within the items' budget, but not with the text: the usual context 400
    response, engine = post(user(text("word " * 100), image(image_url(150, 100))), model_info=small)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "maximum context length" in response.json()["error"]["message"]


def test_media_sent_to_a_text_only_model(post):
    response, engine = post(user(text("hi"), image(image_url())), model_info=DEFAULT_INFO)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[1]"
    assert "text only" in response.json()["error"]["message"] and engine.requests == []


def test_a_text_spelling_out_a_placeholder_is_refused(post):
    response, engine = post(user(text("a <|image_pad|> here")))
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert engine.requests == []
    response, engine = post(user(text("plain text")))
    assert response.status_code == 200 and engine.requests[0].vision == ()


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"min_pixels": 0}, "positive integer"),
        ({"max_pixels": "big"}, "positive integer"),
        ({"max_pixels": True}, "positive integer"),
        ({"min_pixels": 1000, "max_pixels": 999}, "must not exceed"),
        ({"fps": 2}, "only min_pixels and max_pixels"),
    ],
)
def test_bad_mm_processor_kwargs(post, kwargs, says):
    response, engine = post({**user(image(image_url())), "mm_processor_kwargs": kwargs})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("mm_processor_kwargs") and says in error["message"]


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ({"type": "input_audio", "input_audio": {}}, "not supported"),
        ({"type": "image_url", "image_url": {}}, "url"),
        ({"type": "image_url", "image_url": {"url": "data:,", "detail": "huge"}}, "detail"),
    ],
)
def test_malformed_parts_are_a_400(post, part, says):
    response, engine = post({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "user", "content": [text("see"), part]}]})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[1].content[1]" and says in error["message"], error
    assert engine.requests == []


def test_a_large_data_url_passes_the_string_bound(post):
    raw = encoded(picture(400, 400, seed=9))
    assert len(base64.b64encode(raw)) > 1000
    response, engine = post(user(image(data_url(raw))), env={})
    assert response.status_code == 200, response.text


def test_completions_stay_text_only(vl_tokenization, info):
    app = create_app(Settings("unused", "vl"), tokenization=vl_tokenization)
    app.state.serving.engine = FakeEngine([5], info=info)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/completions", json={"prompt": "hi", "mm_processor_kwargs": {"max_pixels": 9}})

    response = asyncio.run(go())
    assert response.status_code == 400 and response.json()["error"]["param"] == "mm_processor_kwargs"
