"""Same request, same answer, through the real openai SDK on the default server (`make serve`'s
arithmetic: int4 weights, int8 activations, float16 KV): greedy and seeded requests alone and
under 16-way concurrency, streamed and not, a long prompt again after a prefix-cache hit, and
`n` seeded choices, give identical text (issue "Same request, same answer")."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from launcher import Stack

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "List three things to check before merging a database migration.",
    "Explain in two sentences why a hash map lookup is usually constant time.",
    "Write a haiku about a lighthouse in fog.",
    "What is the difference between a process and a thread?",
]
TOKENS = 48


@pytest.fixture(scope="module")
def default_client(model_path, tmp_path_factory):
    env = {"QUANT_ACTIVATIONS": "auto", "KV_CACHE_DTYPE": "auto"}
    with Stack(model_path, env=env, log_dir=tmp_path_factory.mktemp("same-answer-logs")) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=300)
        yield client, client.models.list().data[0].id


def _ask(client, model, question, *, stream=False, seed=None, n=1) -> list[str]:
    kwargs = {"temperature": 0.9, "seed": seed} if seed is not None else {"temperature": 0}
    messages = [{"role": "user", "content": question}]
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=TOKENS, n=n, **kwargs)
        return [choice.message.content for choice in sorted(reply.choices, key=lambda c: c.index)]
    texts = [""] * n
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=TOKENS, n=n,
                                                 stream=True, **kwargs):  # fmt: skip
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    return texts


def _jobs() -> list[dict]:
    """16 requests: each question greedy and seeded, streamed and not."""
    return [
        {"question": q, "stream": stream, "seed": seed}
        for q in QUESTIONS
        for stream in (False, True)
        for seed in (None, 1000 + QUESTIONS.index(q))
    ]


def test_alone_and_under_sixteen_way_concurrency_the_text_is_the_same(default_client):
    client, model = default_client
    jobs = _jobs()
    alone = [_ask(client, model, **job) for job in jobs]
    random.Random(7).shuffle(order := list(range(len(jobs))))
    with ThreadPoolExecutor(16) as pool:
        busy = dict(zip(order, pool.map(lambda i: _ask(client, model, **jobs[i]), order), strict=True))
    different = [(jobs[i], alone[i], busy[i]) for i in range(len(jobs)) if alone[i] != busy[i]]
    assert not different, different[:2]
    # streamed and not: one answer
    for i in range(0, len(jobs), 4):
        assert alone[i] == alone[i + 2] and alone[i + 1] == alone[i + 3], jobs[i]["question"]


def test_a_long_prompt_again_after_a_prefix_cache_hit(default_client):
    client, model = default_client
    question = " ".join(f"Step {i}: check the {w} before you merge." for i, w in enumerate(["logs", "tests"] * 40))
    first = _ask(client, model, question + " Summarise the steps.")
    with ThreadPoolExecutor(4) as pool:  # and beside other requests
        others = [pool.submit(_ask, client, model, q) for q in QUESTIONS]
        again = _ask(client, model, question + " Summarise the steps.")
        [f.result() for f in others]
    assert again == first


def test_n_seeded_choices_are_reproducible(default_client):
    client, model = default_client
    first = _ask(client, model, QUESTIONS[2], seed=42, n=3)
    assert len(set(first)) > 1  # three samples, not one copied
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(_ask, client, model, q, seed=5) for q in QUESTIONS]
        again = _ask(client, model, QUESTIONS[2], seed=42, n=3, stream=True)
        [f.result() for f in others]
    assert again == first
