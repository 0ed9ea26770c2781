"""The engine in-process on the real default model: batching changes nothing.

Greedy tokens of prompts run together (mixed lengths, shared prefixes, chunked
prefill, preemption) equal those of each prompt run alone. Parity of the forward
itself with transformers is in test_model_forward.py.
"""

import pytest

from backend.contract import ContractError, FinishGuard, FinishReason, GenerationRequest, GuardParams, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.convert import ensure_default_model
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion

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
    engine.add_request(rid, GenerationRequest(prompts[1], SamplingParams(temperature=0.0, max_tokens=3)))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    final = outs[-1].final
    assert final.finish_reason is FinishReason.LENGTH and final.finish_guard is FinishGuard.MAX_TOKENS
    assert final.num_prompt_tokens == len(prompts[1]) and final.num_output_tokens == 3
    assert sum(len(o.token_ids) for o in outs) == 3
    # prompts[1] ran before in this module: all its full blocks but the last token's are hits
    assert final.num_cached_tokens == (len(prompts[1]) - 1) // 16 * 16
    assert final.time_to_first_token_s > 0 and final.decode_time_s > 0


def test_abort_frees_blocks_and_ends_with_abort(engine, prompts):
    engine.add_request("to-abort", GenerationRequest(prompts[4], SamplingParams(max_tokens=100)))
    engine.step()
    assert engine.num_free_blocks() < engine.num_total_blocks()
    engine.abort_request("to-abort")
    [out] = engine.step()
    assert out.final.finish_reason is FinishReason.ABORT and out.final.finish_guard is FinishGuard.CANCELLED
    assert engine.num_free_blocks() == engine.num_total_blocks()
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ([], SamplingParams(), "prompt_tokens"),
        ([1, 10**6], SamplingParams(), "prompt_tokens"),
        ([1] * 9000, SamplingParams(), "prompt_tokens"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(max_tokens=-1), "max_tokens"),
        ([1, 2], SamplingParams(presence_penalty=3.0), "presence_penalty"),
        ([1, 2], SamplingParams(logit_bias_ids=(10**6,), logit_bias_values=(1.0,)), "logit_bias_ids"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(engine, prompt, params, field):
    """The engine trusts its requests: they are validated against its model's facts
    (vocabulary, context) where they are built or decoded."""
    with pytest.raises(ContractError) as err:
        GenerationRequest(prompt, params).validate(engine.vocab_size, engine.max_model_len)
    assert err.value.field == field


def test_a_request_id_already_in_flight_is_refused(engine, prompts):
    engine.add_request("twice", GenerationRequest(prompts[0], GREEDY))
    with pytest.raises(ContractError) as err:
        engine.add_request("twice", GenerationRequest(prompts[1], GREEDY))
    assert err.value.field == "request_id"
    assert engine.request_ids() == ["twice"]
    engine.abort_request("twice")
    while engine.has_unfinished_requests():
        engine.step()


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


def test_dry_breaker_strings_become_the_tokens_that_hold_them(engine, tokenizer, prompts):
    """DRY's breakers come as strings (llama.cpp's by default); a token breaks a repeat
    when its text holds one."""
    engine.add_request("dry-default", GenerationRequest(prompts[0], SamplingParams(max_tokens=1, dry_multiplier=0.8)))
    custom = SamplingParams(max_tokens=1, dry_multiplier=0.8, dry_sequence_breakers=("zebra",))
    engine.add_request("dry-custom", GenerationRequest(prompts[0], custom))
    default_ids = engine.scheduler.requests["dry-default"].dry_breaker_ids
    custom_ids = engine.scheduler.requests["dry-custom"].dry_breaker_ids
    while engine.has_unfinished_requests():
        engine.step()
    newline, colon = tokenizer.encode("\n")[0], tokenizer.encode(":")[0]
    ids = set(default_ids)
    assert {newline, colon} <= ids and all(any(b in tokenizer.decode([i]) for b in '\n:"*') for i in ids)
    zebra = [tokenizer.decode([i]) for i in custom_ids]
    assert zebra and all("zebra" in text for text in zebra) and newline not in custom_ids


def test_grammar_rows_follow_their_schema_and_leave_their_neighbours_alone(engine, tokenizer, prompts, solo):
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 30}, "n": {"type": "integer", "minimum": 3}},
        "required": ["answer", "n"],
    }
    question = tokenizer.apply_chat_template(
        [{"role": "user", "content": 'Reply with a JSON object with keys "answer" and "n": what is 2 + 2?'}],
        add_generation_prompt=True,
        return_dict=False,
    )
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=120)
    spec = json.dumps(schema)
    requests = {
        "json": GenerationRequest(
            question, SamplingParams(temperature=0.0, max_tokens=120), grammar_kind="json_schema", grammar_spec=spec
        ),
        "json-sampled": GenerationRequest(question, sampled, grammar_kind="json_schema", grammar_spec=spec),
        "object": GenerationRequest(
            question, SamplingParams(temperature=0.0, max_tokens=200), grammar_kind="json_object"
        ),
        "free-0": GenerationRequest(prompts[0], GREEDY),
        "free-4": GenerationRequest(prompts[4], GREEDY),
    }
    tokens, finals = run_to_completion(engine, requests)
    for rid in ("json", "json-sampled"):
        assert finals[rid].finish_guard is FinishGuard.EOS
        jsonschema.validate(json.loads(tokenizer.decode(tokens[rid])), schema)
    assert finals["object"].finish_guard is FinishGuard.EOS, tokenizer.decode(tokens["object"])
    assert isinstance(json.loads(tokenizer.decode(tokens["object"])), dict)
    assert tokens["free-0"] == solo[0] and tokens["free-4"] == solo[4]


def test_a_grammar_that_does_not_compile_is_refused_naming_the_spec(engine, prompts):
    bad = GenerationRequest(prompts[0], GREEDY, grammar_kind="json_schema", grammar_spec='{"type": 12}')
    with pytest.raises(ContractError) as info:
        engine.add_request("bad-grammar", bad)
    assert info.value.field == "grammar_spec"
    with pytest.raises(ContractError) as info:
        engine.add_request("bad-kind", GenerationRequest(prompts[0], GREEDY, grammar_kind="yaml"))
    assert info.value.field == "grammar_kind"
    # prepare (the model's, on Triton's thread) refuses them the same way
    with pytest.raises(ContractError) as info:
        engine.prepare(bad)
    assert info.value.field == "grammar_spec"
    assert not engine.has_unfinished_requests()


def test_tool_guards_require_and_suppress_the_call_trigger(engine, tokenizer):
    """require_tool_call holds EOS back until the output writes `<tool_call>`;
    suppress_tool_call never lets it be written (the default model's trigger is 5 tokens)."""
    trigger = tokenizer.encode("<tool_call>", add_special_tokens=False)
    prompt = tokenizer.encode("To call a tool, write <tool_call>. Now call it: <tool_call>. Again: <tool_call>. Again:")
    greedy = dict(temperature=0.0, max_tokens=40)
    bias = dict(logit_bias_ids=tuple(trigger), logit_bias_values=(5.0,) * len(trigger))
    tokens, _ = run_to_completion(
        engine,
        {
            "suppressed": GenerationRequest(
                prompt, SamplingParams(**greedy, **bias), GuardParams(suppress_tool_call=True)
            ),
            "free": GenerationRequest(prompt, SamplingParams(**greedy, **bias)),
            "required": GenerationRequest(
                prompt, SamplingParams(temperature=0.0, max_tokens=3), GuardParams(require_tool_call=True)
            ),
        },
    )

    triggers = [list(t) for t in engine.guards.tools.triggers]  # "<tool_call>" and " <tool_call>"
    assert trigger in triggers and len(triggers) == 2

    def opens_call(ids):
        return any(ids[i : i + len(t)] == t for t in triggers for i in range(len(ids)))

    assert opens_call(tokens["free"])  # the biased prompt does write the trigger...
    assert not opens_call(tokens["suppressed"])  # ...unless suppressed
    assert engine.eos_token_ids[0] not in tokens["required"]


def test_max_tokens_0_computes_the_prompt_and_generates_nothing(engine, prompts):
    """Scoring a prompt (completions echo with max_tokens 0): its logprobs, no token."""
    request = GenerationRequest(prompts[1], SamplingParams(max_tokens=0, prompt_logprobs=1))
    request.validate(engine.vocab_size, engine.max_model_len)
    outputs = []
    engine.add_request("score", request)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    assert out.token_ids == [] and out.final.num_output_tokens == 0
    assert out.final.finish_guard is FinishGuard.MAX_TOKENS and out.final.time_to_first_token_s is None
    assert [lp.token_id for lp in out.prompt_logprobs] == prompts[1]
    assert out.prompt_logprobs[0].logprob is None and all(len(lp.top) == 1 for lp in out.prompt_logprobs[1:])
    assert engine.num_free_blocks() == engine.num_total_blocks()  # its blocks went back to the pool
