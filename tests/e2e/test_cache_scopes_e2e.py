"""cache_salt, prompt_cache_key and priority through the whole stack (the default server:
SCHEDULING_POLICY=fcfs), with the official openai client."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.e2e

PROMPT = "Write down, in order, every planet of the solar system and one fact about each of them. " * 3


def cached(client, model, **extra) -> int:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, extra_body=extra)
    return response.usage.prompt_tokens_details.cached_tokens


def test_cache_salt_is_a_prefix_cache_scope(client, model):
    cached(client, model, cache_salt="salt-a")
    assert cached(client, model, cache_salt="salt-a") > 0  # the same salt shares the prefix
    assert cached(client, model, cache_salt="salt-b") == 0  # another salt shares nothing
    assert cached(client, model, cache_salt="salt-b") > 0


def test_prompt_cache_key_is_accepted(client, model):
    response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                              prompt_cache_key="my-conversation")  # fmt: skip
    assert response.choices[0].finish_reason in ("length", "stop")


def test_a_priority_needs_the_priority_policy(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"priority": 1})
    assert "priority" in str(info.value) and "SCHEDULING_POLICY" in str(info.value)
    assert client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"priority": 0}).choices
