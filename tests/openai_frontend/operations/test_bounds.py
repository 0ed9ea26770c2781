"""The one bound on every request body (operations/bounds.py, in the gate): each route,
the token and Responses routes included, refuses a body past a bound with a 400 naming
the place, before any route, tokenizer or template sees it; numbers never wrap."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from openai_frontend.api.errors import OpenAIError
from openai_frontend.operations.bounds import checked_body, checked_json_text
from openai_frontend.operations.limits import LimitSettings
from tests.helpers.fake_engine import FakeEngine

HI = [{"role": "user", "content": "hi"}]
LONG = "y" * 101
LIMITS = {"MAX_MESSAGES": 3, "MAX_STRING_CHARS": 100}
IMAGE = "data:image/png;base64," + "A" * 500  # media: bounded by bytes, not by the strings' bound


@pytest.fixture
def engine(tokenization) -> FakeEngine:
    return FakeEngine(tokenization.tokenizer.encode(" Hello.", add_special_tokens=False))


def _send(app, path: str, body: bytes | dict, headers: dict | None = None) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await client.post(
                path, content=content, headers={"content-type": "application/json", **(headers or {})}
            )

    return asyncio.run(run())


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


CASES = [
    ("/v1/chat/completions", {"messages": HI * 4}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}] * 4}, "input"),
    ("/v1/responses", {"input": LONG}, "input"),
    ("/v1/responses/input_tokens", {"input": [{"role": "user", "content": "x"}] * 4}, "input"),
    ("/tokenize", {"prompt": LONG}, "prompt"),
    ("/tokenize", {"messages": HI * 4}, "messages"),
    ("/detokenize", {"tokens": [1] * 5, "model": LONG}, "model"),
    ("/v1/completions", {"prompt": "hi", "metadata": _nested(200)}, "metadata"),
    ("/v1/completions", {"prompt": "hi", "priority": 2**63}, "priority"),
    ("/v1/completions", {"prompt": "hi", "top_k": -(2**64)}, "top_k"),
    ("/v1/completions", {"prompt": "hi", LONG: 1}, None),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES)
def test_every_route_refuses_a_body_past_a_bound_naming_the_place(make_app, engine, path, body, param):
    response = _send(make_app(engine, **LIMITS), path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.requests == []


def test_anthropic_messages_are_bounded_in_anthropics_shape(make_app, engine):
    body = {"model": "smol", "max_tokens": 4, "messages": HI * 4}
    response = _send(make_app(engine, **LIMITS), "/v1/messages", body)
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert "MAX_MESSAGES" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [b"[" * 5000 + b"]" * 5000, b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "n": Infinity}'],
)
def test_deep_or_non_json_numbers_are_400(make_app, engine, raw):
    response = _send(make_app(engine), "/v1/completions", raw)
    assert response.status_code == 400, response.text
    assert engine.requests == []


def test_a_data_url_is_bounded_by_bytes_not_by_the_strings_bound(make_app, engine):
    part = {"type": "image_url", "image_url": {"url": IMAGE}}
    response = _send(
        make_app(engine, **LIMITS), "/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}]}
    )
    # past the gate: the text-only model refuses the image itself, naming the part
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[0]"


def test_integers_wider_than_their_tensor_never_wrap(make_app, engine):
    app = make_app(engine)
    for field, value in (("priority", 2**32), ("seed", 2**63 - 1 + 1), ("top_k", 2**31)):
        response = _send(app, "/v1/completions", {"prompt": "hi", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
    assert engine.requests == []
    assert _send(app, "/v1/completions", {"prompt": "hi", "seed": 2**63 - 1, "max_tokens": 2}).status_code == 200


def test_json_sent_as_text_is_parsed_within_the_same_bounds():
    deep = "[" * 5000 + "]" * 5000
    for text in (deep, json.dumps(_nested(300)), '{"type": "object", "x": NaN}'):
        with pytest.raises(OpenAIError) as refused:
            checked_json_text(text, "guided_json")
        assert refused.value.status == 400 and refused.value.param == "guided_json"
    assert checked_json_text('{"type": "object"}', "guided_json") == {"type": "object"}


def test_json_schema_text_in_a_request_is_a_400_not_a_500(make_app, engine):
    deep = "[" * 5000 + "]" * 5000
    app = make_app(engine)
    for field in ({"guided_json": deep}, {"structured_outputs": {"json": deep}}, {"structural_tag": deep}):
        response = _send(app, "/v1/completions", {"prompt": "hi", **field})
        assert response.status_code == 400, (field, response.text)


def test_the_walk_names_the_first_place_and_accepts_what_fits():
    limits = LimitSettings(max_string_chars=10, max_messages=2, max_json_items=4, max_json_nesting=4)
    ok = {"messages": [{"content": "abcdefghij"}], "ids": [1, 2, 3, 4], "x": {"y": 1.5}}
    assert checked_body(json.dumps(ok).encode(), limits) == ok
    for body, param in (
        ({"ids": [1, 2, 3, 4, 5]}, "ids"),
        ({"a": {"b": {"c": {"d": 1}}}}, "a"),
        ({"messages": [{}, {}, {}]}, "messages"),
        ({"x": [{"y": "abcdefghijk"}]}, "x.0.y"),
        ({"image_url": {"url": "data:" + "z" * 50}, "b": 2**64}, "b"),
    ):
        with pytest.raises(OpenAIError) as refused:
            checked_body(json.dumps(body).encode(), limits)
        assert refused.value.param == param, body
