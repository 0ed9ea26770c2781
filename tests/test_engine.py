"""The engine in-process on the real default model: batching changes nothing.

Greedy tokens of prompts run together (mixed lengths, shared prefixes, chunked
prefill, preemption) equal those of each prompt run alone. Parity of the forward
itself with transformers is in test_model_forward.py.
"""

import pytest

from backend.config import EngineConfig
from backend.contract import ContractError
from backend.convert import ensure_default_model
from backend.engine import LLMEngine
from backend.request import EngineRequest, FinishReason, SamplingParams, StopGuard

SYSTEM = "You are a careful assistant. Answer briefly and precisely, in plain English.\n"
PROMPTS = [
    "The three primary colors are",
    SYSTEM + "Question: why is the sky blue?\nAnswer:",
    SYSTEM + "Question: name two prime numbers above 50.\nAnswer:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    SYSTEM + "Question: what is the boiling point of water at sea level?\nAnswer:",
    "1, 2, 3, 5, 8,",
    "Translate to French: 'Good morning, how are you today?'\nFrench:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path():
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def engine(model_path):
    return LLMEngine(EngineConfig(model_path=model_path))


@pytest.fixture(scope="module")
def solo(engine, prompts):
    return [engine.generate([p], GREEDY)[0] for p in prompts]


def test_batch_equals_solo_with_prefix_hits(engine, prompts, solo):
    # the solo runs left every prompt cached: this batch is mostly prefix hits
    assert engine.generate(prompts, GREEDY) == solo


def test_chunked_prefill_and_cold_cache_equal_solo(model_path, prompts, solo):
    cfg = EngineConfig(model_path=model_path, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert LLMEngine(cfg).generate(prompts, GREEDY) == solo


def test_preemption_loses_no_request_and_changes_no_token(model_path, prompts, solo):
    # 40 blocks of 4 tokens cannot hold 8 sequences of ~40 tokens: the scheduler must preempt
    engine = LLMEngine(EngineConfig(model_path=model_path, block_size=4, num_blocks=40))
    assert engine.generate(prompts, GREEDY) == solo
    assert engine.num_preemptions > 0
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_max_tokens_min_tokens_and_stop_tokens(engine, prompts, solo):
    [cut] = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert cut == solo[0][:5]
    stop_at = solo[1][3]
    [stopped] = engine.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop_at,)))
    assert stopped == solo[1][: solo[1].index(stop_at)]  # the stop token is not emitted


def test_final_event_reports_reason_counts_and_cache_hits(engine, prompts):
    rid = "final-event"
    engine.add_request(EngineRequest(rid, prompts[1], SamplingParams(temperature=0.0, max_tokens=3)))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    final = outs[-1].final
    assert final.finish_reason is FinishReason.LENGTH and final.stop_guard is StopGuard.MAX_TOKENS
    assert final.prompt_tokens == len(prompts[1]) and final.completion_tokens == 3
    assert sum(len(o.new_token_ids) for o in outs) == 3
    # prompts[1] ran before in this module: all its full blocks but the last token's are hits
    assert final.cached_prompt_tokens == (len(prompts[1]) - 1) // 16 * 16
    assert final.time_to_first_token_s > 0 and final.decode_time_s > 0


def test_abort_frees_blocks_and_ends_with_abort(engine, prompts):
    engine.add_request(EngineRequest("to-abort", prompts[4], SamplingParams(max_tokens=100)))
    engine.step()
    assert engine.num_free_blocks() < engine.num_total_blocks()
    engine.abort_request("to-abort")
    [out] = engine.step()
    assert out.final.finish_reason is FinishReason.ABORT and out.final.stop_guard is StopGuard.CANCELLED
    assert engine.num_free_blocks() == engine.num_total_blocks()
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ([], SamplingParams(), "prompt_tokens"),
        ([1, 10**6], SamplingParams(), "prompt_tokens"),
        ([1] * 9000, SamplingParams(), "prompt_tokens"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(presence_penalty=3.0), "presence_penalty"),
        ([1, 2], SamplingParams(logit_bias_ids=(10**6,), logit_bias_values=(1.0,)), "logit_bias_ids"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(engine, prompt, params, field):
    with pytest.raises(ContractError) as err:
        engine.add_request(EngineRequest("bad", prompt, params))
    assert err.value.field == field
    assert not engine.has_unfinished_requests()


def test_penalized_rows_in_a_batch_equal_each_row_alone(engine, prompts):
    """The engine hands each row its own prompt and output history."""
    penalized = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.8
    )
    params = [penalized, GREEDY, penalized, GREEDY]
    chosen = [prompts[0], prompts[3], prompts[6], prompts[4]]
    alone = [engine.generate([p], sp)[0] for p, sp in zip(chosen, params, strict=True)]
    assert engine.generate(chosen, params) == alone
    assert alone[0] != engine.generate([chosen[0]], GREEDY)[0][:16]  # and the penalty did something
