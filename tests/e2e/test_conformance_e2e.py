"""The protocol defects real clients found (issue 11), through the real stack: each test
failed on the code before its fix."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.tools import WEATHER

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "What is the weather in Lisbon?"}]


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=300) as client:
        yield client


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_shows_no_markup(client, model, tool_choice):
    reply = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_completion_tokens=10
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls  # the unfinished call is dropped, not returned broken
    assert "<tool_call" not in (choice.message.content or "") and "name" not in (choice.message.content or "")
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_completion_tokens=10, stream=True
    )
    content = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "<tool_call" not in content


def test_the_call_wrapper_costs_what_the_readme_says(client, model, stack):
    """docs/tool-calls.md: a call's wrapper costs about 30 tokens with the default model (budget
    max_tokens for it)."""
    from transformers import AutoTokenizer

    from openai_frontend.parsing.tools import get_tool_parser

    tokenizer = AutoTokenizer.from_pretrained(stack.model_path)
    parser = get_tool_parser("hermes", ("<tool_call>", "</tool_call>"))
    wrapper = parser.call_format.render([("get_weather", "")])
    assert 20 <= len(tokenizer.encode(wrapper, add_special_tokens=False)) <= 35


def test_response_format_with_tools_calls_or_answers_in_the_format(client, model):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        kwargs = dict(tools=[WEATHER], response_format=fmt, max_completion_tokens=60, temperature=0)
        choice = client.chat.completions.create(model=model, messages=messages, **kwargs).choices[0]
        if choice.message.tool_calls:
            assert choice.message.tool_calls[0].function.name == "get_weather"
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "Hi", "n": None, "stream": None, "echo": None},
        {"prompt": ""},
        {"prompt": None},
        {"prompt": "Hi", "n": 2, "seed": 2**63 - 1},
        {"prompt": "Hi", "top_p": 0},
    ],
)
def test_spec_valid_completion_values_are_accepted(http, body):
    response = http.post("/completions", json={**body, "max_tokens": 3})
    assert response.status_code == 200, response.text


def test_top_p_0_is_greedy(client, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_completion_tokens=16)
    greedy = client.chat.completions.create(**kwargs, temperature=0).choices[0].message.content
    assert client.chat.completions.create(**kwargs, top_p=0, temperature=1.5).choices[0].message.content == greedy


def test_max_tokens_null_is_16(http):
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": None, "ignore_eos": True}
    body["repetition_detection"] = {"min_count": 0}
    assert http.post("/completions", json=body).json()["usage"]["completion_tokens"] == 16


def test_max_tokens_0_with_echo_scores_the_prompt(http):
    prompt = {"prompt": "The sky is blue.", "echo": True, "logprobs": 1}
    scored = http.post("/completions", json={**prompt, "max_tokens": 0})
    choice = scored.json()["choices"][0]
    assert scored.json()["usage"]["completion_tokens"] == 0 and choice["text"] == "The sky is blue."
    once = http.post("/completions", json={**prompt, "max_tokens": 1})
    prompt_part = once.json()["choices"][0]["logprobs"]["token_logprobs"][: len(choice["logprobs"]["tokens"])]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(prompt_part[1:], abs=1e-4)


def test_created_is_the_arrival_time(client, model):
    sent = time.time()
    # plain decoding: drafts make a counting answer too quick for the check (int4 decodes ~200 tokens a second)
    plain = {"ignore_eos": True, "disable_mtp": True}
    reply = client.completions.create(model=model, prompt="1, 2,", max_tokens=1024, temperature=0, extra_body=plain)
    assert time.time() - sent > 1.5, "the answer should take a while for this check to mean something"
    assert reply.created <= int(sent) + 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
        ({"stream_options": {"include_obfuscation": True}, "stream": True}, "stream_options"),
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"structured_outputs": {"lark": "start: x"}}, "structured_outputs.lark"),  # a key vLLM has, not here
    ],
)
def test_spec_fields_not_honoured_are_400_naming_them(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=ASK, max_completion_tokens=4, extra_body=extra)
    assert refused.value.body["param"] == param


def test_the_older_functions_through_the_sdk(client, model):
    reply = client.chat.completions.create(
        model=model, messages=ASK, functions=[WEATHER["function"]], function_call={"name": "get_weather"},
        max_completion_tokens=60,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call.name == "get_weather"
    assert "city" in json.loads(choice.message.function_call.arguments)
