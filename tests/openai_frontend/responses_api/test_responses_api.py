"""POST /v1/responses in-process with a fake engine: the Response shape (validated with the
openai SDK's types), the typed event stream, the store per tenant, and the refusals."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from backend.contract import FinishReason
from openai_frontend.responses_api.store import ResponseStore, Stored
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.strict_types import strict

KEYS = "key-alice:alice,key-bob:bob"
EVENTS = TypeAdapter(ResponseStreamEvent)


def _ids(tokenization, text, eos=True):
    tok = tokenization.tokenizer
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])


async def _calls(app, *calls, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client:
        return [await client.request(method, path, json=body) for method, path, body in calls]


def _run(app, *calls, key=None):
    return asyncio.run(_calls(app, *calls, key=key))


def _validated(body):
    strict(Response, body)  # the SDK's type, strictly, no field it lacks anywhere
    return body


def test_plain_response_shape(make_app, tokenization):
    engine = FakeEngine(_ids(tokenization, "Paris."), reason=FinishReason.STOP)
    app = make_app(engine)
    [r] = _run(app, ("POST", "/v1/responses", {"model": "smol", "input": "hi", "instructions": "Be brief."}))
    assert r.status_code == 200, r.text
    body = _validated(r.json())
    assert body["id"].startswith("resp_") and body["status"] == "completed"
    [item] = body["output"]
    assert item["type"] == "message" and item["content"][0] == {
        "type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []
    }  # fmt: skip
    assert body["usage"]["output_tokens"] == len(engine.token_ids)
    assert body["instructions"] == "Be brief."


def test_max_output_tokens_is_incomplete(make_app, tokenization):
    app = make_app(FakeEngine(_ids(tokenization, "a b c", eos=False), reason=FinishReason.LENGTH))
    [r] = _run(app, ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 3}))
    body = _validated(r.json())
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_events_are_typed(make_app, tokenization):
    app = make_app(FakeEngine(_ids(tokenization, "Hello world"), reason=FinishReason.STOP))
    [r] = _run(app, ("POST", "/v1/responses", {"input": "hi", "stream": True}))
    blocks = [b for b in r.text.split("\n\n") if b]
    events = []
    for block in blocks:
        kind, data = block.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        events.append(EVENTS.validate_python(payload))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello world" == events[-1].response.output[0].content[0].text


def test_store_get_delete_and_tenants(make_app, tokenization):
    app = make_app(FakeEngine(_ids(tokenization, "ok"), reason=FinishReason.STOP), API_KEYS=KEYS)
    [r] = _run(app, ("POST", "/v1/responses", {"input": "hi"}), key="key-alice")
    rid = r.json()["id"]
    [mine, theirs] = _run(
        app, ("GET", f"/v1/responses/{rid}", None), ("GET", f"/v1/responses/{rid}", None), key="key-alice"
    )[:1] + _run(app, ("GET", f"/v1/responses/{rid}", None), key="key-bob")
    assert mine.status_code == 200 and _validated(mine.json()) == r.json()
    assert theirs.status_code == 404 and theirs.json()["error"]["type"] == "not_found_error"
    [bob_del] = _run(app, ("DELETE", f"/v1/responses/{rid}", None), key="key-bob")
    assert bob_del.status_code == 404
    cancel, deleted, gone = _run(
        app, ("POST", f"/v1/responses/{rid}/cancel", None), ("DELETE", f"/v1/responses/{rid}", None),
        ("GET", f"/v1/responses/{rid}", None), key="key-alice",
    )  # fmt: skip
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    assert deleted.json() == {"id": rid, "object": "response", "deleted": True}
    assert gone.status_code == 404


def test_previous_response_continues_conversation(make_app, tokenization):
    engine = FakeEngine(_ids(tokenization, "first"), reason=FinishReason.STOP)
    app = make_app(engine)
    [r] = _run(app, ("POST", "/v1/responses", {"input": "question one"}))
    [r2] = _run(app, ("POST", "/v1/responses", {"input": "question two", "previous_response_id": r.json()["id"]}))
    assert r2.status_code == 200, r2.text
    prompt = tokenization.tokenizer.decode(engine.requests[-1].prompt_tokens)
    assert prompt.index("question one") < prompt.index("first") < prompt.index("question two")
    [missing] = _run(app, ("POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}))
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"


def test_function_call_items_reach_the_template(make_app, tokenization):
    engine = FakeEngine(_ids(tokenization, "It is sunny."), reason=FinishReason.STOP)
    app = make_app(engine)
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "SUNNY-42"},
    ]
    [r] = _run(app, ("POST", "/v1/responses", {"input": items, "tools": [tool]}))
    assert r.status_code == 200, r.text
    _validated(r.json())
    assert "SUNNY-42" in tokenization.tokenizer.decode(engine.requests[-1].prompt_tokens)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ],
)
def test_refusals_name_the_field(make_app, body, param):
    [r] = _run(make_app(FakeEngine([1])), ("POST", "/v1/responses", body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_input_tokens(make_app, tokenization):
    engine = FakeEngine([1])
    [r] = _run(make_app(engine), ("POST", "/v1/responses/input_tokens", {"input": "hello there"}))
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response.input_tokens" and r.json()["input_tokens"] > 2


def test_store_is_a_bounded_lru_per_tenant():
    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put("a", Stored({"id": f"r{i}"}, []))
    store.put("b", Stored({"id": "r9"}, []))
    assert len(store) == 3
    with pytest.raises(Exception, match="not found"):
        store.get("a", "r0")
    with pytest.raises(Exception, match="not found"):
        store.get("b", "r1")
    assert store.get("a", "r2").response["id"] == "r2"
