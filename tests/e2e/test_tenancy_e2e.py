"""End to end with API keys: tritonserver + a frontend started with keys and a per-tenant
concurrency limit of one, driven by the official openai client."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from launcher import Stack

pytestmark = pytest.mark.e2e

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


@pytest.fixture(scope="module")
def keyed_stack(triton_only, model_path):
    """A frontend of its own, with keys, on the session's tritonserver."""
    env = {"API_KEYS": ",".join(f"{k}:{t}" for k, t in KEYS.items()), "TENANT_MAX_CONCURRENT": "1"}
    with Stack(model_path, triton=triton_only, env=env) as running:
        yield running


def _client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(keyed_stack) -> str:
    return _client(keyed_stack, "key-a").models.list().data[0].id


def test_a_missing_or_unknown_key_is_401(keyed_stack, model):
    with pytest.raises(openai.AuthenticationError) as refused:
        _client(keyed_stack, "key-c").completions.create(model=model, prompt="Hi", max_tokens=1)
    assert refused.value.response.json()["error"]["code"] == "invalid_api_key"
    # the openai client always sends a key; a bare HTTP request may send none
    bare = httpx.post(f"{keyed_stack.base_url}/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed_stack.base_url.removesuffix("/v1") + "/health").status_code == 200


def test_a_tenant_never_hits_another_tenants_cached_prefix(keyed_stack, model):
    # a prompt no other test sends, long enough to fill several KV blocks
    text = f"Note {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 12

    def cached(key: str) -> tuple[int, int]:
        usage = _client(keyed_stack, key).completions.create(model=model, prompt=text, max_tokens=1).usage
        return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    prompt_tokens, first = cached("key-a")
    _, other_tenant = cached("key-b")
    _, repeat = cached("key-a")
    assert prompt_tokens > 100 and first == 0
    assert other_tenant == 0
    assert repeat >= prompt_tokens - 32  # all full blocks but the last token's


def test_a_second_stream_over_the_tenants_concurrency_is_429_until_the_first_ends(keyed_stack, model):
    a, b = _client(keyed_stack, "key-a"), _client(keyed_stack, "key-b")
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=24, temperature=0, stream=True)
    stream = a.completions.create(**kwargs)
    chunks = iter(stream)
    next(chunks)  # the first stream is running
    with pytest.raises(openai.RateLimitError) as refused:
        a.completions.create(**kwargs)
    headers = refused.value.response.headers
    assert headers["retry-after"] == "1" and headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    # another tenant is not held back meanwhile
    assert b.completions.create(**{**kwargs, "stream": False}).usage.completion_tokens >= 1
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    again = a.completions.create(**{**kwargs, "stream": False})
    assert again.usage.completion_tokens >= 1
