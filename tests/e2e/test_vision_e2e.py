"""End to end with a vision-language model: a stack of its own serving the tiny random
Qwen2-VL with SmolLM2's tokenizer and Qwen2-VL's chat template (tests/helpers/vlm_models.py;
no real Qwen2-VL can be downloaded here) as `MODEL=<folder> make serve` would, driven by the
official openai client with data-URL images, against transformers' `generate` on the same
folder (the prompt rendered by the same template and expanded by transformers' processor)."""

from __future__ import annotations

import base64
import concurrent.futures
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from launcher import Stack
from launcher.layout import default_model_path
from tests.helpers.vlm_models import write_tiny_qwen2_vl

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    image.save(out, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


def image_part(image: Image.Image, fmt: str = "PNG") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image, fmt)}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    dest = tmp_path_factory.mktemp("vlm-e2e") / "tiny-qwen2-vl"
    return write_tiny_qwen2_vl(dest, seed=5, tokenizer_from=default_model_path())


@pytest.fixture(scope="module")
def reference(folder):
    """(messages with PIL images) -> (prompt ids, greedy completion text), by transformers."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def run(parts: list) -> tuple[list[int], str]:
        images = [p for p in parts if isinstance(p, Image.Image)]
        content = [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in parts]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)  # fmt: skip
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        media = {}
        if images:
            processed = processor(images=images, return_tensors="pt")
            media = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        counts = iter((media["image_grid_thw"].prod(-1) // 4).tolist() if images else [])
        prompt = [t for token in ids for t in ([pad] * next(counts) if token == pad else [token])]
        types = torch.tensor([[1 if t == pad else 0 for t in prompt]])
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), mm_token_type_ids=types, max_new_tokens=MAX_TOKENS,
                              do_sample=False, **media)  # fmt: skip
        return prompt, tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)

    return run


@pytest.fixture(scope="module")
def vlm_stack(folder):
    with Stack(str(folder), env={"LIMIT_MM_PER_PROMPT": "image=3,video=1", "MAX_IMAGE_PIXELS": "4000000"}) as running:
        yield running


@pytest.fixture(scope="module")
def client(vlm_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=vlm_stack.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def ask(client, model, content, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, **kwargs)  # fmt: skip


def as_content(parts: list, fmt: str = "PNG") -> list[dict]:
    return [image_part(p, fmt) if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in parts]


CONVERSATIONS = {
    "one-image": ["What is in this picture?", picture(200, 120, 1)],
    "three-images-interleaved": [picture(90, 60, 2), "and", picture(64, 128, 3), "then", picture(150, 150, 4), "?"],
    "text-only": ["Say hello."],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_with_images_equals_transformers(client, model, reference, name):
    parts = CONVERSATIONS[name]
    prompt, text = reference(parts)
    response = ask(client, model, as_content(parts))
    assert response.choices[0].message.content == text
    assert response.usage.prompt_tokens == len(prompt)  # the image tokens are counted


def test_streaming_and_jpeg_and_webp(client, model, reference):
    image = picture(120, 96, 6)
    jpeg = Image.open(io.BytesIO(base64.b64decode(data_url(image, "JPEG").split(",", 1)[1]))).convert("RGB")
    _, text = reference(["Describe", jpeg])  # the picture as the JPEG decodes
    stream = ask(client, model, as_content(["Describe", image], "JPEG"), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    webp = ask(client, model, as_content(["Describe", image], "WEBP"))
    assert webp.choices[0].finish_reason in ("length", "stop")


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(client, model):
    text = "Look closely at this picture and tell me every detail you can see in it, please."
    first = ask(client, model, as_content([text, picture(224, 224, 7), "Now answer."]))
    again = ask(client, model, as_content([text, picture(224, 224, 7), "Now answer."]))
    other = ask(client, model, as_content([text, picture(224, 224, 8), "Now answer."]))
    prompt = first.usage.prompt_tokens
    image_tokens = (224 // 28) ** 2
    assert again.usage.prompt_tokens_details.cached_tokens >= prompt - 16 - 1  # all but the last block
    before_image = prompt - image_tokens - 4  # where the image's tokens start, about: "Now answer." and the turn
    assert other.usage.prompt_tokens_details.cached_tokens <= before_image


def test_concurrent_image_requests_each_get_their_own_answer(client, model, reference):
    conversations = [["Picture", picture(80 + 28 * i, 100, 10 + i), f"number {i}"] for i in range(4)]
    expected = [reference(parts)[1] for parts in conversations]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda parts: ask(client, model, as_content(parts)).choices[0].message.content,
                            conversations))  # fmt: skip
    assert got == expected


def test_a_video_as_frames_equals_transformers_and_a_file_is_sampled(client, model, folder):
    """A frames list (4 frames: two temporal patches) against transformers on the same
    patches; an MP4 of 2 s at 10 fps is sampled at VIDEO_FPS (2) to the same 4 frames."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from openai_frontend.media.images import Qwen2VLImages
    from tests.helpers.media import video_bytes

    frames = [picture(84, 56, 20 + i) for i in range(4)]
    prepared = Qwen2VLImages.from_folder(folder).video_frames(frames)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    content = [{"type": "text", "text": "What happens?"}, {"type": "video"}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)  # fmt: skip
    pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    prompt = [t for token in ids for t in ([pad] * prepared.num_tokens if token == pad else [token])]
    hf = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            mm_token_type_ids=torch.tensor([[2 * (t == pad) for t in prompt]]),
            pixel_values_videos=torch.from_numpy(prepared.pixel_values),
            video_grid_thw=torch.tensor([prepared.grid_thw]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    expected = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
    urls = [data_url(f) for f in frames]
    response = ask(client, model, [{"type": "text", "text": "What happens?"}, {"type": "video", "video": urls}])
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(prompt)
    mp4 = "data:video/mp4;base64," + base64.b64encode(video_bytes(20, 10, width=84, height=56)).decode()
    from_file = ask(client, model, [{"type": "text", "text": "What happens?"},
                                    {"type": "video_url", "video_url": {"url": mp4}}])  # fmt: skip
    assert from_file.usage.prompt_tokens == len(prompt)


def _post(vlm_stack, model, content) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(f"{vlm_stack.base_url}/chat/completions", json=body, timeout=120)


def _garbage_png() -> str:
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4).decode()


FUZZ = {
    "truncated-base64": [{"type": "image_url", "image_url": {"url": data_url(picture(64, 64, 1))[:-37]}}],
    "png-header-on-garbage": [{"type": "image_url", "image_url": {"url": _garbage_png()}}],
    "one-pixel": [image_part(picture(1, 1, 2))],
    "huge": [image_part(Image.new("RGB", (10000, 10000)))],
    "zero-frame-video": [{"type": "video", "video": []}],
    "not-a-url": [{"type": "image_url", "image_url": {"url": "picture.png"}}],
    "http-not-allowed": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}],
    "file-not-allowed": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
    "too-many-images": [image_part(picture(56, 56, i)) for i in range(4)],
    "unknown-part": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
}


@pytest.mark.parametrize("name", list(FUZZ))
def test_bad_content_parts_get_a_400_naming_the_part(vlm_stack, client, model, name):
    response = _post(vlm_stack, model, [{"type": "text", "text": "hi"}, *FUZZ[name]])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("messages[0].content["), error
    assert ask(client, model, as_content(["still serving?"])).choices[0].finish_reason in ("length", "stop")


def test_a_text_only_model_refuses_images(client: openai.OpenAI, stack):
    """The default stack (SmolLM2, text only) answers an image part with a 400 naming it."""
    text_client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
    served = text_client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        ask(text_client, served, as_content(["What is this?", picture(64, 64, 1)]))
    assert "messages[0].content[1]" in str(info.value)
