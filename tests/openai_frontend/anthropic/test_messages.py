"""Anthropic's Messages API in-process: the app on a fake engine, driven by the anthropic
SDK and by raw HTTP; every body held to the SDK's own types, strictly."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import anthropic
import anthropic.types as at
import httpx
import httpx2  # the anthropic SDK's HTTP client
import pytest

from backend.contract import FinishReason
from openai_frontend.generation.engine_client import ModelUnavailable
from openai_frontend.operations.auth import KeyRing
from tests.helpers.fake_engine import DEFAULT_INFO, FakeEngine
from tests.openai_frontend.anthropic.strict import STREAM_EVENT, sse_events, strict

HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _engine(tokenization, text: str, reason=FinishReason.STOP, **kwargs) -> FakeEngine:
    tok = tokenization.tokenizer
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if reason is FinishReason.STOP else [])
    return FakeEngine(ids, pack_size=3, reason=reason, **kwargs)


def _sdk(app, **kwargs) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test")
    kwargs.setdefault("api_key", "x")
    return anthropic.AsyncAnthropic(base_url="http://test", http_client=http, max_retries=0, **kwargs)


def _post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, headers=headers)

    return asyncio.run(run())


def _error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


def test_a_message_in_anthropics_shape(make_app, tokenization):
    app = make_app(_engine(tokenization, "Hello there."))
    response = _post(app, "/v1/messages", {"model": "smol", "max_tokens": 20, "messages": HI, "metadata": {}})
    assert response.status_code == 200, response.text
    message = strict(at.Message, response.json())
    assert message.id.startswith("msg_") and message.model == "smol"
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there.")]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert message.usage.output_tokens > 0 and message.usage.cache_creation_input_tokens == 0


def test_the_sdk_creates_and_streams(make_app, tokenization):
    engine = _engine(tokenization, "Hello there, friend.", FinishReason.LENGTH)
    client = _sdk(make_app(engine))

    async def run():
        made = await client.messages.create(model="smol", max_tokens=5, messages=HI, system="Be brief.")
        async with client.messages.stream(model="smol", max_tokens=5, messages=HI) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        return made, text, final

    made, text, final = asyncio.run(run())
    assert made.stop_reason == final.stop_reason == "max_tokens"
    assert text == final.content[0].text == made.content[0].text == "Hello there, friend."
    assert final.usage.input_tokens == len(engine.requests[-1].prompt_tokens)
    assert final.usage.output_tokens == made.usage.output_tokens


def test_stream_events_follow_anthropics_sequence(make_app, tokenization):
    app = make_app(_engine(tokenization, "Hi!"))
    response = _post(app, "/v1/messages", {"model": "smol", "max_tokens": 9, "messages": HI, "stream": True})
    events = sse_events(response.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    for name, data in events:
        if name != "ping":
            strict(STREAM_EVENT, data)
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


def test_a_forced_tool_call_is_a_tool_use_block(make_app, tokenization):
    engine = _engine(tokenization, CALL)
    body = {"model": "smol", "max_tokens": 50, "messages": HI, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}  # fmt: skip
    message = strict(at.Message, _post(make_app(engine), "/v1/messages", body).json())
    (call,) = message.content
    assert (call.type, call.name, call.input, message.stop_reason) == (
        "tool_use",
        "get_weather",
        {"city": "Paris"},
        "tool_use",
    )
    assert call.id.startswith("toolu_")
    request = engine.requests[-1]
    assert request.guards.require_tool_call and request.grammar_kind


def test_a_streamed_tool_call_gives_input_json_deltas(make_app, tokenization):
    client = _sdk(make_app(_engine(tokenization, CALL)))

    async def run():
        async with client.messages.stream(
            model="smol", max_tokens=50, messages=HI, tools=[WEATHER], tool_choice={"type": "any"}
        ) as stream:
            kinds = [event.type async for event in stream]
            return kinds, await stream.get_final_message()

    kinds, final = asyncio.run(run())
    assert "input_json" in kinds
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_a_tool_result_turn_reaches_the_prompt(make_app, tokenization):
    engine = _engine(tokenization, "It is sunny.")
    messages = [
        *HI,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "call it", "signature": "s"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny, 21C"}]},
            {"type": "text", "text": "So?", "cache_control": {"type": "ephemeral"}},
        ]},
    ]  # fmt: skip
    body = {"model": "smol", "max_tokens": 20, "messages": messages, "tools": [WEATHER]}
    app = make_app(engine)
    message = strict(at.Message, _post(app, "/v1/messages", body).json())
    assert message.content[0].text == "It is sunny."
    prompt = tokenization.tokenizer.decode(engine.requests[-1].prompt_tokens)
    assert "sunny, 21C" in prompt and '"city": "Paris"' in prompt and "call it" not in prompt
    count = _post(app, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    assert strict(at.MessageTokensCount, count.json()).input_tokens == len(engine.requests[-1].prompt_tokens)


def test_stop_sequences_and_sampling_reach_the_request(make_app, tokenization):
    engine = _engine(tokenization, "one two three")
    body = {"model": "smol", "max_tokens": 20, "messages": HI, "stop_sequences": [" two"],
            "temperature": 0.5, "top_p": 0.8, "top_k": 7}  # fmt: skip
    message = strict(at.Message, _post(make_app(engine), "/v1/messages", body).json())
    assert message.content[0].text == "one"
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " two")
    sampling = engine.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (0.5, 0.8, 7, 20)


@pytest.mark.parametrize("stream", [False, True])
def test_of_several_stop_sequences_the_one_that_matched_is_named(make_app, tokenization, stream):
    engine = _engine(tokenization, "one two three four")
    body = {"model": "smol", "max_tokens": 20, "messages": HI, "stop_sequences": [" four", " three", "xyz"]}
    if not stream:
        message = strict(at.Message, _post(make_app(engine), "/v1/messages", body).json())
        assert (message.content[0].text, message.stop_reason, message.stop_sequence) == (
            "one two", "stop_sequence", " three")  # fmt: skip
        return
    text = _post(make_app(engine), "/v1/messages", {**body, "stream": True}).text
    ending = [
        json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and "message_delta" in line
    ]
    assert ending[0]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " three"}


def test_thinking_is_a_thinking_block(make_app, tokenization):
    info = replace(DEFAULT_INFO, think_start="<think>", think_end="</think>")
    engine = _engine(tokenization, "<think>plan</think>answer", info=info)
    body = {"model": "smol", "max_tokens": 50, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 16}}
    message = strict(at.Message, _post(make_app(engine), "/v1/messages", body).json())
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == ("plan", "answer")
    assert engine.requests[-1].guards.thinking_budget == 16 and engine.requests[-1].guards.enable_thinking


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"frequency_penalty": 1, "n": 2}, "frequency_penalty, n: unknown fields"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}]},
         "messages[0].content[0].foo: unknown field"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages[0].content[0]"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking: this model does not reason"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"temperature": 1.5}, "temperature"),
    ],
)  # fmt: skip
def test_a_bad_body_is_a_400_in_anthropics_shape(make_app, tokenization, change, named):
    body = {"model": "smol", "max_tokens": 5, "messages": HI, **change}
    body = {k: v for k, v in body.items() if v is not None}
    message = _error(_post(make_app(_engine(tokenization, "x")), "/v1/messages", body), 400, "invalid_request_error")
    assert named in message


def test_the_sdk_raises_its_own_errors(make_app, tokenization):
    client = _sdk(make_app(_engine(tokenization, "x")))
    with pytest.raises(anthropic.BadRequestError) as refused:
        asyncio.run(client.messages.create(model="smol", max_tokens=5, messages=[{"role": "robot", "content": "x"}]))
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        asyncio.run(client.messages.create(model="nope", max_tokens=5, messages=HI))
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_an_unavailable_model_is_an_overloaded_error(make_app, tokenization):
    app = make_app(FakeEngine(error=ModelUnavailable("the model is restarting")))
    response = _post(app, "/v1/messages", {"model": "smol", "max_tokens": 5, "messages": HI})
    _error(response, 503, "overloaded_error")
    assert response.headers["retry-after"]


def test_invalid_json_is_a_400(make_app, tokenization):
    async def run():
        transport = httpx.ASGITransport(app=make_app(_engine(tokenization, "x")))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})

    _error(asyncio.run(run()), 400, "invalid_request_error")


def test_x_api_key_is_a_key(make_app, tokenization):
    app = make_app(_engine(tokenization, "Hi."), API_KEYS="key-a:alice")
    body = {"model": "smol", "max_tokens": 5, "messages": HI}
    _error(_post(app, "/v1/messages", body), 401, "authentication_error")
    _error(_post(app, "/v1/messages", body, {"x-api-key": "wrong"}), 401, "authentication_error")
    assert _post(app, "/v1/messages", body, {"x-api-key": "key-a"}).status_code == 200
    assert _post(app, "/v1/messages", body, {"Authorization": "Bearer key-a"}).status_code == 200
    message = asyncio.run(_sdk(app, api_key="key-a").messages.create(**body))
    assert message.content[0].text == "Hi."
    assert asyncio.run(_sdk(app, api_key=None, auth_token="key-a").messages.create(**body)).content


def test_the_key_ring_reads_either_header():
    ring = KeyRing({"key-a": "alice"})
    assert ring.tenant(None, "key-a") == ring.tenant("Bearer key-a") == ring.tenant("Bearer key-a", "other") == "alice"
    with pytest.raises(Exception, match="x-api-key"):
        ring.tenant(None, None)
