"""Every request field OpenAI's spec defines, against the one table (api/fields.py), and
through the app: accepted with its effect, or a 400 naming it. Nothing is ignored."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from backend.contract import FinishReason
from openai_frontend.api.fields import (
    CHAT,
    CHAT_EXTENSIONS,
    COMPLETION_EXTENSIONS,
    COMPLETIONS,
    EXTENSIONS,
    Treatment,
)
from openai_frontend.app import Settings, create_app
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.openai_spec import request_fields

SPEC_CHAT = request_fields("CreateChatCompletionRequest")
SPEC_COMPLETIONS = request_fields("CreateCompletionRequest")
USER = [{"role": "user", "content": "hi"}]
FUNCTION = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_the_table_holds_every_spec_field_and_no_other():
    assert set(CHAT) == set(SPEC_CHAT), "api/fields.py CHAT and the spec's CreateChatCompletionRequest differ"
    assert set(COMPLETIONS) == set(SPEC_COMPLETIONS)
    extensions = set(EXTENSIONS) | set(CHAT_EXTENSIONS)
    assert not extensions & (set(SPEC_CHAT) | set(SPEC_COMPLETIONS)), "an extension shadows a spec field"
    # completions' own extensions are chat fields of the spec, honoured on completions too
    assert set(COMPLETION_EXTENSIONS) <= set(SPEC_CHAT) - set(SPEC_COMPLETIONS)
    for table in (CHAT, COMPLETIONS, EXTENSIONS, CHAT_EXTENSIONS, COMPLETION_EXTENSIONS):
        for name, rule in table.items():
            assert rule.note, f"{name}: the table says nothing about it"


# One sample value per chat field; `effect(request, body)` checks what it did (the model's
# request, the response's JSON); None: a field refused for that value.
def _sampling(name, value):
    return lambda request, body: getattr(request.sampling, name) == value


CHAT_CASES = {
    "messages": (USER, lambda r, b: len(r.prompt_tokens) > 3),
    "model": ("smol", lambda r, b: b["model"] == "smol"),
    "frequency_penalty": (0.5, _sampling("frequency_penalty", 0.5)),
    "presence_penalty": (-0.5, _sampling("presence_penalty", -0.5)),
    "logit_bias": (
        {"5": 2.0},
        lambda r, b: (r.sampling.logit_bias_ids, r.sampling.logit_bias_values) == ((5,), (2.0,)),
    ),
    "n": (2, lambda r, b: len(b["choices"]) == 2),
    "seed": (7, _sampling("seed", 7)),
    "stop": (["\n\n"], lambda r, b: r.stream),  # the model streams so that the frontend can cut it
    "stream": (False, lambda r, b: not r.stream and b["object"] == "chat.completion"),
    "stream_options": ({"include_usage": True}, lambda r, b: "usage" in b),
    "temperature": (0.3, lambda r, b: abs(r.sampling.temperature - 0.3) < 1e-9),
    "top_p": (0.5, _sampling("top_p", 0.5)),
    "user": ("user-1", lambda r, b: True),  # no effect by design
    "max_completion_tokens": (5, _sampling("max_tokens", 5)),
    "max_tokens": (6, _sampling("max_tokens", 6)),
    "logprobs": (True, _sampling("logprobs", True)),
    "top_logprobs": (3, lambda r, b: r.sampling.top_logprobs == 3),
    "response_format": ({"type": "json_object"}, lambda r, b: r.grammar_kind == "json_object"),
    "tools": ([{"type": "function", "function": FUNCTION}], lambda r, b: r.guards.tools_present),
    "tool_choice": ("none", lambda r, b: not r.guards.tools_present),
    "parallel_tool_calls": (False, lambda r, b: '"star"' not in r.grammar_spec),  # no further calls after one
    "functions": ([FUNCTION], lambda r, b: r.guards.tools_present and r.grammar_kind == "structural_tag"),
    "function_call": ("none", lambda r, b: not r.guards.tools_present),
    "reasoning_effort": ("none", lambda r, b: not r.guards.enable_thinking),
    "metadata": ({"k": "v"}, lambda r, b: True),
    "safety_identifier": ("s-1", lambda r, b: True),
    "prompt_cache_key": ("k-1", lambda r, b: True),
    "store": (True, None),
    "service_tier": ("flex", None),
    "modalities": (["text", "audio"], None),
    "audio": ({"voice": "alloy", "format": "mp3"}, None),
    "verbosity": ("low", None),
    "web_search_options": ({}, None),
    "prediction": ({"type": "content", "content": "def f(x):"}, lambda r, b: len(r.prediction_tokens) >= 4),
    "prompt_cache_retention": ("24h", None),
    "prompt_cache_options": ({"ttl": "30m"}, None),
    "moderation": ({"model": "omni-moderation-latest"}, None),
}
# fields a case needs besides its own
CHAT_WITH = {
    "top_logprobs": {"logprobs": True},
    "tool_choice": {"tools": [{"type": "function", "function": FUNCTION}]},
    "parallel_tool_calls": {"tools": [{"type": "function", "function": FUNCTION}]},
    "function_call": {"functions": [FUNCTION]},
}
# the values the PARTLY fields honour
CHAT_ACCEPTED = {
    "store": False,
    "service_tier": "auto",
    "modalities": ["text"],
    "stream_options": {"include_usage": True},
}

COMPLETION_CASES = {
    "prompt": (["a", "b"], lambda r, b: len(b["choices"]) == 2),
    "model": ("smol", lambda r, b: b["model"] == "smol"),
    "frequency_penalty": (0.5, _sampling("frequency_penalty", 0.5)),
    "presence_penalty": (0.5, _sampling("presence_penalty", 0.5)),
    "logit_bias": ({"5": -1.0}, lambda r, b: r.sampling.logit_bias_ids == (5,)),
    "n": (2, lambda r, b: len(b["choices"]) == 2),
    "seed": (3, _sampling("seed", 3)),
    "stop": ("\n", lambda r, b: r.stream),
    "stream": (False, lambda r, b: b["object"] == "text_completion"),
    "stream_options": ({"include_usage": True}, lambda r, b: True),  # the usage chunk: tests/e2e
    "temperature": (0.0, _sampling("temperature", 0.0)),
    "top_p": (0.9, lambda r, b: abs(r.sampling.top_p - 0.9) < 1e-9),
    "user": ("u", lambda r, b: True),
    "max_tokens": (3, _sampling("max_tokens", 3)),
    "echo": (True, lambda r, b: b["choices"][0]["text"].startswith("x")),
    "logprobs": (2, lambda r, b: r.sampling.top_logprobs == 2 and b["choices"][0]["logprobs"] is not None),
    "best_of": (3, None),
    "suffix": ("tail", None),
}
COMPLETION_ACCEPTED = {"best_of": 1, "suffix": ""}


@pytest.fixture(scope="module")
def app(tokenization):
    return create_app(Settings("unused", "smol"), tokenization=tokenization)


def _post(app, path: str, body: dict) -> tuple[httpx.Response, FakeEngine]:
    engine = FakeEngine([1, 2, 3], reason=FinishReason.STOP)
    app.state.serving.engine = engine

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(run()), engine


def _check(app, path: str, base: dict, table, cases: dict, accepted: dict, needs: dict | None = None) -> None:
    assert set(cases) == set(table), "every field of the table has a case here"
    for name, (value, effect) in cases.items():
        response, engine = _post(app, path, {**base, **(needs or {}).get(name, {}), name: value})
        if effect is None:
            assert table[name].treatment in (Treatment.REFUSED, Treatment.PARTLY), name
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["param"] == name and error["message"].startswith(f"{name}: "), (name, error)
            assert engine.requests == [], f"{name}: refused, yet the model was asked"
        else:
            assert response.status_code == 200, (name, response.text)
            assert effect(engine.requests[0], response.json()), f"{name}={value!r} had no effect"
    for name, value in accepted.items():
        response, _ = _post(app, path, {**base, name: value})
        assert response.status_code == 200, (name, value, response.text)


def test_every_chat_field_has_its_effect_or_is_refused_naming_it(app):
    _check(app, "/v1/chat/completions", {"messages": USER}, CHAT, CHAT_CASES, CHAT_ACCEPTED, CHAT_WITH)


def test_every_completions_field_has_its_effect_or_is_refused_naming_it(app):
    _check(app, "/v1/completions", {"prompt": "x"}, COMPLETIONS, COMPLETION_CASES, COMPLETION_ACCEPTED)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER, "stream_options": {"include_obfuscation": True}}, "stream_options"),
        ({"messages": USER, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"messages": USER, "structured_outputs": {"lark": "start: x"}}, "structured_outputs.lark"),
        ({"messages": USER, "bogus": 1}, "bogus"),
        ({"messages": USER, "prompt_logprobs": 2}, "prompt_logprobs"),  # computed, then shown nowhere: refused
        ({"messages": USER, "reasoning_effort": "high"}, "reasoning_effort"),  # the default model does not reason
        (
            {"messages": USER, "functions": [FUNCTION], "tools": [{"type": "function", "function": FUNCTION}]},
            "functions",
        ),
    ],
)
def test_what_is_not_honoured_is_a_400_naming_it(app, body, param):
    response, engine = _post(app, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param or param in response.json()["error"]["message"]
    assert engine.requests == []


@pytest.mark.parametrize("value", [False, 7, "text", {"text": 1}, [["text"]], [None]])
def test_a_partly_honoured_field_of_the_wrong_type_is_a_400_naming_it_never_a_500(app, value):
    """The fuzzer's find: `"modalities": false` once reached list(False), a 500."""
    for path, base, table in (
        ("/v1/chat/completions", {"messages": USER}, CHAT),
        ("/v1/completions", {"prompt": "x"}, COMPLETIONS),
    ):
        for name in (name for name, rule in table.items() if rule.treatment is Treatment.PARTLY):
            if table[name].accepts(value):
                continue
            response, engine = _post(app, path, {**base, name: value})
            assert response.status_code == 400, (path, name, value, response.text)
            assert response.json()["error"]["param"] == name and engine.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),  # chat's only
        ({"prompt": "x", "top_logprobs": 3}, "top_logprobs"),  # completions ask with logprobs: N
    ],
)
def test_completions_refuse_what_only_chat_would_honour(app, body, param):
    response, engine = _post(app, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert engine.requests == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_prediction_as_text_parts_is_their_text_tokenized(app, tokenization, path):
    parts = [{"type": "text", "text": "def area(r):\n"}, {"type": "text", "text": "    return 3.14 * r * r\n"}]
    base = {"messages": USER} if "chat" in path else {"prompt": "x"}
    response, engine = _post(app, path, {**base, "prediction": {"type": "content", "content": parts}})
    assert response.status_code == 200, response.text
    want = tokenization.tokenizer.encode("def area(r):\n    return 3.14 * r * r\n", add_special_tokens=False)
    assert list(engine.requests[0].prediction_tokens) == want


@pytest.mark.parametrize(
    "prediction",
    [
        "def f(x): pass",  # a bare string, not the object
        {"type": "text", "content": "x"},
        {"content": "x"},
        {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
        {"type": "content", "content": 7},
        {"type": "content", "content": "x", "extra": 1},
    ],
)
def test_a_prediction_of_the_wrong_shape_is_a_400_naming_it(app, prediction):
    for path, base in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        response, engine = _post(app, path, {**base, "prediction": prediction})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prediction" and "type" in error["message"], error
        assert engine.requests == []


def test_a_prediction_longer_than_the_context_allows_is_a_400_naming_it(app):
    """The fake model's context is 8192 tokens: a prediction of more than what is left."""
    text = "word " * 9000
    response, engine = _post(
        app, "/v1/chat/completions", {"messages": USER, "prediction": {"type": "content", "content": text}}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prediction" and "leaves" in error["message"], error
    assert engine.requests == []


def test_extension_fields_by_their_contract_name_are_forwarded(app):
    response, engine = _post(app, "/v1/chat/completions", {"messages": USER, "dry_multiplier": 0.8, "top_n_sigma": 1.5})
    assert response.status_code == 200, response.text
    assert (engine.requests[0].sampling.dry_multiplier, engine.requests[0].sampling.top_n_sigma) == (0.8, 1.5)
