"""Tenants, API keys, limits and admission in the frontend, driven in-process.

No servers: the app runs with a fake engine in place of Triton; one that can hold a
request mid-generation shows what happens while requests are in flight.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from backend import contract
from openai_frontend.operations.admission import Admission
from openai_frontend.operations.auth import KeyConfigError, KeyRing
from openai_frontend.operations.limits import TenantLimits
from tests.helpers.fake_engine import DEFAULT_INFO, FakeEngine, model_refusal

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
KEYS = "key-alice:alice,key-bob:bob"
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
LONG_PART = {"type": "text", "text": "z" * 101}


@pytest.fixture
def engine(tokenization) -> FakeEngine:
    """Sends one token at a time; a test that sets `engine.hold` keeps it after the first."""
    return FakeEngine(tokenization.tokenizer.encode(" Hello there, friend.", add_special_tokens=False), pack_size=1)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _post(app, path, body, headers=None) -> httpx.Response:
    async def run():
        async with _client(app) as client:
            return await client.post(path, json=body, headers=headers)

    return asyncio.run(run())


async def _until(condition) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return error


# ---------------------------------------------------------------------------
# API keys


def test_keys_come_from_the_file_and_the_list_merged(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# key tenant\n\nkey-a alice   # the first\nkey-b  bob\n")
    ring = KeyRing.from_env({"API_KEYS_FILE": str(keys_file), "API_KEYS": " key-c:carol , key-a:alice "})
    assert [ring.tenant(f"Bearer key-{k}") for k in "abc"] == ["alice", "bob", "carol"]
    assert ring.tenant("bearer key-b") == "bob"
    assert KeyRing.from_env({}).tenant(None) == ""


@pytest.mark.parametrize(
    ("content", "api_keys", "error"),
    [
        ("# only a comment\n", "", "holds no keys"),
        ("key-a alice extra\n", "", ":1: expected `key tenant`"),
        ("key-a alice\n", "key-a:bob", "two tenants"),
        ("key-a alice\n", "no-tenant", "key:tenant"),
    ],
)
def test_a_bad_key_configuration_stops_the_start(tmp_path, content, api_keys, error):
    keys_file = tmp_path / "keys"
    keys_file.write_text(content)
    with pytest.raises(KeyConfigError, match=error):
        KeyRing.from_env({"API_KEYS_FILE": str(keys_file), "API_KEYS": api_keys})


@pytest.mark.parametrize("authorization", [None, "Bearer nope", "Basic key-alice", "Bearer ", "key-alice"])
def test_v1_without_a_valid_key_is_401(make_app, engine, authorization):
    app = make_app(engine, API_KEYS=KEYS)
    headers = {"Authorization": authorization} if authorization is not None else {}

    async def run():
        async with _client(app) as client:
            return await client.post(CHAT, json={"messages": HI}, headers=headers), await client.get(
                "/v1/models", headers=headers
            )

    chat, models = asyncio.run(run())
    assert _assert_error(chat, 401)["code"] == "invalid_api_key"
    _assert_error(models, 401)
    assert engine.requests == []


def test_health_stays_open_and_metrics_take_a_key_unless_public(make_app, engine):
    async def run(app, headers):
        async with _client(app) as client:
            await client.get("/v1/models")
            return await client.get("/health"), await client.get("/metrics", headers=headers)

    health, metrics = asyncio.run(run(make_app(engine, API_KEYS=KEYS), ALICE))
    assert health.status_code == 200 and metrics.status_code == 200
    assert 'status="401"} 1' in metrics.text  # the refusal was counted
    _, keyless = asyncio.run(run(make_app(engine, API_KEYS=KEYS), {}))
    assert _assert_error(keyless, 401)["code"] == "invalid_api_key"  # tenant names and usage are not public
    _, public = asyncio.run(run(make_app(engine, API_KEYS=KEYS, METRICS_PUBLIC=1), {}))
    assert public.status_code == 200 and "llm_frontend_requests_total" in public.text


def test_the_tenant_of_the_key_reaches_the_model_and_no_field_overrides_it(make_app, engine):
    app = make_app(engine, API_KEYS=KEYS)
    assert _post(app, CHAT, {"messages": HI, "max_tokens": 5, "user": "bob"}, ALICE).status_code == 200
    assert _post(app, COMPLETIONS, {"prompt": "hi"}, BOB).status_code == 200
    for path, body, key in (
        (CHAT, {"messages": HI, "lookup_tenant": "bob"}, ALICE),
        (COMPLETIONS, {"prompt": "hi", "lookup_tenant": "alice"}, BOB),
    ):
        refused = _post(app, path, body, key)  # the contract's own name for it: refused, not used
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lookup_tenant"
    assert [r.lookup_tenant for r in engine.requests] == ["alice", "bob"]
    assert [contract.encode_request(r)["lookup_tenant"].tolist() for r in engine.requests] == [[b"alice"], [b"bob"]]


def test_an_open_server_runs_everyone_as_one_tenant(make_app, engine):
    app = make_app(engine)
    assert _post(app, CHAT, {"messages": HI}, {"Authorization": "Bearer anything"}).status_code == 200
    assert engine.requests[0].lookup_tenant == ""
    assert "lookup_tenant" not in contract.encode_request(engine.requests[0])


# ---------------------------------------------------------------------------
# input limits


def test_a_body_over_max_request_bytes_is_413_declared_or_not(make_app, engine):
    app = make_app(engine, MAX_REQUEST_BYTES=1000)
    body = {"messages": [{"role": "user", "content": "x" * 2000}]}

    async def chunks():
        payload = json.dumps(body).encode()
        for i in range(0, len(payload), 300):
            yield payload[i : i + 300]

    async def run():
        async with _client(app) as client:
            declared = await client.post(CHAT, json=body)
            # no Content-Length: the size is counted as the body arrives
            streamed = await client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
            return declared, streamed

    declared, streamed = asyncio.run(run())
    assert "content-length" not in streamed.request.headers
    for response in (declared, streamed):
        assert _assert_error(response, 413)["code"] == "request_too_large"
    assert engine.requests == [] and app.state.limits.admission.inflight == 0
    assert _post(app, CHAT, {"messages": HI}).status_code == 200


def test_prompt_and_max_tokens_beyond_the_context_are_400_with_the_numbers(make_app, engine):
    app = make_app(engine)
    error = _assert_error(_post(app, COMPLETIONS, {"prompt": [1] * 8000, "max_tokens": 500}), 400, "max_tokens")
    assert all(str(n) in error["message"] for n in (8192, 8500, 8000, 500))
    _assert_error(_post(app, COMPLETIONS, {"prompt": [1] * 8192, "max_tokens": 1}), 400, "prompt")
    chat = {"messages": HI, "max_completion_tokens": 8192}
    _assert_error(_post(app, CHAT, chat), 400, "max_completion_tokens")
    assert engine.requests == []
    assert _post(app, COMPLETIONS, {"prompt": [1] * 8000, "max_tokens": 192}).status_code == 200


def test_max_model_len_caps_the_context_below_the_models(make_app, engine):
    """The engine's context (ModelInfo.max_model_len: the model's, capped by MAX_MODEL_LEN)
    is the frontend's context too."""
    engine.info = replace(DEFAULT_INFO, max_model_len=1024)
    app = make_app(engine)
    error = _assert_error(_post(app, COMPLETIONS, {"prompt": [1] * 1000, "max_tokens": 100}), 400, "max_tokens")
    assert all(str(n) in error["message"] for n in (1024, 1100, 1000, 100))
    assert engine.requests == []
    assert _post(app, COMPLETIONS, {"prompt": [1] * 1000, "max_tokens": 24}).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": HI * 4}, "messages"),
        (CHAT, {"messages": [*HI, {"role": "user", "content": "y" * 101}]}, "messages.1.content"),
        (CHAT, {"messages": [{"role": "user", "content": [LONG_PART]}]}, "messages.0.content.0.text"),
        (COMPLETIONS, {"prompt": "p" * 101}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "stop": ["ok", "s" * 101]}, "stop.1"),
    ],
)  # fmt: skip
def test_too_many_messages_or_a_too_long_string_is_400_naming_the_field(make_app, engine, path, body, param):
    app = make_app(engine, MAX_MESSAGES=3, MAX_STRING_CHARS=100)
    _assert_error(_post(app, path, body), 400, param)
    assert engine.requests == []


# ---------------------------------------------------------------------------
# per-tenant limits


def test_a_tenant_over_its_concurrency_gets_429_with_headers_others_do_not(make_app, engine):
    app = make_app(engine, API_KEYS=KEYS, TENANT_MAX_CONCURRENT=1)

    async def run():
        engine.hold = asyncio.Event()
        async with _client(app) as client:
            first = asyncio.ensure_future(client.post(CHAT, json={"messages": HI, "stream": True}, headers=ALICE))
            await _until(lambda: engine.requests)
            refused = await client.post(CHAT, json={"messages": HI}, headers=ALICE)
            other = asyncio.ensure_future(client.post(CHAT, json={"messages": HI}, headers=BOB))
            await _until(lambda: len(engine.requests) == 2)
            engine.hold.set()
            done = await first, await other
            again = await client.post(CHAT, json={"messages": HI}, headers=ALICE)
            return refused, done, again

    refused, done, again = asyncio.run(run())
    error = _assert_error(refused, 429)
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert [r.status_code for r in done] == [200, 200] and again.status_code == 200
    # an admitted request's response tells how many slots were left while it ran
    assert again.headers["x-ratelimit-remaining-requests"] == "0"
    assert app.state.limits.tenants._tenants["alice"].running == 0


def test_tokens_per_minute_reserve_max_tokens_and_settle_on_usage(make_app, engine, tokenization):
    app = make_app(engine, API_KEYS=KEYS, TENANT_TOKENS_PER_MINUTE=1000)
    prompt = [1] * 100

    body = {"prompt": prompt, "max_tokens": 700}
    first = _post(app, COMPLETIONS, body, ALICE)
    assert first.status_code == 200
    assert first.json()["usage"]["total_tokens"] == 100 + len(engine.token_ids)
    remaining = int(first.headers["x-ratelimit-remaining-tokens"])
    assert 200 <= remaining <= 210  # at its start the response still held its 800
    # then its usage (~106) was charged instead of the 800: 800 more fit, but not twice
    assert _post(app, COMPLETIONS, body, ALICE).status_code == 200
    refused = _post(app, COMPLETIONS, body, ALICE)
    error = _assert_error(refused, 429)
    assert error["type"] == "tokens" and "try again in" in error["message"]
    headers = refused.headers
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert int(headers["x-ratelimit-remaining-tokens"]) < 800
    assert headers["x-ratelimit-reset-tokens"].endswith("s") and int(headers["retry-after"]) >= 1
    # another tenant has its own bucket
    assert _post(app, COMPLETIONS, body, BOB).status_code == 200


def test_a_request_larger_than_the_bucket_waits_for_a_full_bucket_then_runs():
    now = [0.0]
    limits = TenantLimits(0, 600, clock=lambda: now[0])
    assert limits.reserve("t", 5000) == 600  # capped: never refused for good
    limits.credit("t", 600 - 1200)  # it used 1200: the bucket is in debt
    with pytest.raises(Exception) as refused:
        limits.reserve("t", 100)
    assert refused.value.headers["retry-after"] == str(70)  # (100 + 600) tokens at 10 per second
    now[0] = 70.0
    assert limits.reserve("t", 100) == 100
    assert limits.headers("t")["x-ratelimit-reset-tokens"] == "60s"  # empty again: 600 at 10 per second


# ---------------------------------------------------------------------------
# admission and releasing the slots


def test_past_inflight_and_queue_503_at_once_and_admitted_requests_all_finish(make_app, engine):
    app = make_app(engine, MAX_INFLIGHT_REQUESTS=1, MAX_QUEUED_REQUESTS=1)
    admission = app.state.limits.admission

    async def run():
        engine.hold = asyncio.Event()
        async with _client(app) as client:
            running = asyncio.ensure_future(client.post(CHAT, json={"messages": HI}))
            await _until(lambda: engine.requests)
            queued = asyncio.ensure_future(client.post(CHAT, json={"messages": HI, "stream": True}))
            await _until(lambda: admission.queued == 1)
            refused = await client.post(COMPLETIONS, json={"prompt": "hi"})
            engine.hold.set()
            return refused, await running, await queued

    refused, running, queued = asyncio.run(run())
    error = _assert_error(refused, 503)
    assert error["type"] == "server_error" and refused.headers["retry-after"] == "1"
    assert running.status_code == 200 and running.json()["choices"][0]["message"]["content"]
    assert queued.status_code == 200 and queued.text.endswith("data: [DONE]\n\n")
    assert len(engine.requests) == 2 and admission.inflight == 0 and admission.queued == 0


def test_a_waiter_that_leaves_the_queue_passes_its_turn_on():
    async def run():
        admission = Admission(1, 2)
        await admission.enter()
        second = asyncio.ensure_future(admission.enter())
        third = asyncio.ensure_future(admission.enter())
        await _until(lambda: admission.queued == 2)
        second.cancel()
        admission.leave()  # its slot goes to the third, past the one that left
        await third
        assert admission.inflight == 1 and admission.queued == 0
        admission.leave()
        return admission.inflight

    assert asyncio.run(run()) == 0


def _scope(path: str, payload: bytes, headers: dict[str, str]) -> dict:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": raw, "server": ("test", 80), "client": ("127.0.0.1", 1234),
    }  # fmt: skip


def test_a_client_that_leaves_mid_stream_frees_its_slots_and_cancels_the_model(make_app, engine):
    app = make_app(engine, API_KEYS=KEYS, TENANT_MAX_CONCURRENT=1, TENANT_TOKENS_PER_MINUTE=100_000)
    payload = json.dumps({"messages": HI, "stream": True, "max_tokens": 50}).encode()

    async def run():
        """As a server would: the body, then, once the first event is out, a disconnect."""
        engine.hold = asyncio.Event()  # never set: the generation waits until cancelled
        began = asyncio.Event()
        body = [{"type": "http.request", "body": payload, "more_body": False}]
        sent = []

        async def receive():
            if body:
                return body.pop()
            await began.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                began.set()

        await asyncio.wait_for(app(_scope(CHAT, payload, ALICE), receive, send), 10)
        return sent

    sent = asyncio.run(run())
    assert sent[0]["status"] == 200 and engine.cancelled == 1
    limits = app.state.limits
    assert limits.admission.inflight == 0 and limits.tenants._tenants["alice"].running == 0
    # the reservation stands: the model may have spent it
    assert limits.tenants._tenants["alice"].bucket.level <= 100_000 - 50
    engine.hold = None
    assert _post(app, CHAT, {"messages": HI}, ALICE).status_code == 200


def test_a_request_the_model_refuses_gives_its_tokens_back(make_app, engine):
    app = make_app(engine, API_KEYS=KEYS, TENANT_TOKENS_PER_MINUTE=1000)
    body = {"messages": HI, "max_tokens": 900, "dry_multiplier": 0.5}
    engine.error = model_refusal("dry_multiplier", "advanced samplers are not supported")
    _assert_error(_post(app, CHAT, body, ALICE), 400, "dry_multiplier")
    engine.error = None
    assert _post(app, CHAT, body, ALICE).status_code == 200
