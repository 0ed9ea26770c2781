"""The default configuration as `make serve` runs it: QUANT=auto and QUANT_ACTIVATIONS=auto,
so the default model's Q4_1 blocks times int8 activations where the CPU has AVX-512 VNNI
(docs/quantization.md). The rest of the suite runs float32 activations (tests/conftest.py)
to compare with references token for token; here the real openai SDK drives the default
through what a user asks of it: chat, streams, logprobs, tools, schemas, n, penalties,
concurrent streams. Its numbers are checked against the float32 activations' (close, and
not the same: the int8 path is the one serving)."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from backend import kernels
from launcher import Stack
from tests.helpers.tools import WEATHER

pytestmark = pytest.mark.e2e

VNNI = kernels.native() is not None and "avx512_vnni" in kernels.cpu_flags()
PROMPT = "The three primary colors are"
TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "budget": {"enum": ["low", "medium", "high"]},
    },
    "required": ["city", "days", "budget"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("default-logs")


@pytest.fixture(scope="module")
def default_stack(model_path, logs):
    with Stack(model_path, env={"QUANT_ACTIVATIONS": "auto"}, log_dir=logs) as running:
        yield running


@pytest.fixture(scope="module")
def default_client(default_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_stack.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served(default_client) -> str:
    return default_client.models.list().data[0].id


def test_the_default_is_the_q4_1_blocks_times_int8_activations(default_stack, logs):
    if kernels.native() is None:
        pytest.skip("no AVX-512 kernels: QUANT=auto serves float32")
    text = "".join(p.read_text(errors="replace") for p in logs.glob("*.log"))
    multiplied_by = "int8" if VNNI else "float32"
    assert f"QUANT=int4 (groups of 32, zero points, {multiplied_by} activations)" in text


def _first_logprobs(client, model) -> dict[str, float]:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=5)
    return reply.choices[0].logprobs.top_logprobs[0]


@pytest.mark.skipif(not VNNI, reason="auto gives float32 activations without AVX-512 VNNI")
def test_its_logprobs_are_close_to_float32_activations_and_not_theirs(default_client, served, client, model):
    mine, theirs = _first_logprobs(default_client, served), _first_logprobs(client, model)
    shared = mine.keys() & theirs.keys()
    assert len(shared) >= 4, (mine, theirs)
    apart = [abs(mine[t] - theirs[t]) for t in shared]
    # int8 rounding moves them as far as llama.cpp's own arithmetic does on this GGUF: over 20
    # prompts' top 5, <= 0.30 (this prompt 0.26) from float32's, llama-server's <= 0.28
    assert max(apart) < 0.5, (mine, theirs)
    assert max(apart) > 1e-6, (mine, theirs)  # and not float32's arithmetic


def test_chat_streams_what_its_usage_counts(default_client, served):
    stream = default_client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "Name a fruit that is yellow."}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() and finish in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert 1 <= usage.completion_tokens <= 24 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_schema_and_a_forced_tool_call_are_valid(default_client, served):
    reply = default_client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "Plan a trip to Kyoto."}], max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content), TRIP)
    reply = default_client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "Is it raining in Oslo?"}], max_tokens=60,
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


def test_n_choices_logprobs_and_penalties(default_client, served):
    reply = default_client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "Write a line about the sea."}], n=3, seed=7,
        temperature=0.9, max_tokens=16, logprobs=True, top_logprobs=3, frequency_penalty=0.5, presence_penalty=0.3,
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        assert choice.logprobs.content and len(choice.logprobs.content) <= 16
        for entry in choice.logprobs.content:
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(math.isfinite(v) for v in tops)
    ended = sum(c.finish_reason == "stop" for c in reply.choices)  # their EOS: counted, not listed
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices) + ended


def test_sixteen_concurrent_streams_each_get_their_tokens(default_client, served):
    def one(i: int) -> tuple[int, int]:
        stream = default_client.completions.create(
            model=served, prompt=f"Story number {i}: once upon a time", max_tokens=20 + i, temperature=0.7, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)
        return i, chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert results == [(i, 20 + i) for i in range(16)]
