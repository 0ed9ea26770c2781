"""The endpoints' handlers, driven in-process through the app with a fake engine in place
of Triton: what reaches the engine (typed GenerationRequests) and what the client gets."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from backend import contract
from backend.contract import FinishReason
from openai_frontend.app import Settings, create_app
from openai_frontend.generation.engine_client import EngineError, ModelUnavailable
from tests.helpers.fake_engine import DEFAULT_INFO, FakeEngine, model_refusal

STOP = FinishReason.STOP


@pytest.fixture(scope="module")
def app(tokenization):
    return create_app(Settings("unused", "smol"), tokenization=tokenization)


def _client(app, engine):
    app.state.serving.engine = engine
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _answer_ids(tokenization, text):
    tok = tokenization.tokenizer
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


async def _post(app, engine, path, body):
    async with _client(app, engine) as client:
        return await client.post(path, json=body)


async def _get(app, engine, path):
    async with _client(app, engine) as client:
        return await client.get(path)


def _sse_payloads(text):
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_non_streaming(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "Paris is 🎉 nice."), reason=STOP)
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 200, response.text
    data = response.json()
    # `refusal` is required by OpenAI's spec: always there, null
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "Paris is 🎉 nice.", "refusal": None}
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == len(engine.token_ids)
    assert engine.requests[0].stream is False and engine.requests[0].sampling.temperature == 0


def test_chat_streaming_with_usage(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "Hello 你好 world"))
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = _sse_payloads(asyncio.run(_post(app, engine, "/v1/chat/completions", body)).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "Hello 你好 world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


def test_stop_string_cuts_and_cancels(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "one two three four five six"), pack_size=1)
    body = {"prompt": "count", "stop": [" three"], "stream": True}
    chunks = _sse_payloads(asyncio.run(_post(app, engine, "/v1/completions", body)).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "one two"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert engine.cancelled == 1 and engine.requests[0].stream is True


def test_stop_string_inside_a_pack_drops_the_later_tokens_and_their_logprobs(app, tokenization):
    ids = _answer_ids(tokenization, "one two three four five six")
    engine = FakeEngine(ids, pack_size=len(ids))  # all in one pack: the cut falls inside it
    body = {"prompt": "count", "stop": [" thr"], "logprobs": 1, "max_tokens": 20}
    choice_and_usage = asyncio.run(_post(app, engine, "/v1/completions", body)).json()
    choice = choice_and_usage["choices"][0]
    assert choice["text"] == "one two" and choice["finish_reason"] == "stop"
    # the logprobs run to the token that completed the stop string (" three"), as vLLM's
    assert choice["logprobs"]["tokens"] == ["one", " two", " three"]
    assert choice["logprobs"]["text_offset"] == [0, 3, 7]
    assert choice_and_usage["usage"]["completion_tokens"] == 3
    # streamed, the same
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse_payloads(asyncio.run(_post(app, FakeEngine(ids, pack_size=len(ids)), "/v1/completions", body)).text)
    assert all("error" not in chunk for chunk in chunks), chunks
    logprobs = [c["choices"][0]["logprobs"] for c in chunks[:-1] if c["choices"][0]["logprobs"]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "one two"
    assert [t for lp in logprobs for t in lp["tokens"]] == ["one", " two", " three"]
    assert [o for lp in logprobs for o in lp["text_offset"]] == [0, 3, 7]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 3


def test_model_refusal_becomes_400_naming_the_field(app):
    engine = FakeEngine([], error=model_refusal("dry_multiplier", "advanced samplers are not supported"))
    body = {"messages": [{"role": "user", "content": "hi"}], "dry_multiplier": 0.5, "stream": True}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "dry_multiplier"


USER_X = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {"model": "nope", "messages": USER_X}, 404, "model"),
        ("/v1/chat/completions", {"messages": USER_X, "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ],
)
def test_errors_have_the_openai_shape(app, path, body, status, param):
    response = asyncio.run(_post(app, FakeEngine([]), path, body))
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and "type" in error and "code" in error


@pytest.mark.parametrize(
    ("content", "content_type", "says"),
    [
        (b"{not json", "application/json", "not valid JSON"),
        (b'["a", "list"]', "application/json", "must be a JSON object"),
        (b'{"prompt": "hi"}', None, "Content-Type: application/json"),  # JSON, but not declared
        (b"", "application/json", "must be a JSON object"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_400_saying_so(app, content, content_type, says):
    async def run():
        async with _client(app, FakeEngine([])) as client:
            headers = {"content-type": content_type} if content_type else {}
            return await client.post("/v1/completions", content=content, headers=headers)

    response = asyncio.run(run())
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is None and says in error["message"], error


def test_engine_failure_is_500_with_an_error_id_and_no_internals(app, caplog):
    engine = FakeEngine([], error=EngineError("Triton request failed: connection refused"))
    response = asyncio.run(_post(app, engine, "/v1/completions", {"prompt": "hi"}))
    error = response.json()["error"]
    assert response.status_code == 500 and error["code"] == "internal_error"
    assert "connection refused" not in error["message"] and "Triton" not in error["message"]
    error_id = error["message"].split("error id ")[1].split(";")[0]
    logged = [r for r in caplog.records if error_id in r.getMessage()]  # the detail is in the log, under the id
    assert logged and "connection refused" in str(logged[0].exc_info[1])


def test_models_and_metrics(app, tokenization):
    async def run():
        async with _client(app, FakeEngine([])) as client:
            return await client.get("/v1/models"), await client.get("/metrics"), await client.get("/health")

    models_response, metrics_response, health = asyncio.run(run())
    assert models_response.json()["data"][0]["id"] == "smol"
    assert "llm_frontend_completion_tokens_total" in metrics_response.text
    assert health.status_code == 200


def test_chat_logprobs_map_to_the_openai_shape(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "Paris is nice."), reason=STOP)
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    data = asyncio.run(_post(app, engine, "/v1/chat/completions", body)).json()
    content = data["choices"][0]["logprobs"]["content"]
    sampling = engine.requests[0].sampling
    assert sampling.logprobs is True and sampling.top_logprobs == 2
    assert len(content) == len(engine.token_ids)  # the fake sends EOS too
    first = engine.token_ids[0]
    token = tokenization.token_text(first)
    assert content[0]["token"] == token and content[0]["bytes"] == list(token.encode())
    assert content[0]["logprob"] == -first / 1000 and len(content[0]["top_logprobs"]) == 2


def test_completions_echo_streams_the_prompt_and_its_logprobs_first(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "one two three"), pack_size=1)
    body = {"prompt": "count:", "echo": True, "logprobs": 1, "stream": True}
    chunks = _sse_payloads(asyncio.run(_post(app, engine, "/v1/completions", body)).text)
    assert chunks[0]["choices"][0]["text"].startswith("count:")
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    values = [v for lp in logprobs for v in lp["token_logprobs"]]
    offsets = [o for lp in logprobs for o in lp["text_offset"]]
    prompt_len = len(engine.requests[0].prompt_tokens)
    assert values[0] is None and len(values) == prompt_len + len(engine.token_ids)
    assert offsets == sorted(offsets) and logprobs[0]["top_logprobs"][0] is None
    # the prompt's positions carry as many alternatives as the generated tokens (and the token)
    assert engine.requests[0].sampling.prompt_logprobs == 1
    tops = [top for lp in logprobs for top in lp["top_logprobs"]]
    assert all(len(top) == 2 for top in tops[1:prompt_len])
    # each token's text begins at its offset in the echoed text (but the fake's EOS,
    # which is sent as a token and has no text)
    tokens = [t for lp in logprobs for t in lp["tokens"]][:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert all(text.startswith(token, offset) for token, offset in zip(tokens, offsets, strict=False))


# ---------------------------------------------------------------------------
# n choices


def test_n_choices_non_streaming(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "Paris is nice."), reason=STOP)
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 7, "logprobs": True}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Paris is nice." and c["finish_reason"] == "stop" for c in data["choices"])
    assert all(len(c["logprobs"]["content"]) == len(engine.token_ids) for c in data["choices"])
    assert sorted(r.sampling.seed for r in engine.requests) == [7, 8, 9]
    prompt_tokens = len(engine.requests[0].prompt_tokens)
    usage = data["usage"]
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 3 * len(engine.token_ids)
    assert usage["total_tokens"] == prompt_tokens + 3 * len(engine.token_ids)


def test_n_choices_without_seed_send_none(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "ok"))
    data = asyncio.run(_post(app, engine, "/v1/completions", {"prompt": "hi", "n": 2})).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert [r.sampling.seed for r in engine.requests] == [None, None]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_choices_streaming(app, tokenization, path):
    engine = FakeEngine(_answer_ids(tokenization, "Hello 你好 world"), pack_size=1)
    body = {"n": 3, "stream": True, "stream_options": {"include_usage": True}, "stop": [" world"]}
    chat = path == "/v1/chat/completions"
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    chunks = _sse_payloads(asyncio.run(_post(app, engine, path, body)).text)
    assert chunks[-1]["choices"] == [] and all(c["choices"] for c in chunks[:-1])
    # each choice stopped at " world", its last token before EOS
    assert chunks[-1]["usage"]["completion_tokens"] == 3 * (len(engine.token_ids) - 1)
    texts, finishes, roles = {}, {}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        index = choice["index"]
        if chat and "role" in choice["delta"]:
            roles.append(index)
        piece = choice["delta"].get("content", "") if chat else choice["text"]
        texts[index] = texts.get(index, "") + piece
        if choice["finish_reason"]:
            finishes[index] = choice["finish_reason"]
    assert roles == ([0, 1, 2] if chat else [])
    assert texts == {i: "Hello 你好" for i in range(3)}  # the stop string cuts each choice
    assert finishes == {i: "stop" for i in range(3)}
    assert engine.cancelled == 3


def test_n_choices_refusal_is_400(app):
    engine = FakeEngine([], error=model_refusal("dry_multiplier", "advanced samplers are not supported"))
    body = {"prompt": "hi", "n": 2, "dry_multiplier": 0.5, "stream": True}
    response = asyncio.run(_post(app, engine, "/v1/completions", body))
    assert response.status_code == 400 and response.json()["error"]["param"] == "dry_multiplier"


@pytest.mark.parametrize("n", [0, 9])
def test_n_out_of_range_is_400(app, n):
    response = asyncio.run(_post(app, FakeEngine([]), "/v1/completions", {"prompt": "hi", "n": n}))
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


# ---------------------------------------------------------------------------
# tool calling and structured output through the app (fake engine)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chat_body(**extra):
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], **extra}


def test_tool_call_comes_back_as_tool_calls(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, CALL_TEXT), reason=STOP)
    data = asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body())).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    request = engine.requests[0]
    assert request.guards.tools_present is True and request.grammar_kind == "structural_tag"
    assert request.guards.require_tool_call is False  # "auto": text may come instead
    assert "require_tool_call" not in contract.encode_request(request)
    # the default model's template has no tools section: the tools went into the system prompt
    prompt = tokenization.tokenizer.decode(request.prompt_tokens)
    assert "get_weather" in prompt and "<tool_call>" in prompt


@pytest.mark.parametrize("pack_size", [1, 3, 100])
def test_streamed_tool_call_deltas_add_up_to_the_whole_call(app, tokenization, pack_size):
    engine = FakeEngine(_answer_ids(tokenization, CALL_TEXT), pack_size=pack_size, reason=STOP)
    chunks = _sse_payloads(asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body(stream=True))).text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert content == "Let me look."
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert all(tc["index"] == 0 for tc in calls)
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_required_and_named_force_a_call(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, CALL_TEXT), reason=STOP)
    asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body(tool_choice="required")))
    named = {"type": "function", "function": {"name": "get_weather"}}
    asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body(tool_choice=named)))
    asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body(tool_choice="none")))
    required, forced, none = engine.requests
    assert required.guards.require_tool_call is True and forced.guards.require_tool_call is True
    assert required.grammar_spec != forced.grammar_spec
    assert none.grammar_kind == "" and none.guards.tools_present is False
    sent = contract.encode_request(none)
    assert "grammar_kind" not in sent and "tools_present" not in sent


def test_a_repeated_tool_call_is_suppressed(app, tokenization):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    for i in range(3):
        turns.append({"role": "assistant", "content": None, "tool_calls": [{**call, "id": f"call_{i}"}]})
        turns.append({"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny"})
    engine = FakeEngine(_answer_ids(tokenization, "It is sunny."), reason=STOP)
    body = {"messages": turns, "tools": [WEATHER]}
    data = asyncio.run(_post(app, engine, "/v1/chat/completions", body)).json()
    assert data["choices"][0]["message"]["content"] == "It is sunny."
    assert engine.requests[0].guards.suppress_tool_call is True
    # the earlier calls were written back into the assistant turns, in the call format
    prompt = tokenization.tokenizer.decode(engine.requests[0].prompt_tokens)
    assert prompt.count('"name": "get_weather", "arguments": {"city": "Paris"}') == 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_bad_tools_and_formats_are_400_naming_the_field(app, extra, param):
    engine = FakeEngine([])
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.requests == []


def test_response_format_travels_as_a_grammar(app, tokenization):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine = FakeEngine(_answer_ids(tokenization, '{"a": 1}'), reason=STOP)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    data = asyncio.run(_post(app, engine, "/v1/chat/completions", body)).json()
    assert data["choices"][0]["message"]["content"] == '{"a": 1}'
    request = engine.requests[0]
    assert request.grammar_kind == "json_schema" and json.loads(request.grammar_spec) == schema
    asyncio.run(_post(app, engine, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}}))
    assert engine.requests[1].grammar_kind == "json_object"


def test_response_format_with_tools_lets_the_model_call_or_answer_in_the_format(app, tokenization):
    """pydantic-ai sends both whenever an agent has a tool and a structured output."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine = FakeEngine(_answer_ids(tokenization, '{"a": 1}'), reason=STOP)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "response_format": fmt}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    request = engine.requests[0]
    assert request.grammar_kind == "structural_tag" and request.guards.tools_present
    calls_or_answer = json.loads(request.grammar_spec)["format"]
    assert calls_or_answer["type"] == "or"
    assert {"type": "json_schema", "json_schema": schema} in calls_or_answer["elements"]


def test_a_grammar_the_model_refuses_is_400_naming_response_format(app):
    engine = FakeEngine([], error=model_refusal("grammar_spec", "xgrammar cannot compile this schema"))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


# ---------------------------------------------------------------------------
# the running model's facts (ModelInfo), asked of the engine

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def _fresh_app(tokenization):
    """An app that has not asked any engine for the model's facts yet."""
    return create_app(Settings("unused", "smol"), tokenization=tokenization)


def test_the_context_check_uses_the_running_models_max_model_len(tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "ok"), info=replace(DEFAULT_INFO, max_model_len=64))
    app = _fresh_app(tokenization)
    over = asyncio.run(_post(app, engine, COMPLETIONS, {"prompt": [1] * 40, "max_tokens": 30}))
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["param"] == "max_tokens" and all(str(n) in error["message"] for n in (64, 70, 40, 30)), error
    prompt_only = asyncio.run(_post(app, engine, COMPLETIONS, {"prompt": [1] * 64, "max_tokens": 1}))
    assert prompt_only.status_code == 400 and prompt_only.json()["error"]["param"] == "prompt"
    chat = asyncio.run(_post(app, engine, CHAT, {"messages": HI, "max_completion_tokens": 64}))
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"
    assert engine.requests == []
    fits = asyncio.run(_post(app, engine, COMPLETIONS, {"prompt": [1] * 40, "max_tokens": 24}))
    assert fits.status_code == 200, fits.text
    assert len(engine.requests) == 1 and engine.requests[0].sampling.max_tokens == 24
    assert engine.model_info_calls == 1  # asked once, then kept
    models = asyncio.run(_get(app, engine, "/v1/models")).json()
    assert models["data"][0]["max_model_len"] == 64


def test_the_models_sampling_defaults_fill_only_what_a_chat_request_leaves_unset(tokenization):
    defaults = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
    engine = FakeEngine(
        _answer_ids(tokenization, "ok"), reason=STOP, info=replace(DEFAULT_INFO, sampling_defaults=defaults)
    )
    app = _fresh_app(tokenization)
    for path, body in (
        (CHAT, {"messages": HI}),
        (CHAT, {"messages": HI, "temperature": 0, "top_k": -1}),
        (COMPLETIONS, {"prompt": "hi"}),
    ):
        response = asyncio.run(_post(app, engine, path, body))
        assert response.status_code == 200, response.text
    unset, partly, completion = (request.sampling for request in engine.requests)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.3, 0.8, 20, 1.1)
    # the body's own values win, a temperature of 0 and vLLM's top_k -1 (off) included
    assert (partly.temperature, partly.top_p, partly.top_k, partly.repetition_penalty) == (0.0, 0.8, 0, 1.1)
    # the defaults are the chat requests' only
    assert (completion.temperature, completion.top_p, completion.top_k) == (1.0, 1.0, 0)
    assert completion.repetition_penalty == 1.0


class _ModelDown(FakeEngine):
    async def model_info(self):
        raise ModelUnavailable("Triton is unavailable: connection refused")


def test_a_model_whose_facts_are_unavailable_is_503_and_is_asked_again(tokenization):
    app = _fresh_app(tokenization)
    down = _ModelDown(_answer_ids(tokenization, "ok"))
    response = asyncio.run(_post(app, down, COMPLETIONS, {"prompt": "hi"}))
    assert response.status_code == 503 and response.headers["retry-after"].isdigit()
    assert down.requests == []
    engine = FakeEngine(_answer_ids(tokenization, "ok"))
    assert asyncio.run(_post(app, engine, COMPLETIONS, {"prompt": "hi"})).status_code == 200
    assert engine.model_info_calls == 1


THINKING = replace(DEFAULT_INFO, think_start="<think>", think_end="</think>")
THOUGHT = "plan</think>\n\nanswer"


@pytest.mark.parametrize(
    ("starts_in_thinking", "reasoning", "content"), [(True, "plan", "answer"), (None, None, THOUGHT)]
)
def test_the_engine_says_whether_the_output_starts_inside_thinking(
    tokenization, starts_in_thinking, reasoning, content
):
    """The prompt is not read for an opened block: the engine's first output says so."""
    app = _fresh_app(tokenization)

    def engine():
        ids = _answer_ids(tokenization, THOUGHT)
        return FakeEngine(ids, pack_size=1, reason=STOP, info=THINKING, starts_in_thinking=starts_in_thinking)

    whole = asyncio.run(_post(app, engine(), CHAT, {"messages": HI})).json()
    message = whole["choices"][0]["message"]
    assert (message.get("reasoning_content"), message["content"]) == (reasoning, content)
    chunks = _sse_payloads(asyncio.run(_post(app, engine(), CHAT, {"messages": HI, "stream": True})).text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed = ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas))
    assert streamed == (reasoning or "", content)
