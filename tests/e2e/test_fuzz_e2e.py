"""Fuzzing the frontend (schemathesis) over every route and field: from its own OpenAPI
schema (/openapi.json: every operation, the token, Responses, Anthropic and LoRA routes
included) and from OpenAI's published spec for the routes the two share
(tests/helpers/openai_spec.json). Valid and invalid bodies, a few thousand cases in all.

Every case must get an answer that is not a 5xx, within a per-request timeout (a hung
connection fails the case), and the server must answer a plain chat request afterwards.
Generated bodies keep their shape; only token counts (`max_tokens`,
`max_completion_tokens`, `max_output_tokens`) and `n` values that the server would
accept are shrunk (and a missing count is set), so the CPU model answers in
milliseconds while every validation path stays exercised: a value the server must
refuse (0, -3, "x", 10**30, more than the context) is sent as generated.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from launcher import Stack
from openai_frontend.api.protocol import MAX_CHOICES as SERVER_MAX_CHOICES
from tests.helpers.openai_spec import spec as openai_spec

pytestmark = pytest.mark.e2e

# Random cases per operation (FUZZ_CASES), besides schemathesis's coverage phase: boundary
# and wrong-type values for every field, up to ~400 cases per operation, most of them 400s.
# Each accepted case runs the model.
CASES_PER_ENDPOINT = int(os.environ.get("FUZZ_CASES", "40"))
REQUEST_TIMEOUT_S = 30  # no byte for this long: the connection hung
MAX_TOKENS = 2  # what an accepted max_tokens becomes
MAX_CHOICES = 2  # what an accepted n becomes
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# the generation routes (under /v1) and the count a body without one gets
GENERATION_COUNTS = {"/chat/completions": "max_tokens", "/completions": "max_tokens", "/responses": "max_output_tokens"}


@pytest.fixture(scope="module")
def fuzz_stack(triton_only, model_path):
    """A frontend of its own on the session's tritonserver: the fuzz leaves the shared
    frontend's counters and rate limits alone."""
    with Stack(model_path, triton=triton_only) as running:
        yield running


@pytest.fixture(scope="module")
def max_model_len(fuzz_stack) -> int:
    card = httpx.get(f"{fuzz_stack.base_url}/models", timeout=10).json()["data"][0]
    return card["max_model_len"]


def _configured(loaded, base_url: str):
    loaded.config.update(base_url=base_url)
    loaded.config.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
        max_examples=CASES_PER_ENDPOINT,
    )
    return loaded


@pytest.fixture(scope="module")
def frontend_schema(fuzz_stack):
    """Every operation of the schema the frontend serves."""
    root = fuzz_stack.base_url.removesuffix("/v1")
    return _configured(schemathesis.openapi.from_url(f"{root}/openapi.json"), root)


@pytest.fixture(scope="module")
def openai_schema(fuzz_stack):
    """OpenAI's published spec, for the routes the frontend shares with it (under /v1)."""
    return _configured(schemathesis.openapi.from_dict(_requests_only(openai_spec())), fuzz_stack.base_url)


def _requests_only(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with each operation's responses cut to a bare 200: only requests are
    generated from it (the vendored part leaves out the error responses' components, and
    the bodies are checked against it in test_openai_spec_e2e.py)."""
    spec = copy.deepcopy(spec)
    for operations in spec["paths"].values():
        for operation in operations.values():
            if isinstance(operation, dict) and "responses" in operation:
                operation["responses"] = {"200": {"description": "checked elsewhere"}}
    return spec


schema = schemathesis.pytest.from_fixture("frontend_schema")
openai_routes = schemathesis.pytest.from_fixture("openai_schema")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bounded(body: Any, path: str, max_model_len: int) -> Any:
    """The body with accepted token counts and `n` made small; anything the server must
    refuse is left as generated, so validation still sees it. A generation's missing
    count is set (chat's default is what the context leaves); other routes' bodies are
    left as they are."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in TOKEN_FIELDS:
        if _is_int(body.get(key)) and 1 <= body[key] <= max_model_len:
            body[key] = min(body[key], MAX_TOKENS)
    count = GENERATION_COUNTS.get(path.removeprefix("/v1"))
    if count is not None and all(body.get(key) is None for key in TOKEN_FIELDS):
        body[count] = MAX_TOKENS
    if _is_int(body.get("n")) and 1 <= body["n"] <= SERVER_MAX_CHOICES:
        body["n"] = min(body["n"], MAX_CHOICES)
    return body


def _no_server_error(case, max_model_len) -> None:
    case.body = bounded(case.body, case.path, max_model_len)
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=[not_a_server_error])


@schema.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_no_hang(case, max_model_len):
    _no_server_error(case, max_model_len)


@openai_routes.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_openais_spec_finds_no_server_error_and_no_hang(case, max_model_len):
    _no_server_error(case, max_model_len)


def test_the_server_answers_normally_after_the_fuzz(fuzz_stack):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{fuzz_stack.base_url}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    assert httpx.get(f"{fuzz_stack.base_url.removesuffix('/v1')}/health", timeout=10).status_code == 200
