"""Batch invariance, in process on the real default model: a request's logits depend only on
the request (issue "Same request, same answer").

One greedy target request's logits, every row the engine computes for it (its prompt's last
token, then each generated token), are recorded at the runner and compared with `torch.equal`
against the same request run alone: beside 1, 7, 31 and 63 random other requests started two
steps before it (so prefills and decodes share its steps), with its prompt cut into prefill
chunks by smaller token budgets, after a prefix-cache hit on its own prompt, and in a
speculative verify step (an n-gram drafter's drafts, verified k + 1 rows at a time). For the
default arithmetic (int4 weights, int8 activations, float16 KV) and the exact one, the int8
and float32 weight paths, and the float16 and float32 KV caches.
"""

from __future__ import annotations

import random

import pytest
import torch

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.convert import ensure_default_model
from backend.settings.engine import EngineConfig

TOKENS = 12
PROMPT = (
    "You are reviewing a change to a scheduler. Explain, step by step, what could go wrong when two "
    "requests share a prefix and the cache evicts a block while one of them is admitted; then propose "
    "three tests that would catch it, and say which one you would write first and why."
)
# (QUANT, KV_CACHE_DTYPE, QUANT_ACTIVATIONS)
FORMATS = [
    ("int4", "float16", "int8"),  # the default
    ("int4", "float32", "int8"),
    ("int4", "float16", "float32"),
    ("int8", "float16", "float32"),
    ("none", "float32", "float32"),
    ("none", "float16", "float32"),
]


@pytest.fixture(scope="module")
def model_path():
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def target(model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids), tokenizer.vocab_size


def _engine(model_path, fmt, budget=512, caching=False, speculative=None) -> LLMEngine:
    quant, kv, activations = fmt
    config = EngineConfig(model_path=model_path, quant=quant, kv_cache_dtype=kv, quant_activations=activations,
                          max_num_batched_tokens=budget, enable_prefix_caching=caching,
                          speculative=speculative or "auto")  # fmt: skip
    engine = LLMEngine(config)
    _record_target_logits(engine)
    return engine


def _record_target_logits(engine: LLMEngine) -> None:
    """engine.target_logits: the logits rows of request "target", as the runner computed them;
    engine.target_drafts: the drafts each step verified (row d + 1 follows draft d)."""
    execute = engine.runner.execute
    engine.target_logits, engine.target_drafts = [], []

    def recording(scheduled):
        result = execute(scheduled)
        logits = result.sample.args[0]
        completing = [item for item in scheduled if item.completes]
        for item, first in zip(completing, result.first_rows, strict=True):
            if item.seq.request_id == "target":
                engine.target_logits.append(logits[first : first + 1 + len(item.draft_tokens)].clone())
                engine.target_drafts.append(list(item.draft_tokens))
        return result

    engine.runner.execute = recording


def _request(prompt, tokens, disable_mtp=True):
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return GenerationRequest(prompt, params, disable_mtp=disable_mtp)


def _run(engine, prompt, others=(), disable_mtp=True) -> tuple[list[int], torch.Tensor]:
    """The target's tokens and its logits rows [n, vocab], with `others` started two steps before it."""
    for i, other in enumerate(others):
        engine.add_request(f"other-{i}", _request(other, random.Random(i).randint(4, 30)))
    for _ in range(2 if others else 0):
        engine.step()
    engine.target_logits, engine.target_drafts = [], []
    engine.add_request("target", _request(prompt, TOKENS, disable_mtp))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "target":
                tokens += out.token_ids
    return tokens, torch.cat(engine.target_logits)


def _others(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(n)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 200))] for _ in range(n)]


def _assert_same(alone, other, what):
    assert other[0] == alone[0], f"{what}: other tokens"
    assert other[1].shape == alone[1].shape and torch.equal(other[1], alone[1]), (
        f"{what}: logits differ by up to {(other[1] - alone[1]).abs().max().item():.3g}"
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=["+".join(f) for f in FORMATS])
def test_logits_depend_only_on_the_request(model_path, target, fmt):
    prompt, vocab = target
    engine = _engine(model_path, fmt)
    alone = _run(engine, prompt)
    assert len(alone[0]) == TOKENS and alone[1].shape[0] == TOKENS
    for n in (1, 7, 31, 63) if fmt == FORMATS[0] else (7, 31):
        _assert_same(alone, _run(engine, prompt, _others(vocab, n)), f"beside {n} others")
    del engine
    for budget in (64, 37):
        _assert_same(alone, _run(_engine(model_path, fmt, budget), prompt), f"prefill chunks of {budget}")
    cached = _engine(model_path, fmt, caching=True)
    _assert_same(alone, _run(cached, prompt), "prefix caching on, first run")
    _assert_same(alone, _run(cached, prompt), "after a prefix-cache hit")


@pytest.mark.parametrize("fmt", FORMATS[:1] + FORMATS[4:5], ids=["default", "float32"])
def test_verify_steps_give_the_decode_logits(model_path, target, fmt):
    """n-gram drafts verified k + 1 rows at a time: each row's logits are a decode step's."""
    prompt, _ = target
    echo = prompt + prompt[-40:]  # a prompt that repeats itself: the drafter proposes from it
    alone = _run(_engine(model_path, fmt), echo)
    speculative = _engine(model_path, fmt, speculative="ngram")
    tokens, logits = _run(speculative, echo, disable_mtp=False)
    assert any(rows.shape[0] > 1 for rows in speculative.target_logits), "no verify step ran"
    assert tokens == alone[0]
    # row 0 of a step predicts the token after the sequence's last; row d + 1, the token after
    # draft d, counts while every draft up to d was right: those rows are decode steps' own
    kept = []
    for rows, drafts in zip(speculative.target_logits, speculative.target_drafts, strict=True):
        for d, row in enumerate(rows):
            if d > 0 and drafts[d - 1] != rows[d - 1].argmax().item():
                break
            kept.append(row)
    kept = torch.stack(kept[:TOKENS])
    assert kept.shape[0] == TOKENS
    assert torch.equal(kept, alone[1])
