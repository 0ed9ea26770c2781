"""End to end: DRY and the LZ penalty, sent as extra body fields, break a greedy loop."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.e2e

LOOP = "1, 2, 3, 1, 2, 3, 1, 2, 3,"  # the default model continues it forever at temperature 0


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def repeated_ngrams(text: str, n: int = 3) -> int:
    """How many word n-grams of the text are repeats of an earlier one."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return len(grams) - len(set(grams))


def _complete(client, model, **extra_body) -> str:
    reply = client.completions.create(model=model, prompt=LOOP, max_tokens=48, temperature=0, extra_body=extra_body)
    return reply.choices[0].text


def test_repeat_penalties_break_a_greedy_loop(client, model):
    plain = repeated_ngrams(_complete(client, model))
    assert plain >= 10  # the prompt does make the model loop
    assert repeated_ngrams(_complete(client, model, dry_multiplier=0.8)) < plain
    assert repeated_ngrams(_complete(client, model, lz_penalty=1.0)) < plain
