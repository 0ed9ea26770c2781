"""Structured output and tool calls end to end: the real model through Triton and the
frontend, sampling at temperature 0.8, every answer checked with `jsonschema`.

Uses the session-scoped `stack` fixture (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

ANSWERS = 20  # per schema
MAX_TOKENS = 200

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array": {
        "type": "object",
        "properties": {
            "fruits": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4}
        },
        "required": ["fruits"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "in_stock": {"type": "boolean"},
        },
        "required": ["color", "size", "in_stock"],
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 50},
            "year": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": 1, "maximum": 5},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        },
        "required": ["score", "count", "ratio"],
    },
}

PROMPTS = {
    "nested": "Describe a person and where they live, as JSON.",
    "array": "List some fruits you like, as JSON.",
    "enums": "Describe a T-shirt in the shop, as JSON.",
    "required_and_optional": "Tell me about a film, as JSON.",
    "bounded_numbers": "Rate this restaurant, as JSON.",
}


def _async_client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=600)


async def _gather(stack, make_calls):
    client = _async_client(stack)
    try:
        return await asyncio.gather(*make_calls(client))
    finally:
        await client.close()


def _sampled(stack, samples, **create):
    """`samples` chat replies at temperature 0.8 (seeds 0..samples-1), made concurrently."""

    def calls(client):
        return [
            client.chat.completions.create(temperature=0.8, seed=seed, max_tokens=MAX_TOKENS, **create)
            for seed in range(samples)
        ]

    return asyncio.run(_gather(stack, calls))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_answer_follows_its_schema(stack, model, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": PROMPTS[name]}]
    for reply in _sampled(stack, ANSWERS, model=model, messages=messages, response_format=fmt):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_answers_parse(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": 'Reply with a JSON object with keys "answer" and "n": what is 2 + 2?'}],
        response_format={"type": "json_object"},
        temperature=0.8,
        seed=5,
        max_tokens=MAX_TOKENS,
        n=4,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_cut_by_max_tokens_is_length(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS["nested"]}], response_format=fmt, max_tokens=5
    )
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}},
        {"type": 12},
        {"$ref": "#/definitions/missing"},
    ],
)
def test_a_schema_that_cannot_compile_is_400_naming_response_format(client, model, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], response_format=fmt, max_tokens=4
        )
    assert info.value.body["param"] == "response_format"


# ---------------------------------------------------------------------------
# tool calls


def _tool(name, description, properties, required):
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOL_SETS = {
    "weather": (
        [
            _tool(
                "get_weather",
                "Current weather in a city",
                {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                ["city", "unit"],
            )
        ],
        "What is the weather in Lisbon?",
    ),
    "shop": (
        [
            _tool(
                "add_to_cart",
                "Add an item to the cart",
                {"item": {"type": "string", "maxLength": 30}, "quantity": {"type": "integer", "minimum": 1}},
                ["item", "quantity"],
            ),
            _tool("checkout", "Pay for the cart", {"express": {"type": "boolean"}}, ["express"]),
        ],
        "Buy two apples and pay.",
    ),
    "math": (
        [
            _tool("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]),
            _tool("multiply", "Multiply two numbers", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]),
            _tool(
                "round_to",
                "Round a number",
                {"x": {"type": "number"}, "digits": {"type": "integer", "minimum": 0, "maximum": 6}},
                ["x"],
            ),
        ],
        "What is 3 times 7?",
    ),
}


def _check_calls(tools, calls):
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in by_name
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def _named(tools):
    return {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}


@pytest.mark.parametrize("tool_set", list(TOOL_SETS))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_always_gives_valid_calls(stack, model, tool_set, choice):
    tools, question = TOOL_SETS[tool_set]
    tool_choice = _named(tools) if choice == "named" else "required"
    messages = [{"role": "user", "content": question}]
    for reply in _sampled(stack, 6, model=model, messages=messages, tools=tools, tool_choice=tool_choice):
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_.message
        assert choice_.message.tool_calls
        _check_calls(tools, choice_.message.tool_calls)
        if choice == "named":
            assert {c.function.name for c in choice_.message.tool_calls} == {tool_choice["function"]["name"]}


@pytest.mark.parametrize("tool_set", list(TOOL_SETS))
def test_auto_gives_text_or_valid_calls_never_a_malformed_call(stack, model, tool_set):
    tools, question = TOOL_SETS[tool_set]
    for reply in _sampled(stack, 8, model=model, messages=[{"role": "user", "content": question}], tools=tools):
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check_calls(tools, choice.message.tool_calls)
        if choice.finish_reason != "length":
            assert "<tool_call>" not in (choice.message.content or "")


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_tool_calls_equal_the_non_streamed_ones(client, model, tool_choice):
    tools, question = TOOL_SETS["shop"]
    kwargs = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "tools": tools,
        "tool_choice": tool_choice,
        "temperature": 0.8,
        "seed": 11,
        "max_tokens": MAX_TOKENS,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        (choice,) = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == whole.finish_reason
    assert (content or None) == whole.message.content
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == expected
