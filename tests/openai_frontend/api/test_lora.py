"""LoRA adapters in the frontend, driven in-process on a fake engine that keeps an adapter
table: what a request's `model` picks, /v1/models, the runtime management endpoints and
who may call them, and the per-adapter counters."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

import httpx
import pytest

from backend.contract import AdapterInfo, AdapterTable
from openai_frontend.generation.engine_client import ModelUnavailable
from tests.helpers.fake_engine import FakeEngine, model_refusal

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LOAD, UNLOAD, ACTIVE = "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/active_lora_adapter"
HI = [{"role": "user", "content": "hi"}]
KEYS = "key-alice:alice,key-bob:bob"
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
SQL = AdapterInfo("sql", 1, 1, "/adapters/sql", 8)
TALK = AdapterInfo("talk", 2, 2, "/adapters/talk", 16)
TABLE = AdapterTable([SQL, TALK], max_loras=4, max_lora_rank=16)


@pytest.fixture
def engine(tokenization) -> FakeEngine:
    return FakeEngine(tokenization.tokenizer.encode(" Hello there.", add_special_tokens=False), table=TABLE)


def _calls(app, *calls: tuple[str, str, dict | None, dict | None]) -> list[httpx.Response]:
    """(method, path, json body, headers) in order, on one client."""

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [await client.request(m, path, json=body, headers=headers) for m, path, body, headers in calls]

    return asyncio.run(run())


def _post(app, path, body, headers=None) -> httpx.Response:
    return _calls(app, ("POST", path, body, headers))[0]


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


# -- what a request's model picks ---------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "hi"})])
def test_an_adapters_name_sends_its_slot_and_is_echoed(make_app, engine, path, body):
    app = make_app(engine)
    whole = _post(app, path, {**body, "model": "talk"})
    streamed = _post(app, path, {**body, "model": "sql", "stream": True})
    assert whole.status_code == 200 and whole.json()["model"] == "talk"
    chunks = re.findall(r'"model":"([^"]+)"', streamed.text)
    assert chunks and set(chunks) == {"sql"}
    assert [r.adapter_slot for r in engine.requests] == [2, 1]


@pytest.mark.parametrize("model", ["smol", None])
def test_the_base_models_name_or_none_is_no_adapter(make_app, engine, model):
    body = {"prompt": "hi"} if model is None else {"prompt": "hi", "model": model}
    response = _post(make_app(engine), COMPLETIONS, body)
    assert response.status_code == 200 and response.json()["model"] == "smol"
    assert engine.requests[0].adapter_slot == 0


def test_an_unknown_model_is_404_after_one_more_look_at_the_engines_table(make_app, engine):
    app = make_app(engine)
    listed, refused = _calls(
        app, ("GET", "/v1/models", None, None), ("POST", CHAT, {"model": "nope", "messages": HI}, None)
    )
    assert listed.status_code == 200
    assert _error(refused, 404, "model")["code"] == "model_not_found"
    assert [c.op for c in engine.commands] == ["list", "list"]  # the copy, then once again
    assert engine.requests == []


def test_an_adapter_another_frontend_loaded_is_found_by_asking_again(make_app, engine):
    app = make_app(engine)
    assert _calls(app, ("GET", "/v1/models", None, None))[0].status_code == 200  # the copy: sql and talk
    engine.table = replace(TABLE, adapters=[*TABLE.adapters, AdapterInfo("new", 3, 3, "/adapters/new", 4)])
    response = _post(app, COMPLETIONS, {"model": "new", "prompt": "hi"})
    assert response.status_code == 200 and response.json()["model"] == "new"
    assert engine.requests[0].adapter_slot == 3


@pytest.mark.parametrize(
    ("model", "slot", "sent"),
    [("smol", -1, -1), (None, 2, 2), ("sql", 1, 1)],  # the active adapter; a slot by number; the same slot
)
def test_adapter_slot_sent_as_an_extension_field(make_app, engine, model, slot, sent):
    body = {"prompt": "hi", "adapter_slot": sent} | ({"model": model} if model else {})
    response = _post(make_app(engine), COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert engine.requests[0].adapter_slot == slot


def test_adapter_slot_naming_another_adapter_than_the_model_is_400(make_app, engine):
    response = _post(make_app(engine), COMPLETIONS, {"model": "sql", "prompt": "hi", "adapter_slot": 2})
    assert "sql" in _error(response, 400, "adapter_slot")["message"]
    assert engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_an_adapter_unloaded_before_admission_is_the_models_404(make_app, engine, stream):
    app = make_app(engine)
    assert _calls(app, ("GET", "/v1/models", None, None))[0].status_code == 200  # the copy lists sql
    engine.table = replace(TABLE, adapters=[TALK])  # the engine no longer has it
    response = _post(app, CHAT, {"model": "sql", "messages": HI, "stream": stream})
    assert _error(response, 404, "model")["code"] == "model_not_found"
    models = _calls(app, ("GET", "/v1/models", None, None))[0].json()["data"]
    assert [card["id"] for card in models] == ["smol", "talk"]  # the stale copy was dropped


def test_a_slot_sent_by_number_that_names_no_adapter_is_404_naming_it(make_app, engine):
    response = _post(make_app(engine), COMPLETIONS, {"prompt": "hi", "adapter_slot": 9})
    assert _error(response, 404, "adapter_slot")["code"] == "model_not_found"


# -- /v1/models -----------------------------------------------------------------------------


def test_models_list_the_base_model_then_each_adapter_with_its_parent_and_root(make_app, engine, tokenization):
    listed, one, base, missing = _calls(
        make_app(engine),
        ("GET", "/v1/models", None, None),
        ("GET", "/v1/models/talk", None, None),
        ("GET", "/v1/models/smol", None, None),
        ("GET", "/v1/models/nope", None, None),
    )
    cards = listed.json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("smol", None, "smol"),
        ("sql", "smol", "sql"),
        ("talk", "smol", "talk"),
    ]  # names, never the server's folders
    assert all(c["object"] == "model" and c["owned_by"] for c in cards)
    assert one.json() == cards[2] and base.json() == cards[0]
    assert _error(missing, 404, "model")["code"] == "model_not_found"


@pytest.mark.parametrize(
    "error",
    [model_refusal("adapter_command", "this server serves no LoRA adapters (MAX_LORAS=0)"), ModelUnavailable("down")],
)
def test_models_list_the_base_model_alone_while_the_engine_lists_no_adapters(make_app, engine, error):
    engine.command_error = error
    cards = _calls(make_app(engine), ("GET", "/v1/models", None, None))[0].json()["data"]
    assert [c["id"] for c in cards] == ["smol"]


def test_an_engine_that_serves_no_adapters_makes_any_other_name_a_404(make_app, engine):
    engine.command_error = model_refusal("adapter_command", "this server serves no LoRA adapters (MAX_LORAS=0)")
    response = _post(make_app(engine), COMPLETIONS, {"model": "sql", "prompt": "hi"})
    assert _error(response, 404, "model")["code"] == "model_not_found"


# -- runtime management ---------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [(LOAD, {"lora_name": "x", "lora_path": "/x"}), (UNLOAD, {}), (ACTIVE, {})])
def test_management_is_404_unless_allow_runtime_lora(make_app, engine, path, body):
    error = _error(_post(make_app(engine), path, body), 404)
    assert "ALLOW_RUNTIME_LORA=1" in error["message"]
    assert engine.commands == []


def test_load_use_reload_and_unload_an_adapter_at_run_time(make_app, engine):
    app = make_app(engine, ALLOW_RUNTIME_LORA=1)
    ask = ("POST", COMPLETIONS, {"model": "law", "prompt": "hi"}, None)
    loaded, used, reloaded, again, unloaded, gone = _calls(
        app,
        ("POST", LOAD, {"lora_name": "law", "lora_path": "/adapters/law"}, None),
        ask,
        ("POST", LOAD, {"lora_name": "law", "lora_path": "/adapters/law-v2"}, None),
        ask,
        ("POST", UNLOAD, {"lora_name": "law"}, None),
        ask,
    )
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'law' added successfully."
    assert used.json()["model"] == "law" and again.json()["model"] == "law"
    assert reloaded.status_code == 200  # a new version under the same name, not vLLM's 400
    assert [r.adapter_slot for r in engine.requests] == [3, 3]  # a name keeps its slot
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'law' removed successfully."
    assert _error(gone, 404, "model")["code"] == "model_not_found"
    assert [c.op for c in engine.commands] == ["load", "load", "unload", "list"]  # each answer replaced the copy


def test_the_active_adapter_is_what_adapter_slot_minus_one_follows(make_app, engine):
    app = make_app(engine, ALLOW_RUNTIME_LORA=1)
    follow = ("POST", COMPLETIONS, {"prompt": "hi", "adapter_slot": -1}, None)
    active, _, base, _, missing = _calls(
        app,
        ("POST", ACTIVE, {"lora_name": "talk"}, None),
        follow,
        ("POST", ACTIVE, {"lora_name": None}, None),
        follow,
        ("POST", ACTIVE, {"lora_name": "nope"}, None),
    )
    assert active.status_code == 200 and "'talk'" in active.text
    assert base.status_code == 200 and engine.table.active == ""
    assert [(c.op, c.lora_name) for c in engine.commands[:2]] == [("activate", "talk"), ("activate", "")]
    _error(missing, 404, "lora_name")
    metrics = _calls(app, ("GET", "/metrics", None, None))[0].text
    # the first ran on the active adapter, the second on the base model (not counted per adapter)
    assert 'llm_lora_requests_total{model_name="smol",lora_name="talk",finished_reason="length"} 1' in metrics
    assert 'lora_name=""' not in metrics


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (LOAD, {"lora_path": "/x"}, 400, "lora_name"),
        (LOAD, {"lora_name": "x"}, 400, "lora_path"),
        (LOAD, {"lora_name": "", "lora_path": "/x"}, 400, "lora_name"),
        (LOAD, {"lora_name": "smol", "lora_path": "/x"}, 400, "lora_name"),  # the base model's name
        (LOAD, {"lora_name": "x", "lora_path": "/x", "lora_int_id": 3}, 400, "lora_int_id"),
        (UNLOAD, {}, 400, "lora_name"),
        (UNLOAD, {"lora_name": "nope"}, 404, "lora_name"),
    ],
)
def test_a_bad_management_request_names_its_field(make_app, engine, path, body, status, param):
    response = _post(make_app(engine, ALLOW_RUNTIME_LORA=1), path, body)
    _error(response, status, param)
    assert engine.table == TABLE


def test_the_engines_refusal_of_a_load_is_400_with_its_message(make_app, engine):
    engine.command_error = model_refusal("lora_path", "no adapter_config.json in /x")
    response = _post(make_app(engine, ALLOW_RUNTIME_LORA=1), LOAD, {"lora_name": "x", "lora_path": "/x"})
    assert "no adapter_config.json" in _error(response, 400, "lora_path")["message"]


def test_with_keys_only_admin_tenants_may_manage_adapters(make_app, engine):
    app = make_app(engine, ALLOW_RUNTIME_LORA=1, API_KEYS=KEYS, ADMIN_TENANTS="carol, alice")
    body = {"lora_name": "law", "lora_path": "/adapters/law"}
    refused, nobody, allowed = _calls(
        app, ("POST", LOAD, body, BOB), ("POST", LOAD, body, None), ("POST", LOAD, body, ALICE)
    )
    error = _error(refused, 403)
    assert error["code"] == "insufficient_permissions" and "ADMIN_TENANTS" in error["message"]
    assert _error(nobody, 401)["code"] == "invalid_api_key"
    assert allowed.status_code == 200 and [c.op for c in engine.commands] == ["load"]


def test_management_takes_no_generation_slot_and_is_no_generation(make_app, engine):
    app = make_app(engine, ALLOW_RUNTIME_LORA=1, API_KEYS=KEYS, ADMIN_TENANTS="alice", TENANT_MAX_CONCURRENT=1)

    async def run():
        engine.hold = asyncio.Event()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            running = asyncio.ensure_future(client.post(CHAT, json={"messages": HI, "stream": True}, headers=ALICE))
            while not engine.requests:
                await asyncio.sleep(0.001)
            load = await client.post(LOAD, json={"lora_name": "law", "lora_path": "/law"}, headers=ALICE)
            engine.hold.set()
            await running
            return load, (await client.get("/metrics", headers=ALICE)).text

    load, metrics = asyncio.run(run())
    assert load.status_code == 200 and "x-ratelimit-limit-requests" not in load.headers
    assert 'llm_frontend_requests_total{endpoint="chat"} 1' in metrics
    assert app.state.limits.admission.inflight == 0


def test_a_management_body_over_max_request_bytes_is_413(make_app, engine):
    app = make_app(engine, ALLOW_RUNTIME_LORA=1, MAX_REQUEST_BYTES=200)
    response = _post(app, LOAD, {"lora_name": "x", "lora_path": "/" + "p" * 300})
    assert _error(response, 413)["code"] == "request_too_large"
    assert engine.commands == []


# -- per-adapter counters ----------------------------------------------------------------------


def test_generations_on_an_adapter_are_counted_under_its_name(make_app, engine):
    app = make_app(engine)
    responses = _calls(
        app,
        ("POST", COMPLETIONS, {"model": "sql", "prompt": "hi", "n": 2}, None),
        ("POST", COMPLETIONS, {"prompt": "hi"}, None),
        ("GET", "/metrics", None, None),
    )
    text, tokens = responses[-1].text, responses[0].json()["usage"]["completion_tokens"]
    assert 'llm_lora_requests_total{model_name="smol",lora_name="sql",finished_reason="length"} 2' in text
    assert f'llm_lora_generated_tokens_total{{model_name="smol",lora_name="sql"}} {tokens}' in text
    assert text.count("llm_lora_requests_total{") == 1  # the base model's is not counted there
