"""The real client libraries against the real stack: the openai SDK's stream helpers,
`parse()`, `models.retrieve`, several prompts in one completion; LangChain's ChatOpenAI
(`bind_tools`, `with_structured_output` in each of its methods) and OpenAI (`generate`).
Every non-streaming body is also validated with the SDK's own pydantic types."""

from __future__ import annotations

import json

import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAI
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from tests.helpers.tools import WEATHER

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "What is the weather in Lisbon?"}]


class City(BaseModel):
    name: str
    country: str


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


def _validated(raw, model_type):
    """The raw JSON through the SDK's pydantic type: no missing required field, no wrong type."""
    body = raw.http_response.json()
    return model_type.model_validate(body, strict=False), body


# -- the openai SDK -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_the_stream_helper_assembles_one_call(client, model, stream):
    """The helper builds calls by index: one index twice in a chunk made a broken call and
    a phantom second one."""
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    if stream:
        with client.chat.completions.stream(**kwargs, max_completion_tokens=60) as events:
            for _ in events:
                pass
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(**kwargs, max_completion_tokens=60)
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert completion.choices[0].finish_reason == "tool_calls"


def test_parse_fills_a_pydantic_model(client, model):
    messages = [{"role": "user", "content": "Name a city and its country."}]
    completion = client.chat.completions.parse(
        model=model, messages=messages, response_format=City, temperature=0, max_completion_tokens=60
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name and parsed.country


def test_models_retrieve(client, model):
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    Model.model_validate(card.model_dump())
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_several_prompts_in_one_completion(client, model):
    prompts = ["The capital of France is", "1, 2, 3,"]
    raw = client.completions.with_raw_response.create(
        model=model, prompt=prompts, n=2, max_tokens=5, temperature=0, seed=5
    )
    completion, _ = _validated(raw, Completion)
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    alone = [
        client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0).choices[0].text
        for prompt in prompts
    ]
    assert [choice.text for choice in completion.choices] == [alone[0], alone[0], alone[1], alone[1]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"messages": ASK, "max_tokens": 8},
        {"messages": ASK, "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
        {"messages": ASK, "max_tokens": 40, "tools": [WEATHER], "tool_choice": "required"},
        {"messages": ASK, "max_tokens": 4, "n": 2},
    ],
)
def test_chat_bodies_validate_as_the_sdk_types(client, model, kwargs):
    raw = client.chat.completions.with_raw_response.create(model=model, **kwargs)
    completion, body = _validated(raw, ChatCompletion)
    for choice in body["choices"]:
        assert "refusal" in choice["message"] and choice["message"]["refusal"] is None
        if choice["logprobs"] is not None:
            assert choice["logprobs"]["refusal"] is None
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_completion_bodies_validate_as_the_sdk_types(client, model):
    for kwargs in ({"prompt": "Hello", "max_tokens": 4}, {"prompt": "1, 2,", "max_tokens": 3, "logprobs": 2}):
        completion, _ = _validated(client.completions.with_raw_response.create(model=model, **kwargs), Completion)
        assert completion.object == "text_completion"


# -- LangChain ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat(stack, model):
    return ChatOpenAI(base_url=stack.base_url, api_key="x", model=model, temperature=0, max_tokens=60, max_retries=0)


def test_langchain_bind_tools_calls_the_tool(chat):
    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Lisbon?")
    assert isinstance(message, AIMessage)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    auto = chat.bind_tools([get_weather]).invoke("Say hello.")
    assert isinstance(auto, AIMessage) and all(c["name"] == "get_weather" for c in auto.tool_calls)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(chat, method):
    structured = chat.with_structured_output(City, method=method)
    city = structured.invoke("Name a city and its country.")
    assert isinstance(city, City) and city.name and city.country


def test_langchain_structured_output_json_mode(chat):
    schema = {"title": "anything", "type": "object"}  # json_mode promises a JSON object, not a schema
    result = chat.with_structured_output(schema, method="json_mode").invoke("Reply in JSON with a city's name.")
    assert isinstance(result, dict)


def test_langchain_openai_generate_sends_the_prompts_together(stack, model):
    llm = OpenAI(base_url=stack.base_url, api_key="x", model=model, temperature=0, max_tokens=5, max_retries=0)
    result = llm.generate(["The capital of France is", "Once upon a time"])
    assert [len(generations) for generations in result.generations] == [1, 1]
    assert all(generations[0].text for generations in result.generations)
    assert result.llm_output["token_usage"]["completion_tokens"] > 0
