"""The server's bodies and stream chunks against OpenAI's published OpenAPI spec.

The spec (tests/helpers/openai_spec.json, vendored with its commit named) is the
reference for shapes: for a spread of requests through the real stack, every
non-streaming body validates against the operation's response schema and every chunk
against the stream schema (completions chunks share the completion's schema), with no
required field missing and no field of the wrong type.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.helpers.openai_spec import validator
from tests.helpers.tools import WEATHER

pytestmark = pytest.mark.e2e

USER = [{"role": "user", "content": "Name a fruit."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}

CHAT_BODIES = {
    "plain": {"messages": USER, "max_tokens": 8},
    "greedy, stop, seed": {"messages": USER, "max_tokens": 12, "temperature": 0, "stop": ["\n"], "seed": 3},
    "logprobs": {"messages": USER, "max_tokens": 4, "logprobs": True, "top_logprobs": 3},
    "n": {"messages": USER, "max_tokens": 4, "n": 2, "seed": 1},
    "json_schema": {
        "messages": USER,
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    },
    "tools required": {"messages": USER, "max_tokens": 40, "tools": [WEATHER], "tool_choice": "required"},
    "tools auto": {"messages": USER, "max_tokens": 12, "tools": [WEATHER]},
    "functions": {"messages": USER, "max_tokens": 40, "functions": [WEATHER["function"]], "function_call": "auto"},
}
COMPLETION_BODIES = {
    "plain": {"prompt": "Once upon a time", "max_tokens": 8},
    "echo, logprobs": {"prompt": "1, 2, 3,", "max_tokens": 4, "echo": True, "logprobs": 2, "temperature": 0},
    "prompts": {"prompt": ["Red, green,", "One, two,"], "max_tokens": 4, "n": 2, "seed": 9},
    "scoring": {"prompt": "The sky is blue.", "max_tokens": 0, "echo": True, "logprobs": 0},
}


def _assert_valid(schema: str, body: Any) -> None:
    errors = sorted(validator(schema).iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not errors, f"{schema}: " + "; ".join(f"{list(e.absolute_path)}: {e.message[:200]}" for e in errors[:5])


def _as_whole(chunk: dict[str, Any]) -> dict[str, Any]:
    """The spec has no schema for a completions stream chunk, only for the whole response,
    whose choices need a finish_reason; OpenAI (and vLLM) send null until a choice's last
    chunk. Every other field of the chunk is checked against the whole's schema."""
    choices = [{**choice, "finish_reason": choice["finish_reason"] or "length"} for choice in chunk["choices"]]
    return {**chunk, "choices": choices}


def _first_echoed_token_scored(body: dict[str, Any], echoed: bool) -> dict[str, Any]:
    """With echo, the first prompt token has no logprob (nothing predicts it): null, as
    OpenAI's legacy echo and vLLM send it; the spec's schema has no place for that null.
    Only that first entry may be null; the rest is checked as the spec says."""
    choices = []
    for choice in body["choices"]:
        logprobs = choice.get("logprobs")
        if logprobs and logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
            assert echoed, "a null logprob on a token that is not the first echoed one"
            logprobs = {**logprobs, "token_logprobs": [0.0, *logprobs["token_logprobs"][1:]]}
            logprobs["top_logprobs"] = [{}, *logprobs["top_logprobs"][1:]]
        choices.append({**choice, "logprobs": logprobs})
    return {**body, "choices": choices}


def _chunks(response: httpx.Response) -> list[dict[str, Any]]:
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=300) as client:
        yield client


@pytest.mark.parametrize("case", list(CHAT_BODIES))
def test_chat_bodies_and_chunks_follow_the_spec(http, case):
    body = CHAT_BODIES[case]
    whole = http.post("/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    _assert_valid("CreateChatCompletionResponse", whole.json())
    streamed = http.post("/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200, streamed.text
    chunks = _chunks(streamed)
    for chunk in chunks:
        _assert_valid("CreateChatCompletionStreamResponse", chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("case", list(COMPLETION_BODIES))
def test_completion_bodies_and_chunks_follow_the_spec(http, case):
    body = COMPLETION_BODIES[case]
    whole = http.post("/completions", json=body)
    assert whole.status_code == 200, whole.text
    echoed = body.get("echo", False)
    _assert_valid("CreateCompletionResponse", _first_echoed_token_scored(whole.json(), echoed))
    streamed = http.post("/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200, streamed.text
    chunks = _chunks(streamed)
    for chunk in chunks:
        _assert_valid("CreateCompletionResponse", _first_echoed_token_scored(_as_whole(chunk), echoed))
    assert {c["finish_reason"] for chunk in chunks for c in chunk["choices"]} - {None} <= {"stop", "length"}
    # the usage rides on the last chunk alone (a null usage on every chunk broke strict clients)
    assert [("usage" in chunk) for chunk in chunks] == [False] * (len(chunks) - 1) + [True]


def test_models_follow_the_spec(http):
    listing = http.get("/models")
    assert listing.status_code == 200
    _assert_valid("ListModelsResponse", listing.json())
    model_id = listing.json()["data"][0]["id"]
    card = http.get(f"/models/{model_id}")
    assert card.status_code == 200
    _assert_valid("Model", card.json())
    assert card.json() == listing.json()["data"][0]
    missing = http.get("/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
