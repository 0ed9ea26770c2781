"""Logprobs in-process on the default model, against transformers' log_softmax.

Logprobs describe the raw distribution (vLLM's default): float32 log_softmax of the
logits, before bias, penalties, temperature and truncation.
"""

import math

import pytest
import torch

from backend.contract import GenerationRequest, RequestOutput, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.convert import ensure_default_model
from backend.settings.engine import EngineConfig

PROMPT = "You are a careful assistant.\nQuestion: why is the sky blue?\nAnswer:"
TOL = 1e-3


@pytest.fixture(scope="module")
def model_path():
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def prompt(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path).encode(PROMPT)


@pytest.fixture(scope="module")
def engine(model_path):
    return LLMEngine(EngineConfig(model_path=model_path))


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is the distribution of token p + 1 (plain forward; generate()
    without an attention mask would treat <|im_end|> as padding)."""
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(request_id, GenerationRequest(list(prompt), params))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def _tokens_and_logprobs(outputs):
    """(tokens, their logprobs, their alternatives as (ids, values)) over the outputs;
    each Logprob names the token it describes."""
    tokens, entries = [], []
    for out in outputs:
        tokens += out.token_ids
        entries += out.logprobs or []
    assert [e.token_id for e in entries] == tokens[: len(entries)]
    tops = [([t for t, _ in e.top], [v for _, v in e.top]) for e in entries]
    return tokens, [e.logprob for e in entries], tops


def test_token_logprobs_and_top5_match_transformers(engine, hf, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, top_logprobs=5)
    tokens, logprobs, tops = _tokens_and_logprobs(_run(engine, "top5", prompt, params))
    assert len(tokens) == len(logprobs) == len(tops) == 16
    ref = _hf_logprobs(hf, prompt + tokens)
    for i, (token, logprob, (ids, values)) in enumerate(zip(tokens, logprobs, tops, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert abs(logprob - row[token].item()) < TOL
        assert values == sorted(values, reverse=True) and len(ids) == 5
        ref_values, ref_ids = row.topk(5)
        assert values == pytest.approx(ref_values.tolist(), abs=TOL)
        for tid, value in zip(ids, values, strict=True):  # ties may swap places
            assert abs(row[tid].item() - value) < TOL
        assert ids[0] == token  # greedy: the sampled token is the most likely


def test_sampled_logprob_is_raw_even_with_k0_and_temperature(engine, hf, prompt):
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True, logprobs=True, top_k=3)
    tokens, logprobs, tops = _tokens_and_logprobs(_run(engine, "k0", prompt, params))
    assert len(logprobs) == len(tokens) == 6 and all(ids == [] for ids, _ in tops)
    ref = _hf_logprobs(hf, prompt + tokens)
    for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        assert abs(logprob - ref[len(prompt) - 1 + i][token].item()) < TOL


def test_requests_without_logprobs_get_none(engine, prompt):
    outputs = _run(engine, "plain", prompt, SamplingParams(temperature=0.0, max_tokens=3))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outputs)


def test_prompt_logprobs_match_transformers_even_after_caching(engine, hf, prompt):
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    _run(engine, "warm", prompt, plain)  # the prompt's full blocks are now cached
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    outputs = _run(engine, "echo", prompt, params)
    firsts = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and outputs[0].prompt_logprobs is not None
    entries = firsts[0]
    assert [e.token_id for e in entries] == prompt and all(e.top == [] for e in entries)
    values = [e.logprob for e in entries]
    assert len(values) == len(prompt) and values[0] is None
    assert outputs[-1].final.num_cached_tokens == 0  # every position was computed
    ref = _hf_logprobs(hf, prompt)
    for p in range(1, len(prompt)):
        assert abs(values[p] - ref[p - 1][prompt[p]].item()) < TOL, p
    assert all(math.isfinite(v) and v <= 0 for v in values[1:])


def test_prompt_logprobs_through_chunked_prefill(model_path, hf, prompt):
    """Prompt logprobs and their top-4 alternatives, the prompt computed 7 tokens a step."""
    engine = LLMEngine(EngineConfig(model_path=model_path, max_num_batched_tokens=7))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=4)
    outputs = _run(engine, "chunked", prompt, params)
    entries = outputs[0].prompt_logprobs
    assert [e.token_id for e in entries] == prompt
    values = [e.logprob for e in entries]
    tops = [([t for t, _ in e.top], [v for _, v in e.top]) for e in entries]
    ref = _hf_logprobs(hf, prompt)
    assert len(values) == len(tops) == len(prompt) and tops[0] == ([], []) and values[0] is None
    for p in range(1, len(prompt)):
        assert abs(values[p] - ref[p - 1][prompt[p]].item()) < TOL, p
        ids, top_values = tops[p]
        assert len(ids) == 4 and top_values == sorted(top_values, reverse=True)
        assert top_values == pytest.approx(ref[p - 1].topk(4).values.tolist(), abs=TOL)
        for tid, value in zip(ids, top_values, strict=True):  # ties may swap places
            assert abs(ref[p - 1][tid].item() - value) < TOL
