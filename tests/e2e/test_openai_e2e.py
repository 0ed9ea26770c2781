"""End to end: the official `openai` client against tritonserver + the frontend.

Uses the session-scoped `stack` fixture (tests/conftest.py), which yields an object
with `.base_url` ("http://127.0.0.1:PORT/v1") and, for the in-flight check, the
Triton metrics address.
"""

from __future__ import annotations

import asyncio
import os
import re
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _chat(client, model, messages=CAPITAL, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, **kwargs)


def _chat_stream_text(client, model, messages=CAPITAL, **kwargs):
    stream = _chat(client, model, messages, stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _assert_serves(client, model):
    reply = _chat(client, model, max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens >= 1


def test_models_list(client, stack):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    assert httpx.get(stack.base_url.removesuffix("/v1") + "/health").status_code == 200


def test_chat_answers_the_capital_of_france(client, model):
    reply = _chat(client, model, temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_completions(client, model):
    reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.choices[0].text.strip() and reply.object == "text_completion"
    assert reply.usage.completion_tokens <= 8


def test_chat_stream_equals_non_stream(client, model):
    whole = _chat(client, model, temperature=0, max_tokens=32).choices[0].message.content
    assert _chat_stream_text(client, model, temperature=0, max_tokens=32) == whole


def test_completions_stream_equals_non_stream(client, model):
    kwargs = dict(model=model, prompt=STORY, temperature=0, max_tokens=32)
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole


def test_stream_include_usage(client, model):
    chunks = list(
        _chat(client, model, temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, model, stream):
    kwargs = dict(model=model, prompt=STORY, temperature=0, max_tokens=32)
    full = client.completions.create(**kwargs).choices[0].text
    words = re.findall(r" \w{3,}", full)
    assert len(words) >= 3, full
    stop = words[2]
    expected = full[: full.index(stop)]
    if stream:
        chunks = list(client.completions.create(stop=[stop, "@@never@@"], stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        reply = client.completions.create(stop=[stop, "@@never@@"], **kwargs)
        text, finish = reply.choices[0].text, reply.choices[0].finish_reason
    assert (text, finish) == (expected, "stop")


def test_max_tokens_gives_length(client, model):
    reply = client.completions.create(model=model, prompt=STORY, max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    chat = _chat(client, model, max_completion_tokens=3, temperature=0)
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("length", 3)


def test_same_seed_same_text(client, model):
    kwargs = dict(model=model, prompt=STORY, max_tokens=16, temperature=1.0, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_top_k_one_is_greedy(client, model):
    kwargs = dict(model=model, prompt=STORY, max_tokens=16)
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    top1 = client.completions.create(temperature=1.0, extra_body={"top_k": 1}, **kwargs).choices[0].text
    assert top1 == greedy


def test_logit_bias_forces_its_token(client, model, tokenizer):
    [banana] = tokenizer.encode(" banana", add_special_tokens=False)
    for temperature in (0, 1.0):
        reply = client.completions.create(
            model=model, prompt=STORY, max_tokens=3, temperature=temperature, logit_bias={str(banana): 100}
        )
        assert reply.choices[0].text == tokenizer.decode([banana] * 3)
        assert reply.usage.completion_tokens == 3


def test_frequency_penalty_breaks_a_loop(client, model, tokenizer):
    def repeats(**kwargs) -> int:
        kwargs = dict(model=model, prompt="1, 2, 3, 1, 2, 3, 1, 2, 3,", max_tokens=32, temperature=0, **kwargs)
        ids = tokenizer.encode(client.completions.create(**kwargs).choices[0].text, add_special_tokens=False)
        return len(ids) - len(set(ids))

    assert repeats(frequency_penalty=1.5) < repeats()


def test_min_tokens_forces_length(client, model):
    short = [{"role": "user", "content": "Reply with the single word: yes"}]
    natural = _chat(client, model, short, temperature=0, max_tokens=40).usage.completion_tokens
    forced = natural + 5
    reply = _chat(client, model, short, temperature=0, max_tokens=forced + 10, extra_body={"min_tokens": forced})
    assert reply.usage.completion_tokens >= forced


def test_concurrent_streams_match_solo_greedy(stack, client, model):
    prompts = [f"{STORY} the {i}th child" for i in range(16)]
    lengths = [4 + (i * 7) % 29 for i in range(16)]
    solo = [
        client.completions.create(model=model, prompt=p, max_tokens=n, temperature=0).choices[0].text
        for p, n in zip(prompts, lengths, strict=True)
    ]

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=300)

        async def one(prompt, n):
            stream = await aclient.completions.create(
                model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))
        finally:
            await aclient.close()

    assert asyncio.run(run_all()) == solo


def _metric(url: str, name: str) -> float | None:
    match = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", httpx.get(url).text, re.MULTILINE)
    return float(match.group(1)) if match else None


def _frontend_aborts(stack) -> float:
    url = stack.base_url.removesuffix("/v1") + "/metrics"
    text = httpx.get(url).text
    match = re.search(r'^llm_frontend_requests_finished_total\{reason="abort"\} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# min_tokens keeps the model from ending early, and with the loop guard off (docs/reasoning-and-guards.md: a request
# that wants repetition turns it off) nothing cuts it either: finishing would take minutes.
# (With the guard on, greedy text that falls into a loop was cut at ~315 tokens, in 1.4 s.)
LONG = {"prompt": STORY, "max_tokens": 3000, "min_tokens": 3000, "temperature": 0,
        "repetition_detection": {"min_count": 0}}  # fmt: skip


def _assert_cancelled(stack, aborts: float) -> None:
    """The frontend counted the abort; the model's request ended and its KV blocks came free."""
    deadline = time.monotonic() + 10
    while _frontend_aborts(stack) == aborts and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _frontend_aborts(stack) == aborts + 1
    url = stack.triton_metrics_url
    for name in ("llm_requests_in_flight", "llm_kv_blocks_used"):
        while _metric(url, name) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _metric(url, name) == 0, name


def test_disconnect_mid_stream_cancels_the_request(stack, client, model):
    aborts = _frontend_aborts(stack)
    body = {"model": model, "stream": True, **LONG}
    with httpx.stream("POST", f"{stack.base_url}/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(8), strict=False) if line.startswith("data: ")]
        assert len(received) >= 3
    _assert_serves(client, model)  # and the server keeps serving
    _assert_cancelled(stack, aborts)


def test_disconnect_before_a_non_streaming_reply_cancels_the_request(stack, client, model):
    aborts = _frontend_aborts(stack)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.base_url}/completions", json={"model": model, **LONG}, timeout=1.5)
    _assert_serves(client, model)
    _assert_cancelled(stack, aborts)


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"temperature": -1}, openai.BadRequestError, "temperature"),
        ({"n": 9}, openai.BadRequestError, "n"),
        (
            {"extra_body": {"repetition_detection": {"min_pattern_size": 5, "max_pattern_size": 2, "min_count": 3}}},
            openai.BadRequestError,
            "repetition_detection.max_pattern_size",
        ),
        ({"extra_body": {"dry_multiplier": -1}}, openai.BadRequestError, "dry_multiplier"),
        ({"presence_penalty": 3}, openai.BadRequestError, "presence_penalty"),
        ({"logit_bias": {"5": 101}}, openai.BadRequestError, "logit_bias"),
        ({"logit_bias": {"99999999": 5}}, openai.BadRequestError, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": {"99999999": 5}, "stream": True}, openai.BadRequestError, "logit_bias"),
        ({"extra_body": {"top_n_sigma": -1}}, openai.BadRequestError, "top_n_sigma"),
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"messages": []}, openai.BadRequestError, "messages"),
    ],
)
def test_bad_input_is_refused_in_openai_shape(client, model, kwargs, error, param):
    kwargs = {"model": model, "messages": CAPITAL, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as info:
        result = client.chat.completions.create(**kwargs)
        list(result) if kwargs.get("stream") else None
    body = info.value.body
    assert body["param"] == param and body["message"] and "type" in body and "code" in body
    _assert_serves(client, model)


def test_repeated_prompt_reports_prefix_cache_hits(client, model):
    # a system prompt of a few hundred tokens, unique to this test so nothing cached it before
    system = " ".join(f"Rule {i}: answer with care about topic number {i}." for i in range(40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    first = _chat(client, model, messages, max_tokens=2, temperature=0).usage
    again = _chat(client, model, messages, max_tokens=2, temperature=0).usage
    assert first.prompt_tokens == again.prompt_tokens > 300
    assert first.prompt_tokens_details.cached_tokens == 0
    # every full block of the prompt but the one holding its last token is a hit
    block = int(os.environ.get("BLOCK_SIZE") or 16)  # the server inherits the tests' environment
    assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // block * block


# ---------------------------------------------------------------------------
# logprobs


def _assert_chat_logprobs_well_formed(content, k):
    assert content
    for item in content:
        assert item["logprob"] <= 0 and item["bytes"] == list(item["token"].encode())
        alternatives = [alt["logprob"] for alt in item["top_logprobs"]]
        assert len(alternatives) == k and alternatives == sorted(alternatives, reverse=True)
        assert item["logprob"] <= alternatives[0] + 1e-6


def test_chat_logprobs_stream_and_non_stream_agree(client, model):
    kwargs = {"max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    reply = _chat(client, model, **kwargs)
    content = [item.model_dump() for item in reply.choices[0].logprobs.content]
    _assert_chat_logprobs_well_formed(content, 3)
    assert "".join(item["token"] for item in content) == reply.choices[0].message.content
    streamed = []
    for chunk in _chat(client, model, stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [item.model_dump() for item in chunk.choices[0].logprobs.content]
    assert [i["token"] for i in streamed] == [i["token"] for i in content]
    # the same tokens; their logprobs up to float rounding: the second request reads the first's
    # prompt from the prefix cache (float16 keys and values) and may share its steps with what
    # the tests before it left in flight, another order of additions (measured up to 1.05e-4)
    for a, b in zip(streamed, content, strict=True):
        assert abs(a["logprob"] - b["logprob"]) < 1e-3


def test_chat_logprobs_without_alternatives(client, model):
    reply = _chat(client, model, max_tokens=4, temperature=0, logprobs=True, top_logprobs=0)
    content = reply.choices[0].logprobs.content
    assert len(content) in (reply.usage.completion_tokens, reply.usage.completion_tokens - 1)  # EOS: not emitted
    assert all(i.top_logprobs == [] for i in content)
    assert _chat(client, model, max_tokens=2, temperature=0).choices[0].logprobs is None


def test_completions_echo_with_logprobs(client, model):
    reply = client.completions.create(model=model, prompt=STORY, max_tokens=4, temperature=0, logprobs=2, echo=True)
    choice = reply.choices[0]
    assert choice.text.startswith(STORY) and len(choice.text) > len(STORY)
    lp = choice.logprobs
    n = reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # prompt positions too get 2 alternatives (3 entries when the token is not among them)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(
        choice.text.startswith(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True) if t != "<|im_end|>"
    )
    # the prompt was just computed: a cached prompt still gets every position's logprob
    again = client.completions.create(model=model, prompt=STORY, max_tokens=4, temperature=0, logprobs=2, echo=True)
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_completions_echo_without_logprobs(client, model):
    reply = client.completions.create(model=model, prompt=STORY, max_tokens=3, temperature=0, echo=True)
    assert reply.choices[0].text.startswith(STORY) and reply.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_logprobs_are_refused_naming_the_field(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, model, max_tokens=2, **kwargs)
    assert info.value.body["param"] == param
