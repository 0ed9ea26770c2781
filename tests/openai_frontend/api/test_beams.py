"""Beam search through the app (a fake engine that answers searches): the one request a
body makes, the 400s naming the body's field, the choices (text, finish reasons, logprobs,
usage) and the stream (keep-alive comments until the search ends, then each choice)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import openai
import pytest

from openai_frontend.generation.engine_client import ModelUnavailable
from tests.helpers.fake_engine import model_refusal
from tests.openai_frontend.fake_beams import BEAM_INFO, LENGTH, STOP, BeamEngine

USER = [{"role": "user", "content": "Tell me about Paris."}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BEAMS = {"num_beams": 4}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TEXTS = ["Paris is the capital of France.", "Paris is a city in France.", "Paris is big"]


def _ids(tokenization, text: str) -> list[int]:
    return asyncio.run(tokenization.encode_text(text))


def _engine(tokenization, texts=TEXTS, reasons=(STOP, STOP, LENGTH), **kwargs) -> BeamEngine:
    return BeamEngine([(_ids(tokenization, t), r) for t, r in zip(texts, reasons, strict=True)], **kwargs)


def _post(app, path: str, body: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(run())


def _base(path: str) -> dict:
    return {"messages": USER} if path == CHAT else {"prompt": "Paris"}


def _events(text: str) -> tuple[list[dict], int]:
    """An SSE text's data payloads (through [DONE]) and how many keep-alive comments it had."""
    blocks = [block for block in text.split("\n\n") if block]
    comments = sum(block == ": keep-alive" for block in blocks)
    data = [block.removeprefix("data: ") for block in blocks if block.startswith("data: ")]
    assert data[-1] == "[DONE]" and len(data) + comments == len(blocks), blocks
    return [json.loads(d) for d in data[:-1]], comments


# ---------------------------------------------------------------------------
# the request


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_search_is_one_engine_request_with_its_n_best(make_app, tokenization, path):
    engine = _engine(tokenization)
    body = {**_base(path), "num_beams": 4, "n": 3, "length_penalty": 0.7, "early_stopping": "never"}
    response = _post(make_app(engine), path, body)
    assert response.status_code == 200, response.text
    (request,) = engine.requests
    assert (request.num_beams, request.num_return_sequences) == (4, 3)
    assert (request.length_penalty, request.early_stopping) == (0.7, "never")
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 1.0, 0)  # no sampling preset
    assert sampling.max_tokens == (50 if path == CHAT else 16)  # chat's max_tokens preset; completions' default
    assert len(response.json()["choices"]) == 3


@pytest.mark.parametrize(("early", "rule"), [(True, "true"), (False, "false"), ("never", "never")])
def test_early_stopping_maps_to_the_contract(make_app, tokenization, early, rule):
    engine = _engine(tokenization)
    response = _post(make_app(engine), COMPLETIONS, {"prompt": "x", **BEAMS, "early_stopping": early})
    assert response.status_code == 200, response.text
    assert engine.requests[0].early_stopping == rule


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0},
        {"top_p": 1},
        {"top_k": -1},
        {"stop": []},
        {"logit_bias": {"5": -2}, "stop_token_ids": [7], "min_tokens": 2, "max_tokens": 9},
        {"response_format": {"type": "text"}},
        {"tools": [WEATHER], "tool_choice": "auto"},
        {"tools": [WEATHER], "tool_choice": "none"},
        {"logprobs": True, "top_logprobs": 2},
    ],
)
def test_what_a_search_can_honour_is_accepted(make_app, tokenization, extra):
    engine = _engine(tokenization)
    response = _post(make_app(engine), CHAT, {"messages": USER, **BEAMS, **extra})
    assert response.status_code == 200, response.text
    assert engine.requests[0].num_beams == 4 and engine.requests[0].sampling.temperature == 0


def test_tools_with_a_search_send_no_grammar_and_calls_are_parsed(make_app, tokenization):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine = _engine(tokenization, [call, "It is sunny."], (STOP, STOP))
    response = _post(make_app(engine), CHAT, {"messages": USER, **BEAMS, "n": 2, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    request = engine.requests[0]
    assert request.grammar_kind == "" and request.guards.tools_present and not request.guards.require_tool_call
    first, second = response.json()["choices"]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert second["finish_reason"] == "stop" and second["message"]["content"] == "It is sunny."


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("path", "extra", "param", "says"),
    [
        (CHAT, {"num_beams": 0}, "num_beams", "[1, 8]"),
        (COMPLETIONS, {"num_beams": 9}, "num_beams", "[1, 8]"),
        (CHAT, {"num_beams": 2, "n": 3}, "n", "at most num_beams"),
        (CHAT, {**BEAMS, "early_stopping": "sometimes"}, "early_stopping", '"never"'),
        (CHAT, {**BEAMS, "early_stopping": "true"}, "early_stopping", '"never"'),
        (CHAT, {**BEAMS, "temperature": 0.9}, "temperature", "deterministic"),
        (COMPLETIONS, {**BEAMS, "temperature": 0.9}, "temperature", "deterministic"),
        (CHAT, {**BEAMS, "top_p": 0.5}, "top_p", "raw distribution"),
        (CHAT, {**BEAMS, "top_k": 5}, "top_k", "raw distribution"),
        (CHAT, {**BEAMS, "min_p": 0.1}, "min_p", "raw distribution"),
        (COMPLETIONS, {**BEAMS, "seed": 1}, "seed", "seed"),
        (CHAT, {**BEAMS, "presence_penalty": 0.5}, "presence_penalty", "penalty"),
        (CHAT, {**BEAMS, "frequency_penalty": 0.5}, "frequency_penalty", "penalty"),
        (CHAT, {**BEAMS, "repetition_penalty": 1.2}, "repetition_penalty", "penalty"),
        (COMPLETIONS, {**BEAMS, "stop": ["."]}, "stop", "stop_token_ids"),
        (CHAT, {**BEAMS, "stop": "."}, "stop", "stop_token_ids"),
        (CHAT, {**BEAMS, "response_format": {"type": "json_object"}}, "response_format", "grammar"),
        (CHAT, {**BEAMS, "tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "tool call"),
        (CHAT, {**BEAMS, "tools": [WEATHER], "tool_choice": NAMED}, "tool_choice", "tool call"),
        (CHAT, {**BEAMS, "prediction": {"type": "content", "content": "Paris"}}, "prediction", "prediction"),
        (CHAT, {"length_penalty": 0.5}, "length_penalty", "num_beams above 1"),
        (COMPLETIONS, {"num_beams": 1, "early_stopping": True}, "early_stopping", "num_beams above 1"),
        # what the contract alone checks comes back naming its field
        (CHAT, {**BEAMS, "dry_multiplier": 0.5}, "dry_multiplier", "beam search"),
        (COMPLETIONS, {**BEAMS, "max_tokens": 0}, "max_tokens", "beam search"),
        (CHAT, {**BEAMS, "num_return_sequences": 2}, "num_return_sequences", "not a field"),
    ],
)
def test_what_a_search_cannot_honour_is_a_400_naming_the_field(make_app, tokenization, path, extra, param, says):
    engine = _engine(tokenization)
    response = _post(make_app(engine), path, {**_base(path), **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and says in error["message"], error
    assert engine.requests == []


def test_the_models_beam_defaults_apply_to_what_the_body_leaves_out(make_app, tokenization):
    info = replace(BEAM_INFO, beam_defaults={"num_beams": 3, "length_penalty": 0.8, "early_stopping": "true"})
    engine = _engine(tokenization, info=info)
    app = make_app(engine)
    assert _post(app, CHAT, {"messages": USER, "n": 2}).status_code == 200
    assert _post(app, CHAT, {"messages": USER, "early_stopping": "never"}).status_code == 200
    assert _post(app, CHAT, {"messages": USER, "num_beams": 1, "temperature": 0.7}).status_code == 200
    searched, kept, sampled = engine.requests
    assert (searched.num_beams, searched.num_return_sequences, searched.length_penalty) == (3, 2, 0.8)
    assert (searched.early_stopping, kept.early_stopping) == ("true", "never")
    assert (sampled.num_beams, sampled.length_penalty, sampled.early_stopping) == (1, 1.0, "false")
    assert sampled.sampling.temperature == 0.7
    # a sampler with the default search: the 400 says the search is the model's default
    refused = _post(app, CHAT, {"messages": USER, "temperature": 0.7})
    assert refused.status_code == 400 and "this model's default" in refused.json()["error"]["message"]


# ---------------------------------------------------------------------------
# the response


def test_chat_choices_are_the_hypotheses_best_first(make_app, tokenization):
    engine = _engine(tokenization)
    response = _post(make_app(engine), CHAT, {"messages": USER, **BEAMS, "n": 3})
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in data["choices"]] == TEXTS
    assert [c["finish_reason"] for c in data["choices"]] == ["stop", "stop", "length"]
    assert response.headers["x-finish-guard"] == "eos,eos,max_tokens"
    usage = data["usage"]
    tokens = sum(len(_ids(tokenization, t)) for t in TEXTS) + 2  # the two that stopped count their EOS
    assert usage["completion_tokens"] == tokens
    assert usage["prompt_tokens"] == len(engine.requests[0].prompt_tokens)
    assert usage["total_tokens"] == usage["prompt_tokens"] + tokens


def test_chat_logprobs_come_from_each_hypothesis(make_app, tokenization):
    engine = _engine(tokenization)
    body = {"messages": USER, **BEAMS, "n": 2, "logprobs": True, "top_logprobs": 2}
    choices = _post(make_app(engine), CHAT, body).json()["choices"]
    for choice, text in zip(choices, TEXTS, strict=False):
        content = choice["logprobs"]["content"]
        ids = _ids(tokenization, text)
        assert [entry["token"] for entry in content] == [tokenization.token_text(t) for t in ids]
        assert [entry["logprob"] for entry in content] == pytest.approx([-t / 1000 for t in ids])  # float32
        assert all(len(entry["top_logprobs"]) == 2 for entry in content)


def test_completions_logprobs_and_echo(make_app, tokenization):
    engine = _engine(tokenization)
    body = {"prompt": "Paris:", **BEAMS, "n": 2, "logprobs": 1, "echo": True}
    response = _post(make_app(engine), COMPLETIONS, body)
    assert response.status_code == 200, response.text
    prompt_len = len(engine.requests[0].prompt_tokens)
    for choice, text in zip(response.json()["choices"], TEXTS, strict=False):
        assert choice["text"] == "Paris:" + text
        logprobs = choice["logprobs"]
        ids = _ids(tokenization, text)
        assert logprobs["tokens"][prompt_len:] == [tokenization.token_text(t) for t in ids]
        assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == prompt_len + len(ids)
        offsets = logprobs["text_offset"]
        assert all(choice["text"].startswith(t, o) for t, o in zip(logprobs["tokens"], offsets, strict=True))


def test_a_search_ended_before_its_first_step_gives_empty_choices(make_app, tokenization):
    engine = BeamEngine([], final_reason=LENGTH, info=BEAM_INFO)
    response = _post(make_app(engine), COMPLETIONS, {"prompt": "x", **BEAMS, "n": 2})
    assert response.status_code == 200, response.text
    data = response.json()
    assert [(c["text"], c["finish_reason"]) for c in data["choices"]] == [("", "length"), ("", "length")]
    assert data["usage"]["completion_tokens"] == 0


def test_a_refusal_from_the_model_is_a_400_also_when_streaming(make_app):
    engine = BeamEngine([], error=model_refusal("num_beams", "at most 2 beams fit the KV pool"))
    app = make_app(engine, SSE_KEEPALIVE_S=0.5)
    for stream in (False, True):
        response = _post(app, COMPLETIONS, {"prompt": "x", **BEAMS, "stream": stream})
        assert response.status_code == 400 and response.json()["error"]["param"] == "num_beams", response.text


# ---------------------------------------------------------------------------
# the stream


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_stream_keeps_alive_until_the_search_ends_then_sends_each_choice(make_app, tokenization, path):
    engine = _engine(tokenization, delay_s=0.3)
    app = make_app(engine, SSE_KEEPALIVE_S=0.02)
    body = {**_base(path), **BEAMS, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    response = _post(app, path, body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks, comments = _events(response.text)
    assert comments >= 3
    assert response.text.index(": keep-alive") < response.text.index('"content":"Paris' if path == CHAT else '"Paris')
    usage = chunks.pop()["usage"]
    chat = path == CHAT
    if chat:  # a role chunk per choice first
        assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:3]] == [
            (i, {"role": "assistant", "content": ""}) for i in range(3)
        ]
        chunks = chunks[3:]
    # then each choice: its text, then its finish reason
    pieces = [(c["choices"][0]["index"], c["choices"][0]) for c in chunks]
    assert [i for i, _ in pieces] == [0, 0, 1, 1, 2, 2]
    texts = [(p["delta"].get("content") if chat else p["text"]) for _, p in pieces[::2]]
    assert texts == TEXTS and all(p["finish_reason"] is None for _, p in pieces[::2])
    assert [p["finish_reason"] for _, p in pieces[1::2]] == ["stop", "stop", "length"]
    whole = _post(app, path, {**body, "stream": False}).json()
    assert usage == whole["usage"]


def test_a_fast_search_streams_without_keep_alives(make_app, tokenization):
    app = make_app(_engine(tokenization), SSE_KEEPALIVE_S=5)
    chunks, comments = _events(_post(app, COMPLETIONS, {"prompt": "x", **BEAMS, "stream": True}).text)
    assert comments == 0 and chunks[0]["choices"][0]["text"] == TEXTS[0]


def test_the_openai_client_skips_the_keep_alives(make_app, tokenization):
    app = make_app(_engine(tokenization, delay_s=0.2), SSE_KEEPALIVE_S=0.02)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
            stream = await client.chat.completions.create(
                model="smol", messages=USER, n=2, stream=True, extra_body=BEAMS
            )
            texts = {0: "", 1: ""}
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
            return texts

    assert asyncio.run(run()) == {0: TEXTS[0], 1: TEXTS[1]}


def test_a_model_failure_after_the_stream_began_is_an_error_event(make_app, tokenization):
    engine = _engine(tokenization, delay_s=0.1, late_error=ModelUnavailable("the model restarted"))
    app = make_app(engine, SSE_KEEPALIVE_S=0.02)
    response = _post(app, COMPLETIONS, {"prompt": "x", **BEAMS, "stream": True})
    assert response.status_code == 200
    chunks, comments = _events(response.text)
    assert comments >= 1 and chunks[-1]["error"]["code"] == "model_unavailable"
