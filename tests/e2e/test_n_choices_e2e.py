"""`n` choices end to end: n model requests per prompt, through Triton and the frontend.

Uses the session-scoped `stack` fixture (tests/conftest.py).
"""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Tell me a short story about a cat."}]
STORY = "Once upon a time, in a small village by the sea,"


def _texts(reply) -> list[str]:
    assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
    return [c.message.content for c in reply.choices]


def test_seeded_chat_choices_differ_and_repeat(client, model):
    kwargs = {"model": model, "messages": QUESTION, "n": 4, "temperature": 0.9, "seed": 1234, "max_tokens": 16}
    first = client.chat.completions.create(**kwargs)
    texts = _texts(first)
    assert len(texts) == 4 and all(c.finish_reason in ("stop", "length") for c in first.choices)
    assert _texts(client.chat.completions.create(**kwargs)) == texts
    assert len(set(texts)) > 1


def test_greedy_completion_choices_are_the_greedy_text(client, model):
    kwargs = {"model": model, "prompt": STORY, "max_tokens": 12, "temperature": 0}
    solo = client.completions.create(**kwargs)
    reply = client.completions.create(n=3, **kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [solo.choices[0].text] * 3
    assert reply.usage.prompt_tokens == solo.usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * solo.usage.completion_tokens


def test_streamed_chat_choices_equal_non_streamed(client, model):
    kwargs = {"model": model, "messages": QUESTION, "n": 2, "temperature": 0.9, "seed": 99, "max_tokens": 16}
    whole = _texts(client.chat.completions.create(**kwargs))
    texts, finishes, roles = ["", ""], [None, None], []
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles += [choice.index] if choice.delta.role else []
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == whole and sorted(roles) == [0, 1] and None not in finishes
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("n", [0, 9])
def test_n_outside_one_to_eight_is_refused(client, model, n):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, n=n, max_tokens=2)
    assert info.value.body["param"] == "n"
