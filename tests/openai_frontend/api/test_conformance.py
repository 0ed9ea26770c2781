"""OpenAI conformance at the handlers, on a fake engine: one regression test per defect
real clients found (issue 11), each failing on the code before its fix."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from backend.contract import FinishGuard, FinishReason, ModelInfo
from openai_frontend.app import Settings, create_app
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tools import WEATHER_FUNCTION as WEATHER

USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def app(tokenization):
    return create_app(Settings("unused", "smol"), tokenization=tokenization)


def _ids(tokenization, text: str, eos: bool = True) -> list[int]:
    tok = tokenization.tokenizer
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])


def _post(app, engine: FakeEngine, path: str, body: dict) -> httpx.Response:
    app.state.serving.engine = engine
    app.state.serving.info = None  # asked again: a test may give the engine other facts

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(run())


def _chunks(response: httpx.Response) -> list[dict]:
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_a_streamed_call_sends_one_entry_per_index_per_chunk(app, tokenization):
    engine = FakeEngine(_ids(tokenization, CALL), pack_size=len(_ids(tokenization, CALL)), reason=FinishReason.STOP)
    body = {"messages": USER, "tools": [{"type": "function", "function": WEATHER}], "stream": True}
    chunks = _chunks(_post(app, engine, "/v1/chat/completions", body))
    for chunk in chunks:
        for choice in chunk["choices"]:
            indices = [call["index"] for call in choice["delta"].get("tool_calls", [])]
            assert len(indices) == len(set(indices)), chunk
    calls = [call for chunk in chunks for choice in chunk["choices"] for call in choice["delta"].get("tool_calls", [])]
    assert [c["function"].get("name") for c in calls if "id" in c] == ["get_weather"]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_leaks_no_markup(app, tokenization, stream):
    cut = _ids(tokenization, CALL, eos=False)[:12]
    engine = FakeEngine(cut, pack_size=3, reason=FinishReason.LENGTH)
    body = {"messages": USER, "tools": [{"type": "function", "function": WEATHER}], "tool_choice": "required"}
    response = _post(app, engine, "/v1/chat/completions", {**body, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        chunks = _chunks(response)
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    else:
        message = response.json()["choices"][0]["message"]
        content, finish = message["content"] or "", response.json()["choices"][0]["finish_reason"]
        assert "tool_calls" not in message  # the cut call is dropped, not returned broken
    assert "<tool_call" not in content and '"name"' not in content
    assert finish == "length"


def test_a_second_parallel_call_cut_keeps_the_first(app, tokenization):
    text = CALL + "\n" + CALL[:30]
    engine = FakeEngine(_ids(tokenization, text, eos=False), reason=FinishReason.LENGTH)
    body = {"messages": USER, "tools": [{"type": "function", "function": WEATHER}], "tool_choice": "required"}
    choice = _post(app, engine, "/v1/chat/completions", body).json()["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"


def test_the_older_functions_are_answered_with_function_call(app, tokenization):
    engine = FakeEngine(_ids(tokenization, CALL), reason=FinishReason.STOP)
    body = {"messages": USER, "functions": [WEATHER], "function_call": {"name": "get_weather"}}
    choice = _post(app, engine, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"]["name"] == "get_weather"
    assert json.loads(choice["message"]["function_call"]["arguments"]) == {"city": "Paris"}
    assert "tool_calls" not in choice["message"]
    request = engine.requests[0]
    assert request.guards.require_tool_call and '"star"' not in request.grammar_spec  # one call at most
    chunks = _chunks(_post(app, engine, "/v1/chat/completions", {**body, "stream": True}))
    pieces = [
        c["choices"][0]["delta"]["function_call"]
        for c in chunks
        if c["choices"] and "function_call" in c["choices"][0]["delta"]
    ]
    assert pieces[0]["name"] == "get_weather"
    assert json.loads("".join(p["arguments"] for p in pieces)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"


def test_an_earlier_function_turn_reaches_the_template_as_a_tool_turn(app, tokenization):
    engine = FakeEngine(_ids(tokenization, "It is sunny."), reason=FinishReason.STOP)
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny, 21 C"},
    ]
    response = _post(app, engine, "/v1/chat/completions", {"messages": messages, "functions": [WEATHER]})
    assert response.status_code == 200, response.text
    prompt = tokenization.tokenizer.decode(engine.requests[0].prompt_tokens)
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in prompt and "sunny, 21 C" in prompt


def test_several_prompts_are_choices_in_order_and_their_usage_adds_up(app, tokenization):
    engine = FakeEngine([5, 6, 7], reason=FinishReason.LENGTH)
    data = _post(app, engine, "/v1/completions", {"prompt": ["one", "two words", "three"], "n": 2}).json()
    assert [c["index"] for c in data["choices"]] == list(range(6))
    prompts = [r.prompt_tokens for r in engine.requests]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3] != prompts[4] == prompts[5]
    assert data["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[2]) + len(prompts[4])  # each prompt once
    assert data["usage"]["completion_tokens"] == 6 * 3
    ids = _post(app, engine, "/v1/completions", {"prompt": [[9, 9], [8, 8, 8]]}).json()
    assert [r.prompt_tokens for r in engine.requests[-2:]] == [[9, 9], [8, 8, 8]] and len(ids["choices"]) == 2


def test_several_prompts_stream_with_their_indices_and_echo_their_own_text(app, tokenization):
    engine = FakeEngine(_ids(tokenization, " end", eos=False), reason=FinishReason.LENGTH)
    body = {"prompt": ["Alpha", "Beta"], "echo": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _chunks(_post(app, engine, "/v1/completions", body))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: "Alpha end", 1: "Beta end"}
    assert all("usage" not in chunk for chunk in chunks[:-1]) and chunks[-1]["usage"]["prompt_tokens"] > 0


def test_completions_max_tokens_null_is_16_and_0_scores_the_prompt(app):
    engine = FakeEngine([], reason=FinishReason.LENGTH, guard=FinishGuard.MAX_TOKENS)
    _post(app, engine, "/v1/completions", {"prompt": "x", "max_tokens": None})
    assert engine.requests[0].sampling.max_tokens == 16
    data = _post(
        app, engine, "/v1/completions", {"prompt": "a b c", "max_tokens": 0, "echo": True, "logprobs": 0}
    ).json()
    assert engine.requests[1].sampling.max_tokens == 0 and engine.requests[1].sampling.prompt_logprobs == 0
    choice = data["choices"][0]
    assert choice["text"] == "a b c" and choice["logprobs"]["token_logprobs"][0] is None
    assert len(choice["logprobs"]["tokens"]) == len(engine.requests[1].prompt_tokens)


def test_an_empty_prompt_is_the_start_of_a_document(app, tokenization):
    engine = FakeEngine([5], reason=FinishReason.LENGTH)
    for prompt in ("", None):
        assert _post(app, engine, "/v1/completions", {"prompt": prompt}).status_code == 200
    assert [r.prompt_tokens for r in engine.requests] == [[tokenization.document_start_id]] * 2


def test_the_message_and_its_logprobs_carry_refusal_null(app, tokenization):
    engine = FakeEngine(_ids(tokenization, "Hi."), reason=FinishReason.STOP)
    choice = _post(app, engine, "/v1/chat/completions", {"messages": USER, "logprobs": True}).json()["choices"][0]
    assert choice["message"]["refusal"] is None and "refusal" in choice["message"]
    assert choice["logprobs"]["refusal"] is None and "refusal" in choice["logprobs"]


def test_created_is_the_arrival_time(app, tokenization):
    engine = FakeEngine(_ids(tokenization, "a b c d"), pack_size=1, delay_s=0.6, reason=FinishReason.STOP)
    sent = time.time()
    data = _post(app, engine, "/v1/chat/completions", {"messages": USER}).json()
    assert time.time() - sent > 2  # the answer took seconds
    assert data["created"] <= int(sent) + 1, "created was stamped when the answer was done"


def test_reasoning_effort_turns_thinking_on_or_off_with_a_budget(app):
    info = ModelInfo(
        max_model_len=8192, vocab_size=49154, think_start="<think>", think_end="</think>", tool_parser="hermes",
        tool_call_start="<tool_call>", tool_call_end="</tool_call>",
    )  # fmt: skip
    engine = FakeEngine([5], reason=FinishReason.STOP, info=info)
    for effort in ("none", "low", "high"):
        assert (
            _post(app, engine, "/v1/chat/completions", {"messages": USER, "reasoning_effort": effort}).status_code
            == 200
        )
    off, low, high = engine.requests
    assert not off.guards.enable_thinking and off.guards.thinking_budget is None
    assert low.guards.enable_thinking and low.guards.thinking_budget == 512
    assert high.guards.enable_thinking and high.guards.thinking_budget is None  # the model's own budget
    explicit = {"messages": USER, "reasoning_effort": "low", "thinking_budget": 9}
    assert _post(app, engine, "/v1/chat/completions", explicit).status_code == 200
    assert engine.requests[-1].guards.thinking_budget == 9  # the extension's own value wins
