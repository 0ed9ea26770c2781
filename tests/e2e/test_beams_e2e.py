"""Beam search end to end: the official openai client (and raw SSE) through the frontend
and Triton, against transformers' `generate(num_beams=...)` on the same weights.

A frontend of its own on the session's tritonserver (`triton_only`), with a short
keep-alive interval (SSE_KEEPALIVE_S), so that a streamed search shows its comments.
Completions compare token for token (each token's text from logprobs, the whole text,
finish reasons, usage); chat the same, on the prompt the frontend's chat template makes.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from launcher import Stack
from tests.helpers.beams import generate_beams

pytestmark = pytest.mark.e2e

EOS = 2  # SmolLM2's <|im_end|>: its config's and generation config's EOS
PROMPT = "The capital of France is"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
RULES = {True: True, False: False, "never": "never"}  # the body's early_stopping -> transformers'
SEARCH = {"num_beams": 4}


@pytest.fixture(scope="module")
def beam_stack(triton_only, model_path):
    with Stack(model_path, triton=triton_only, env={"SSE_KEEPALIVE_S": "0.05"}) as running:
        yield running


@pytest.fixture(scope="module")
def beam_client(beam_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=beam_stack.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served(beam_stack) -> str:
    return beam_stack.served_model_name


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def hf(model_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _reference(hf, prompt: list[int], num_beams, n, max_new, length_penalty, early_stopping):
    """transformers' n best (tokens, with the EOS they stopped on), on one thread: the
    server shares these cores, and two OpenMP teams on them are many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = generate_beams(hf, prompt, num_beams, n, max_new, length_penalty, RULES[early_stopping], EOS)
    finally:
        torch.set_num_threads(threads)
    return [tokens for tokens, _ in found]


def _chat_prompt(tokenizer, messages) -> list[int]:
    """The prompt as the frontend makes it (generation/tokenization.py encode_chat)."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _assert_choice(tokenizer, text, finish_reason, tokens):
    generated = tokens[:-1] if tokens[-1] == EOS else tokens
    assert text == tokenizer.decode(generated, skip_special_tokens=True)
    assert finish_reason == ("stop" if tokens[-1] == EOS else "length")


def test_completion_beams_are_transformers_token_for_token(beam_client, served, tokenizer, hf):
    extra = {"num_beams": 4, "length_penalty": 0.8, "early_stopping": True}
    reply = beam_client.completions.create(
        model=served, prompt=PROMPT, n=3, max_tokens=16, logprobs=0, extra_body=extra
    )
    prompt = tokenizer(PROMPT)["input_ids"]
    theirs = _reference(hf, prompt, 4, 3, 16, 0.8, True)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice, tokens in zip(reply.choices, theirs, strict=True):
        _assert_choice(tokenizer, choice.text, choice.finish_reason, tokens)
        generated = tokens[:-1] if tokens[-1] == EOS else tokens
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in generated]
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == sum(len(tokens) for tokens in theirs)


def test_chat_beams_are_transformers_on_the_templated_prompt(beam_client, served, tokenizer, hf):
    extra = {"num_beams": 3, "length_penalty": 1.2, "early_stopping": "never"}
    reply = beam_client.chat.completions.create(model=served, messages=CAPITAL, n=2, max_tokens=16, extra_body=extra)
    theirs = _reference(hf, _chat_prompt(tokenizer, CAPITAL), 3, 2, 16, 1.2, "never")
    for choice, tokens in zip(reply.choices, theirs, strict=True):
        _assert_choice(tokenizer, choice.message.content, choice.finish_reason, tokens)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens == sum(len(tokens) for tokens in theirs)


def test_a_streamed_search_keeps_alive_then_sends_what_a_whole_one_does(beam_stack, beam_client, served):
    whole = beam_client.completions.create(model=served, prompt=PROMPT, n=2, max_tokens=16, extra_body=SEARCH)
    body = {"model": served, "prompt": PROMPT, "n": 2, "max_tokens": 16, **SEARCH, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{beam_stack.base_url}/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        blocks = [block for block in response.read().decode().split("\n\n") if block]
    assert ": keep-alive" in blocks and blocks[-1] == "data: [DONE]"
    chunks = [json.loads(b.removeprefix("data: ")) for b in blocks[:-1] if b.startswith("data: ")]
    texts = ["", ""]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    # the openai client skips the comments: a role chunk, the text, its finish reason
    stream = beam_client.chat.completions.create(model=served, messages=CAPITAL, max_tokens=12, stream=True,
                                                 extra_body=SEARCH)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"num_beams": 0}}, "num_beams"),
        ({"extra_body": {"num_beams": 99}}, "num_beams"),
        ({"n": 5, "extra_body": SEARCH}, "n"),
        ({"response_format": {"type": "json_object"}, "extra_body": SEARCH}, "response_format"),
        ({"temperature": 0.9, "extra_body": SEARCH}, "temperature"),
        ({"stop": ["."], "stream": True, "extra_body": SEARCH}, "stop"),
        ({"extra_body": {"length_penalty": 0.5}}, "length_penalty"),
    ],
)
def test_what_a_search_cannot_honour_is_a_400_naming_it(beam_client, served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        result = beam_client.chat.completions.create(model=served, messages=CAPITAL, max_tokens=4, **kwargs)
        list(result) if kwargs.get("stream") else None
    body = info.value.body
    assert body["param"] == param and body["message"].startswith(f"{param}: ")


def test_searches_and_sampled_requests_at_once_are_each_as_alone(beam_client, served):
    prompts = [PROMPT, "Once upon a time, in a small village by the sea,"]

    def search(prompt):
        reply = beam_client.completions.create(model=served, prompt=prompt, n=2, max_tokens=10,
                                               extra_body={"num_beams": 4, "early_stopping": True})  # fmt: skip
        return [c.text for c in reply.choices]

    def greedy(prompt):
        reply = beam_client.completions.create(model=served, prompt=prompt, max_tokens=10, temperature=0)
        return reply.choices[0].text

    alone = {p: (search(p), greedy(p)) for p in prompts}
    work = [(search, p) for p in prompts * 2] + [(greedy, p) for p in prompts * 2]
    with ThreadPoolExecutor(len(work)) as pool:
        results = list(pool.map(lambda job: (job, job[0](job[1])), work))
    for (kind, prompt), result in results:
        assert result == alone[prompt][0 if kind is search else 1], (kind.__name__, prompt)
