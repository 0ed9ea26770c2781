"""End to end: every repeat penalty breaks a greedy loop; seeds hold among concurrent requests."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.e2e

LOOP = "1, 2, 3, 1, 2, 3, 1, 2, 3,"  # the default model continues it forever at temperature 0


def repeated_ngrams(text: str, n: int = 3) -> int:
    """How many word n-grams of the text are repeats of an earlier one."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return len(grams) - len(set(grams))


def _complete(client, model, **extra_body) -> str:
    # the loop guard (on by default for the default model) would cut the loop: these
    # tests measure what the penalties do to it
    extra_body["repetition_detection"] = {"min_count": 0}
    reply = client.completions.create(model=model, prompt=LOOP, max_tokens=48, temperature=0, extra_body=extra_body)
    return reply.choices[0].text


def test_repeat_penalties_break_a_greedy_loop(client, model):
    plain = repeated_ngrams(_complete(client, model))
    assert plain >= 10  # the prompt does make the model loop
    assert repeated_ngrams(_complete(client, model, dry_multiplier=0.8)) < plain
    assert repeated_ngrams(_complete(client, model, lz_penalty=1.0)) < plain


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.3}, {"frequency_penalty": 1.0}])
def test_openai_and_hf_penalties_break_a_greedy_loop(client, model, penalty):
    plain = repeated_ngrams(_complete(client, model))
    assert repeated_ngrams(_complete(client, model, **penalty)) < plain


def test_presence_penalty_breaks_a_greedy_loop(client, model):
    """presence_penalty lowers every token already present by the same amount, so on
    LOOP (all of whose tokens are present) it leaves the loop's margins intact even at
    2.0 (measured: 11 repeated 3-grams with and without); on a loop of letters the
    letters lose to fresh tokens (in-process: 45 repeated 3-grams, 0 at 2.0)."""

    def letters(**extra_body):
        prompt = "a b c d a b c d a b c d"
        extra_body["repetition_detection"] = {"min_count": 0}
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=48, temperature=0, extra_body=extra_body
        )
        return repeated_ngrams(reply.choices[0].text)

    plain = letters()
    assert plain >= 10
    assert letters(presence_penalty=2.0) < plain // 2


def test_a_seed_gives_the_same_text_alone_and_among_concurrent_requests(stack, client, model):
    prompt = "Write one sentence about a cat named Lumi:"
    params = {"max_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    alone = client.completions.create(model=model, prompt=prompt, seed=1234, **params).choices[0].text
    other_seed = client.completions.create(model=model, prompt=prompt, seed=4321, **params).choices[0].text
    assert other_seed != alone

    async def crowd():
        aclient = openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=300)
        try:
            # 15 neighbours with other prompts, seeds and samplers, and ours in the middle
            calls = [
                aclient.completions.create(
                    model=model,
                    prompt=f"Story {i}: once",
                    seed=i,
                    max_tokens=8 + i,
                    temperature=0.7,
                    extra_body={"top_k": 20},
                )
                for i in range(15)
            ]
            calls.insert(7, aclient.completions.create(model=model, prompt=prompt, seed=1234, **params))
            return await asyncio.gather(*calls)
        finally:
            await aclient.close()

    replies = asyncio.run(crowd())
    assert replies[7].choices[0].text == alone
