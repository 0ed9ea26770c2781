"""Anthropic's Messages API on the real stack, driven by the anthropic SDK: create, the
stream helpers, a forced tool call and its tool_result turn, count_tokens, errors, and
x-api-key on a frontend with keys. Every body is held to the SDK's own types strictly,
with no field they do not know (tests/openai_frontend/anthropic/strict.py)."""

from __future__ import annotations

import json

import anthropic
import anthropic.types as at
import httpx
import pytest

from launcher import Stack
from tests.openai_frontend.anthropic.strict import STREAM_EVENT, no_extras, sse_events, strict

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "What is the weather in Lisbon?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _client(stack, **kwargs) -> anthropic.Anthropic:
    """The SDK appends /v1/messages to its base URL: the server's root, not its /v1."""
    kwargs.setdefault("api_key", "x")
    return anthropic.Anthropic(base_url=stack.base_url.removesuffix("/v1"), max_retries=0, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    return _client(stack)


@pytest.fixture(scope="module")
def model(stack) -> str:
    return httpx.get(f"{stack.base_url}/models").json()["data"][0]["id"]


def _created(claude, **body) -> at.Message:
    """messages.create's raw JSON, validated strictly with the SDK's Message."""
    raw = claude.messages.with_raw_response.create(**body)
    return strict(at.Message, raw.http_response.json())


def test_create_and_count_tokens(claude, model):
    body = {"model": model, "system": [{"type": "text", "text": "Answer in one sentence."}], "messages": ASK}
    message = _created(claude, max_tokens=8, extra_body={"temperature": 0}, **body)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == model
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 8
    counted = claude.messages.with_raw_response.count_tokens(**body)
    tokens = strict(at.MessageTokensCount, counted.http_response.json()).input_tokens
    assert tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_stream_helpers(claude, model):
    sampling = {"temperature": 0, "top_k": 1}  # no longer in the SDK's signature; the server takes them
    with claude.messages.stream(model=model, max_tokens=8, messages=ASK, extra_body=sampling) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    no_extras(final)
    assert text and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 8
    assert final.usage.input_tokens > 0


def test_raw_stream_events_are_the_sdks(stack, model):
    body = {"model": model, "max_tokens": 6, "messages": ASK, "stream": True}
    response = httpx.post(f"{stack.base_url}/messages", json=body, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert [name for name, _ in events][:2] == ["message_start", "ping"]
    assert [name for name, _ in events][-2:] == ["message_delta", "message_stop"]
    for name, data in events:
        if name != "ping":
            strict(STREAM_EVENT, data)


def test_forced_tool_call_then_its_result(claude, model):
    tool_choice = {"type": "tool", "name": "get_weather"}
    message = _created(claude, model=model, max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice=tool_choice)
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and isinstance(calls[0].input, dict)
    assert calls[0].id.startswith("toolu_") and message.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": calls[0].id, "content": [{"type": "text", "text": "sunny, 21C"}]}
    turns = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
             {"role": "user", "content": [result]}]  # fmt: skip
    answer = _created(claude, model=model, max_tokens=40, messages=turns, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content or answer.stop_reason == "max_tokens"  # a call the limit cut short is dropped
    prompt = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert prompt(answer) > prompt(message)  # the call and its result are in the prompt


def test_errors_are_the_sdks(claude, model):
    with pytest.raises(anthropic.BadRequestError) as missing:
        claude.post("/v1/messages", body={"model": model, "messages": ASK}, cast_to=at.Message)
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad_role:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "system", "content": "hi"}])
    assert bad_role.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": bad_role.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.BadRequestError) as unknown:
        claude.messages.create(model=model, max_tokens=4, messages=ASK, extra_body={"n": 2})
    assert "n: unknown field" in unknown.value.body["error"]["message"]


KEYS = {"key-a": "tenant-a"}


@pytest.fixture(scope="module")
def keyed_stack(triton_only, model_path):
    with Stack(model_path, triton=triton_only, env={"API_KEYS": "key-a:tenant-a"}) as running:
        yield running


def test_x_api_key_on_a_keyed_stack(keyed_stack, model):
    message = _client(keyed_stack, api_key="key-a").messages.create(model=model, max_tokens=2, messages=ASK)
    assert message.usage.output_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as refused:
        _client(keyed_stack, api_key="key-b").messages.create(model=model, max_tokens=2, messages=ASK)
    assert refused.value.body["error"]["type"] == "authentication_error"
    bare = httpx.post(f"{keyed_stack.base_url}/messages", json={"model": model, "max_tokens": 2, "messages": ASK})
    assert bare.status_code == 401 and json.loads(bare.text)["type"] == "error"
