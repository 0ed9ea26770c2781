"""Fuzzing the frontend from its own OpenAPI schema (schemathesis): POST /v1/chat/completions
and /v1/completions, valid and invalid bodies, a few hundred cases in all.

Every case must get an answer that is not a 5xx, within a per-request timeout (a hung
connection fails the case), and the server must answer a plain chat request afterwards.
Generated bodies keep their shape; only `max_tokens`/`max_completion_tokens` and `n`
values that the server would accept are shrunk (and a missing max_tokens is set), so the
CPU model answers in milliseconds while every validation path stays exercised: a value
the server must refuse (0, -3, "x", 10**30, more than the context) is sent as generated.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from launcher import Stack
from openai_frontend.api.protocol import MAX_CHOICES as SERVER_MAX_CHOICES

pytestmark = pytest.mark.e2e

# Random cases per endpoint (FUZZ_CASES), besides schemathesis's coverage phase: boundary
# and wrong-type values for every field, ~400 cases per endpoint, most of them 400s.
# Together about 2.5 minutes on 2 slow shared cores; each accepted case runs the model.
CASES_PER_ENDPOINT = int(os.environ.get("FUZZ_CASES", "40"))
REQUEST_TIMEOUT_S = 30  # no byte for this long: the connection hung
MAX_TOKENS = 2  # what an accepted max_tokens becomes
MAX_CHOICES = 2  # what an accepted n becomes
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


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


@pytest.fixture(scope="module")
def frontend_schema(fuzz_stack):
    """The schema the frontend serves, cut to the two generation endpoints."""
    root = fuzz_stack.base_url.removesuffix("/v1")
    loaded = schemathesis.openapi.from_url(f"{root}/openapi.json")
    loaded.config.update(base_url=root)
    loaded.config.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
        max_examples=CASES_PER_ENDPOINT,
    )
    return loaded.include(method="POST", path_regex=r"^/v1/(chat/)?completions$")


schema = schemathesis.pytest.from_fixture("frontend_schema")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bounded(body: Any, max_model_len: int) -> Any:
    """The body with accepted token counts and `n` made small; anything the server must
    refuse is left as generated, so validation still sees it."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in TOKEN_FIELDS:
        if _is_int(body.get(key)) and 1 <= body[key] <= max_model_len:
            body[key] = min(body[key], MAX_TOKENS)
    if all(body.get(key) is None for key in TOKEN_FIELDS):
        body["max_tokens"] = MAX_TOKENS  # chat's default is what the context leaves
    if _is_int(body.get("n")) and 1 <= body["n"] <= SERVER_MAX_CHOICES:
        body["n"] = min(body["n"], MAX_CHOICES)
    return body


@schema.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_no_hang(case, max_model_len):
    case.body = bounded(case.body, max_model_len)
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=[not_a_server_error])


def test_the_server_answers_normally_after_the_fuzz(fuzz_stack):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{fuzz_stack.base_url}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    assert httpx.get(f"{fuzz_stack.base_url.removesuffix('/v1')}/health", timeout=10).status_code == 200
