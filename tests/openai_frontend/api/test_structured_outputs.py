"""vLLM's structured outputs (api/structured.py), /tokenize and /detokenize (api/tokenize.py)
and return_token_ids, through the app on a fake engine and the default model's tokenizer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from backend.contract import FinishReason
from openai_frontend.api.structured import choice_grammar, ebnf_string
from openai_frontend.app import Settings, create_app
from tests.helpers.fake_engine import FakeEngine

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def app(tokenization):
    return create_app(Settings("unused", "smol"), tokenization=tokenization)


def _post(app, path: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, FakeEngine]:
    engine = FakeEngine([1, 2, 3], reason=FinishReason.STOP)
    app.state.serving.engine = engine

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body, headers=headers or {})

    return asyncio.run(run()), engine


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("path", "base", "form", "kind", "spec"),
    [
        ("/v1/chat/completions", {"messages": USER}, {"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ("/v1/completions", {"prompt": "x"}, {"structured_outputs": {"regex": r"\d{3}"}}, "regex", r"\d{3}"),
        ("/v1/chat/completions", {"messages": USER}, {"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
        ("/v1/completions", {"prompt": "x"}, {"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
        ("/v1/chat/completions", {"messages": USER}, {"structured_outputs": {"json": SCHEMA}}, "json_schema", None),
        ("/v1/chat/completions", {"messages": USER}, {"guided_choice": ["yes", "no"]}, "ebnf", 'root ::= "yes" | "no"'),
        ("/v1/completions", {"prompt": "x"}, {"structured_outputs": {"choice": ["a"]}}, "ebnf", 'root ::= "a"'),
        ("/v1/completions", {"prompt": "x"}, {"guided_grammar": 'root ::= "x"'}, "ebnf", 'root ::= "x"'),
        ("/v1/chat/completions", {"messages": USER}, {"structured_outputs": {"json_object": True}}, "json_object", ""),
        # response_format "text" constrains nothing: no conflict
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "text"}},
            {"guided_regex": "a"},
            "regex",
            "a",
        ),
        # vLLM's backend keys change nothing here
        (
            "/v1/completions",
            {"prompt": "x"},
            {"structured_outputs": {"regex": "a", "backend": "xgrammar"}},
            "regex",
            "a",
        ),
        (
            "/v1/completions",
            {"prompt": "x"},
            {"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
            "regex",
            "a",
        ),
    ],
)
def test_each_form_is_the_requests_grammar(app, path, base, form, kind, spec):
    response, engine = _post(app, path, {**base, **form})
    assert response.status_code == 200, response.text
    request = engine.requests[0]
    assert request.grammar_kind == kind
    if spec is not None:
        assert request.grammar_spec == spec


@pytest.mark.parametrize(
    ("path", "body", "param", "named"),
    [
        (
            "/v1/chat/completions",
            {"messages": USER, "guided_regex": "a", "guided_choice": ["a"]},
            "guided_choice",
            ["guided_regex", "guided_choice"],
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            ["response_format", "structured_outputs.regex"],
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs.choice",
            ["structured_outputs.regex", "structured_outputs.choice"],
        ),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"lark": "x"}}, "structured_outputs.lark", []),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {}}, "structured_outputs", []),
        ("/v1/completions", {"prompt": "x", "structured_outputs": "a"}, "structured_outputs", []),
        ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice", []),
        ("/v1/completions", {"prompt": "x", "guided_choice": ["a", 1]}, "guided_choice", []),
        ("/v1/completions", {"prompt": "x", "guided_json": "{not json"}, "guided_json", []),
        ("/v1/completions", {"prompt": "x", "guided_regex": ""}, "guided_regex", []),
        ("/v1/completions", {"prompt": "x", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", []),
        ("/v1/chat/completions", {"messages": USER, "guided_regex": "a", "tools": [TOOL]}, "guided_regex", []),
    ],
)
def test_bad_or_several_forms_are_a_400_naming_the_fields(app, path, body, param, named):
    response, engine = _post(app, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param) or error["message"].startswith(named[0]), error
    for name in named:
        assert name in error["message"]
    assert engine.requests == []


def test_an_engine_compile_failure_names_the_body_field(app):
    """The engine reports grammar_spec; the 400 names the field the grammar came from."""
    serving = app.state.serving
    chat = {"messages": USER}
    for body, param in [
        ({**chat, "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({**chat, "guided_grammar": "root ::="}, "guided_grammar"),
        ({**chat, "response_format": {"type": "json_object"}}, "response_format"),
    ]:
        from openai_frontend.api.chat_protocol import ChatCompletionRequest
        from openai_frontend.generation.engine_client import EngineError

        error = serving.error(ChatCompletionRequest(**body), EngineError("invalid regex grammar: ...", "grammar_spec"))
        assert error.param == param


@pytest.mark.parametrize(
    "choices",
    [
        ["yes", "no"],
        ['say "hi"', "back\\slash"],
        ["", "x"],
        ["new\nline", "tab\there"],
        ["é", "🙂 emoji", "a|b", "(x)"],
    ],
)
def test_a_choice_grammar_takes_exactly_the_choices(choices):
    grammar = xgr.Grammar.from_ebnf(choice_grammar("guided_choice", choices))
    for choice in choices:
        assert accepts(grammar, choice), choice
    for other in ("z", choices[0] + "x", choices[-1][:-1] if len(choices[-1]) > 1 else "zz"):
        if other not in choices:
            assert not accepts(grammar, other), other


def test_ebnf_string_escapes():
    assert ebnf_string('a"b\\c\n') == '"a\\"b\\\\c\\u000a"'


# --- /tokenize, /detokenize -------------------------------------------------


def test_tokenize_a_prompt_and_messages(app, tokenization):
    tokenizer = tokenization.tokenizer
    response, _ = _post(app, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer("Hello world")["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    response, _ = _post(app, "/tokenize", {"messages": USER, "model": "smol"})
    assert response.status_code == 200, response.text
    assert "token_strs" not in response.json()
    reference = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert response.json()["tokens"] == list(reference)
    response, _ = _post(app, "/detokenize", {"tokens": body["tokens"]})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": tokenizer.decode(body["tokens"])}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": USER}, None),
        ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
        ("/tokenize", {"prompt": 3}, "prompt"),
    ],
)
def test_tokenizer_routes_refuse_bad_input_naming_the_field(app, path, body, param):
    response, _ = _post(app, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_tokenizer_routes_404_another_model(app):
    response, _ = _post(app, "/tokenize", {"prompt": "a", "model": "nope"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_tokenizer_routes_need_the_api_key(tokenization):
    app = create_app(Settings.from_env({"API_KEYS": "sekret:team"}, "unused", "smol"), tokenization=tokenization)
    for path, body in [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})]:
        assert _post(app, path, body)[0].status_code == 401
        assert _post(app, path, body, {"Authorization": "Bearer sekret"})[0].status_code == 200


# --- return_token_ids ---------------------------------------------------------


def test_return_token_ids_on_chat_and_completions(app, tokenization):
    response, engine = _post(app, "/v1/chat/completions", {"messages": USER, "return_token_ids": True})
    body = response.json()
    assert body["prompt_token_ids"] == engine.requests[0].prompt_tokens
    assert body["choices"][0]["token_ids"] == [1, 2, 3]
    response, engine = _post(app, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "return_token_ids": True})
    choices = response.json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [r.prompt_tokens for r in engine.requests[::2] for _ in "ab"]
    assert all(c["token_ids"] == [1, 2, 3] for c in choices)
    plain, _ = _post(app, "/v1/completions", {"prompt": "a"})
    assert "token_ids" not in plain.json()["choices"][0] and "prompt_token_ids" not in plain.json()["choices"][0]


def _events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_return_token_ids_in_streams(app):
    response, engine = _post(app, "/v1/chat/completions", {"messages": USER, "stream": True, "return_token_ids": True})
    events = _events(response)
    assert events[0]["prompt_token_ids"] == engine.requests[0].prompt_tokens
    assert [t for e in events[1:] for c in e["choices"] for t in c.get("token_ids", [])] == [1, 2, 3]
    response, engine = _post(app, "/v1/completions", {"prompt": "a", "stream": True, "return_token_ids": True})
    choices = [c for e in _events(response) for c in e["choices"]]
    assert choices[0]["prompt_token_ids"] == engine.requests[0].prompt_tokens
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == [1, 2, 3]
