"""Models whose layers keep state besides attention's KV (backend/runner/models/layer_state.py)
in the real engine: a tiny random Qwen3.5 (gated delta net: a convolution and a recurrent
state a layer) against transformers when sequences are preempted and start over, several
prompts of other lengths decoding together (their states stacked), and what the engine turns
off for such a model (prefix cache, speculation, beams: one state a sequence, at its last
token)."""

from __future__ import annotations

import random

import pytest

from backend.contract import ContractError, GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.tiny_checkpoints import GQA, VOCAB, assert_matches, build, greedy, reference


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_text")
    return folder, build("qwen3_5_text", folder, GQA)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 45))] for _ in range(count)]


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model_path=str(folder), max_loras=0, quant="none", max_num_batched_tokens=32)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def test_every_sequence_of_a_batch_keeps_its_own_state_through_preemption(qwen35):
    """8 prompts in a pool that cannot hold them all: preempted sequences start over (their
    states emptied), and every one's tokens are transformers' for that prompt alone."""
    folder, model = qwen35
    prompts = _prompts(8, seed=3)
    eng = _engine(folder, num_blocks=14, block_size=8)
    tokens, _ = run_to_completion(eng, {f"p{i}": greedy(prompt=p) for i, p in enumerate(prompts)})
    assert eng.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        ref, logits = reference(model, prompt)
        assert_matches(tokens[f"p{i}"], ref, logits, f"prompt {i}")


def test_a_sequence_arriving_while_others_decode_starts_from_an_empty_state(qwen35):
    """Requests added between steps: a new prompt's chunks run beside decoding rows."""
    folder, model = qwen35
    prompts = _prompts(4, seed=5)
    eng = _engine(folder)
    tokens = {f"p{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        eng.add_request(f"p{i}", greedy(prompt=prompt), None)
        for _ in range(3):
            for out in eng.step():
                tokens[out.request_id] += out.token_ids
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] += out.token_ids
    for i, prompt in enumerate(prompts):
        ref, logits = reference(model, prompt)
        assert_matches(tokens[f"p{i}"], ref, logits, f"prompt {i}")


def test_prefix_cache_and_speculation_are_off_and_beams_are_refused(qwen35):
    folder, _ = qwen35
    eng = _engine(folder, enable_prefix_caching=True, speculative="auto")
    assert eng.runner.keeps_state
    assert not eng.block_manager.enable_prefix_caching and eng.speculator.mode == "off"
    beams = GenerationRequest(prompt_tokens=[5, 6, 7], sampling=SamplingParams(max_tokens=4), num_beams=2)
    with pytest.raises(ContractError, match="no beam search"):
        eng.add_request("beams", beams, None)
    with pytest.raises(ValueError, match="SPECULATIVE=ngram"):
        _engine(folder, speculative="ngram")
