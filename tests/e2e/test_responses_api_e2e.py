"""The Responses API on the real stack, through the official openai SDK (client.responses)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response

from launcher import Stack
from tests.helpers.strict_types import strict

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _checked(response) -> dict:
    """The raw body validates as the SDK's Response, strictly, with no key the types lack."""
    body = response.model_dump(mode="json", by_alias=True, exclude_unset=True)
    strict(Response, body)  # the SDK's type, strictly, no field it lacks anywhere
    assert body["object"] == "response" and body["id"].startswith("resp_")
    return body


def test_plain_and_instructions(client, model):
    r = client.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0)
    body = _checked(r)
    assert body["status"] in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output_text and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    r2 = client.responses.create(model=model, input="Hi", instructions="Answer in French.", max_output_tokens=8)
    assert _checked(r2)["instructions"] == "Answer in French."
    body = {"model": model, "input": "Hi", "instructions": "Answer in French."}
    counted = client.post("/responses/input_tokens", body=body, cast_to=object)
    assert counted == {"object": "response.input_tokens", "input_tokens": r2.usage.input_tokens}


def test_streamed(client, model):
    schema = {
        "type": "object",
        "properties": {"ok": {"enum": ["yes"]}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "ok", "schema": schema}}  # short, so it completes
    with client.responses.stream(model=model, input="Is it ok?", text=fmt, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(numbers)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and final.usage.output_tokens > 0
    raw = list(client.responses.create(model=model, input="Hi", max_output_tokens=4, stream=True))
    assert raw[-1].type == "response.incomplete" and raw[-1].response.incomplete_details.reason == "max_output_tokens"


def test_forced_tool_then_its_output(client, model):
    r = client.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    _checked(r)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    r2 = client.responses.create(
        model=model,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=12,
    )
    body = _checked(r2)
    assert body["previous_response_id"] == r.id and r2.output[-1].type == "message"
    alone = {"model": model, "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "{}"}]}
    counted = client.post("/responses/input_tokens", body=alone, cast_to=object)
    assert r2.usage.input_tokens > counted["input_tokens"] + 5  # the first turn came along


def test_json_schema(client, model):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=model,
        input="Give a name as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=30,
    )
    _checked(r)
    assert isinstance(json.loads(r.output_text)["name"], str)


def test_bad_tool_type_names_it(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools[0].type"


@pytest.fixture(scope="module")
def keyed(triton_only, model_path):
    with Stack(model_path, triton=triton_only, env={"API_KEYS": "key-a:alice,key-b:bob"}) as running:
        yield running


def test_store_get_delete_and_tenants(keyed, model):
    alice = openai.OpenAI(base_url=keyed.base_url, api_key="key-a", max_retries=0, timeout=120)
    bob = openai.OpenAI(base_url=keyed.base_url, api_key="key-b", max_retries=0, timeout=120)
    r = alice.responses.create(model=model, input="Hi", max_output_tokens=4)
    assert _checked(alice.responses.retrieve(r.id))["id"] == r.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError):
        alice.responses.cancel(r.id)
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    unstored = alice.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)


def _spec_errors(name: str, body) -> list[str]:
    from tests.helpers.openai_spec import validator

    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"[:300] for e in validator(name).iter_errors(body)]


def _event_errors(event: dict) -> list[str]:
    """`event` against the one ResponseStreamEvent branch its type names (the union's own
    error would be one line for the whole event)."""
    from tests.helpers.openai_spec import schemas

    for ref in schemas()["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[-1]
        if event.get("type") in schemas()[name]["properties"]["type"].get("enum", []):
            return _spec_errors(name, event)
    return [f"no ResponseStreamEvent has type {event.get('type')!r}"]


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("forced_tool", [False, True], ids=["text", "function-call"])
def test_bodies_and_events_follow_openais_spec(stack, model, forced_tool):
    """OpenAI's published OpenAPI spec (tests/helpers/openai_spec.json): the Response body,
    every streamed event (ResponseStreamEvent), a stored response read back, input_tokens."""
    import httpx

    body = {"model": model, "input": "What is the weather in Paris?", "max_output_tokens": 24, "temperature": 0}
    if forced_tool:
        body |= {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    with httpx.Client(base_url=stack.base_url, timeout=120) as http:
        whole = http.post("/responses", json=body).json()
        assert _spec_errors("Response", whole) == []
        assert any(item["type"] == ("function_call" if forced_tool else "message") for item in whole["output"])
        assert _spec_errors("Response", http.get(f"/responses/{whole['id']}").json()) == []
        events = _sse_events(http.post("/responses", json=body | {"stream": True}).text)
        failures = [(event["type"], _event_errors(event)) for event in events if _event_errors(event)]
        assert events and not failures, failures
        assert all(_spec_errors("ResponseStreamEvent", event) == [] for event in events)
        kinds = {event["type"] for event in events}
        wanted = "response.function_call_arguments.done" if forced_tool else "response.output_text.done"
        assert wanted in kinds and ("response.completed" in kinds or "response.incomplete" in kinds)
        counted = http.post("/responses/input_tokens", json={"model": model, "input": "Hi"}).json()
        assert _spec_errors("TokenCountsResource", counted) == []
