"""A long prompt shares the engine (the scheduler's `shared_chunk` rule) on the real default
model: a request added while the long prompt with prompt logprobs is being prefilled is
admitted at the next step and done long before it, and neither one's tokens nor the long
prompt's logprobs change from what each gives alone."""

from __future__ import annotations

import random

import pytest

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.convert import ensure_default_model
from backend.settings.engine import EngineConfig

BUDGET = 64  # shared_chunk 16
LONG = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(model_path=str(ensure_default_model()), max_num_batched_tokens=BUDGET)
    return LLMEngine(config)


@pytest.fixture(scope="module")
def prompts(engine):
    rng = random.Random(42)  # no prefix shared with anything: each prompt computed in full
    return [rng.randrange(100, engine.vocab_size) for _ in range(400)], [rng.randrange(100, 9000) for _ in range(9)]


def _run(engine: LLMEngine, requests: dict[str, GenerationRequest], late: dict[str, GenerationRequest], after: int):
    """Step `requests` (`late` added after `after` steps) until idle: each request's outputs
    in order, and the step at which each finished."""
    outputs = {rid: [] for rid in [*requests, *late]}
    finished, step = {}, 0
    for rid, request in requests.items():
        engine.add_request(rid, request)
    while engine.has_unfinished_requests() or step <= after:
        if step == after:
            for rid, request in late.items():
                engine.add_request(rid, request)
        for out in engine.step():
            outputs[out.request_id].append(out)
            if out.final is not None:
                finished[out.request_id] = step
        step += 1
    return outputs, finished


def _tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def _prompt_logprobs(outputs):
    (first,) = [out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None]
    return first


def test_a_short_request_beside_a_long_prompt_is_served_at_once_and_changes_nothing(engine, prompts):
    long_prompt, short_prompt = prompts
    alone_long, _ = _run(engine, {"long": GenerationRequest(long_prompt, LONG)}, {}, 0)
    alone_short, _ = _run(engine, {"short": GenerationRequest(short_prompt, SHORT)}, {}, 0)
    assert len(alone_long["long"]) == 3  # 400 tokens in 64-token chunks: 7 steps, then 2 decodes

    late = {"short": GenerationRequest(short_prompt, SHORT)}
    shared, finished = _run(engine, {"long": GenerationRequest(long_prompt, LONG)}, late, after=2)
    # admitted at step 2 with its whole prompt, one token a step after it: done at step 5,
    # while the long prompt, at a quarter of the budget beside it, is still being computed
    assert finished["short"] == 2 + SHORT.max_tokens - 1
    assert finished["long"] > finished["short"] + 2
    assert _tokens(shared["short"]) == _tokens(alone_short["short"])
    assert _tokens(shared["long"]) == _tokens(alone_long["long"])
    got, want = _prompt_logprobs(shared["long"]), _prompt_logprobs(alone_long["long"])
    assert [lp.token_id for lp in got] == long_prompt and got[0].logprob is None
    for mine, theirs in zip(got[1:], want[1:], strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
