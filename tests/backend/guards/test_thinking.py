"""Reasoning and loop guards in the engine, in-process: thinking budget, thinking and
content loops, deadlines, and grammars that wait for the answer.

The thinking model is the default model with `<think>` / `</think>` added as single
tokens (tests/helpers/thinking_model.py): the mechanism is token-level, so it must work on a
model that is no good at reasoning.
"""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from backend.contract import (
    ContractError,
    FinishGuard,
    FinishReason,
    GenerationRequest,
    GuardParams,
    SamplingParams,
)
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion

THINK_END = 49153
SMALL_KV = 128 << 20


@pytest.fixture(scope="module")
def thinker(thinking_model_path):
    return LLMEngine(EngineConfig(model_path=str(thinking_model_path), kv_cache_bytes=SMALL_KV))


@pytest.fixture(scope="module")
def plain(model_path):
    return LLMEngine(EngineConfig(model_path=str(model_path), kv_cache_bytes=SMALL_KV))


def _prompt(engine, content, **template_kwargs):
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False, **template_kwargs
    )


@pytest.mark.parametrize("budget", [0, 1, 7, 20])
def test_a_thinking_budget_forces_the_end_marker_and_the_model_answers(thinker, budget):
    prompt = _prompt(thinker, "Why is the sky blue?")  # the template opens <think>
    request = GenerationRequest(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=budget + 20),
        GuardParams(thinking_budget=budget, loop_min_count=0),
    )
    tokens, finals = run_to_completion(thinker, {f"budget-{budget}": request})
    out, final = tokens[f"budget-{budget}"], finals[f"budget-{budget}"]
    assert out[budget] == THINK_END and THINK_END not in out[:budget]  # forced after exactly N tokens
    assert final.num_reasoning_tokens == budget + 1  # the marker is one token
    assert final.thinking_guard is FinishGuard.THINKING_BUDGET
    assert len(out) > budget + 1  # the answer follows


def test_without_a_budget_thinking_runs_on_and_counts_as_reasoning(thinker):
    prompt = _prompt(thinker, "Why is the sky blue?")
    tokens, finals = run_to_completion(
        thinker, {"free": GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=12))}
    )
    final = finals["free"]
    if THINK_END not in tokens["free"]:  # the random marker row is rarely the argmax
        assert final.num_reasoning_tokens == 12 and final.thinking_guard is None


def test_thinking_off_in_the_template_means_no_reasoning(thinker):
    prompt = _prompt(thinker, "Why is the sky blue?", enable_thinking=False)
    _, finals = run_to_completion(
        thinker, {"off": GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=8))}
    )
    assert finals["off"].num_reasoning_tokens == 0


def test_enable_thinking_forces_a_block_the_prompt_did_not_open(thinker):
    prompt = thinker.tokenizer.encode("Question: why is the sky blue?\nAnswer:")
    request = GenerationRequest(
        prompt, SamplingParams(temperature=0.0, max_tokens=12), GuardParams(enable_thinking=True, thinking_budget=4)
    )
    tokens, finals = run_to_completion(thinker, {"forced-open": request})
    out = tokens["forced-open"]
    assert out[0] == 49152 and out[5] == THINK_END  # <think>, 4 thinking tokens, </think>
    assert finals["forced-open"].num_reasoning_tokens == 6


def test_a_thinking_loop_ends_thinking_and_a_content_loop_ends_the_sequence(thinker):
    """A bias makes the model repeat one token: in thinking, the detector forces
    </think>; in the answer, it finishes the sequence."""
    prompt = _prompt(thinker, "Count.")
    looping = thinker.tokenizer.encode(" la", add_special_tokens=False)[0]
    request = GenerationRequest(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=60, logit_bias_ids=(looping,), logit_bias_values=(30.0,)),
        GuardParams(loop_min_pattern_size=1, loop_max_pattern_size=4, loop_min_count=5),
    )
    tokens, finals = run_to_completion(thinker, {"loops": request})
    out, final = tokens["loops"], finals["loops"]
    assert out[:5] == [looping] * 5 and out[5] == THINK_END
    assert final.thinking_guard is FinishGuard.THINKING_LOOP and final.num_reasoning_tokens == 6
    assert final.finish_guard is FinishGuard.CONTENT_LOOP and final.finish_reason is FinishReason.LENGTH
    assert out[6:] == [looping] * 5  # the answer loops 5 times, and is cut


@pytest.mark.parametrize("count", [3, 6])
def test_the_content_loop_detector_cuts_a_looping_answer_later_with_a_higher_count(plain, count):
    prompt = plain.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3,")
    guards = GuardParams(loop_min_pattern_size=2, loop_max_pattern_size=16)
    guards.loop_min_count = count
    request = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=200), guards)
    tokens, finals = run_to_completion(plain, {f"count-{count}": request})
    final = finals[f"count-{count}"]
    assert final.finish_guard is FinishGuard.CONTENT_LOOP and final.finish_reason is FinishReason.LENGTH
    text = plain.tokenizer.decode(tokens[f"count-{count}"])
    assert text.count("1, 2, 3") in (count - 1, count)  # the prompt's last ", " may start the pattern


def test_the_default_model_loop_guard_is_on_by_default(plain):
    """The shipped preset (backend/settings/presets/SmolLM2-135M-Instruct.toml) turns the
    content loop detector on; ignore_eos (benchmarks) leaves it off unless asked."""
    prompt = plain.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3,")
    _, finals = run_to_completion(
        plain,
        {
            "default": GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=200)),
            "bench": GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)),
        },
    )
    assert finals["default"].finish_guard is FinishGuard.CONTENT_LOOP
    assert finals["bench"].finish_guard is FinishGuard.MAX_TOKENS and finals["bench"].num_output_tokens == 60


def test_a_deadline_ends_a_long_generation_within_about_a_step(plain):
    prompt = plain.tokenizer.encode("Once upon a time")
    request = GenerationRequest(
        prompt, SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True), GuardParams(timeout_s=1.0)
    )
    started = time.monotonic()
    _, finals = run_to_completion(plain, {"deadline": request}, arrival_time=started)
    elapsed = time.monotonic() - started
    final = finals["deadline"]
    assert final.finish_guard is FinishGuard.DEADLINE and final.finish_reason is FinishReason.LENGTH
    assert final.num_output_tokens > 0
    assert 1.0 <= elapsed < 2.0, elapsed  # a decode step on this model is ~40 ms; the rest is slack for busy CI


def test_a_grammar_applies_only_after_thinking(thinker):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    prompt = _prompt(thinker, "What is 2 + 2? Answer in JSON.")
    request = GenerationRequest(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=80),
        GuardParams(thinking_budget=6, loop_min_count=0),
        grammar_kind="json_schema",
        grammar_spec=json.dumps(schema),
    )
    tokens, finals = run_to_completion(thinker, {"json": request})
    out = tokens["json"]
    assert out[6] == THINK_END and finals["json"].finish_guard is FinishGuard.EOS
    # thinking was free: the schema's grammar would have refused it
    grammar = thinker.grammar_compiler().compile("json_schema", json.dumps(schema))
    assert not grammar.new_state().accept_many(out[:6])
    jsonschema.validate(json.loads(thinker.tokenizer.decode(out[7:])), schema)


def test_bad_guard_settings_are_refused_naming_the_field(plain):
    prompt = plain.tokenizer.encode("hi")
    bad = GuardParams(loop_min_pattern_size=8, loop_max_pattern_size=4, loop_min_count=3)
    with pytest.raises(ContractError) as info:
        plain.add_request("bad-loop", GenerationRequest(prompt, guards=bad))
    assert info.value.field == "loop_max_pattern_size"
    assert not plain.has_unfinished_requests()
    with pytest.raises(ContractError) as info:
        GenerationRequest(prompt, guards=GuardParams(thinking_budget=-1)).validate()
    assert info.value.field == "thinking_budget"
