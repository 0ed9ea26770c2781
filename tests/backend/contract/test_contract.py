"""The wire contract: config.pbtxt is generated from it, every request field is one named
input and every event field one named output, and requests, outputs, the model's facts
and errors survive a round trip."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from backend.contract import (
    INPUTS,
    OUTPUTS,
    ContractError,
    EngineUnavailable,
    ErrorKind,
    ErrorReport,
    FinalEvent,
    FinishGuard,
    FinishReason,
    GenerationRequest,
    GuardParams,
    Logprob,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    apply_inputs,
    decode_model_info,
    decode_output,
    decode_request,
    encode_model_info,
    encode_output,
    encode_request,
    is_model_info_query,
    model_info_query,
    render_config_pbtxt,
)
from backend.contract.tensors import ADAPTER_COMMAND, INPUTS_BY_NAME, MODEL_INFO_QUERY, REQUEST_INPUTS

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "model_repository" / "llm" / "config.pbtxt"
PARTS = {"": GenerationRequest, "sampling": SamplingParams, "guards": GuardParams}


def _fields(part: str) -> set[str]:
    names = {f.name for f in fields(PARTS[part])}
    return names - {"sampling", "guards"} if part == "" else names


# ---------------------------------------------------------------------------
# the named tensors


def test_config_pbtxt_is_generated_from_the_contract():
    assert CONFIG.is_file(), CONFIG
    assert CONFIG.read_text() == render_config_pbtxt(), (
        "model_repository/llm/config.pbtxt is stale: run "
        "`python -m backend.contract > model_repository/llm/config.pbtxt`"
    )


def test_every_input_is_optional_in_the_config():
    """A model-info query carries no prompt: prompt_tokens is required by decode_request."""
    text = render_config_pbtxt()
    inputs = text[text.index("input [") : text.index("output [")]
    assert inputs.count("optional: true") == len(INPUTS)
    for spec in (*INPUTS, *OUTPUTS):
        assert f'name: "{spec.name}"' in text, spec.name


@pytest.mark.parametrize("part", ["", "sampling", "guards"])
def test_every_request_field_has_exactly_one_input_of_its_name(part):
    names = [spec.name for spec in REQUEST_INPUTS if spec.part == part]
    if part == "":  # the vision field travels as the four vision_* tensors (part "vision")
        names.append("vision")
    assert sorted(names) == sorted(_fields(part))  # each field once, and nothing else
    assert len(set(names)) == len(names)


def test_every_request_input_names_a_field_of_its_part():
    names = [spec.name for spec in REQUEST_INPUTS]
    assert len(set(names)) == len(names)
    for spec in REQUEST_INPUTS:
        if spec.part == "vision":
            assert spec.name.startswith("vision_"), spec.name
            continue
        assert spec.part in PARTS, spec.name
        assert spec.name in _fields(spec.part), spec.name
    # the inputs are the request's, the model-info query and the adapter command, nothing more
    assert INPUTS == (*REQUEST_INPUTS, MODEL_INFO_QUERY, ADAPTER_COMMAND)
    assert set(INPUTS_BY_NAME) == {*names, MODEL_INFO_QUERY.name, ADAPTER_COMMAND.name}


def test_input_shapes_and_types_follow_the_fields():
    """A list field is a list tensor, a bool a bool, a number a number, text text."""
    request = GenerationRequest([1])
    for spec in (s for s in REQUEST_INPUTS if s.part != "vision"):  # the vision field's four: test_vision_contract
        default = getattr(getattr(request, spec.part) if spec.part else request, spec.name)
        assert spec.is_list == isinstance(default, list | tuple), spec.name
        if isinstance(default, bool):
            assert spec.dtype == "bool", spec.name
        elif isinstance(default, int):
            assert spec.dtype in ("int32", "int64"), spec.name
        elif isinstance(default, float):
            assert spec.dtype in ("float32", "float64"), spec.name
        elif isinstance(default, str):
            assert spec.dtype == "bytes", spec.name
    assert INPUTS_BY_NAME["seed"].dtype == "int64"  # a seed is any 64-bit value


def test_every_final_event_field_has_an_output_of_its_name():
    outputs = [spec.name for spec in OUTPUTS]
    assert len(set(outputs)) == len(outputs)
    for f in fields(FinalEvent):
        assert f.name in outputs, f.name
    for name in ("token_ids", "starts_in_thinking", "prompt_logprobs", "model_info"):
        assert name in outputs


# ---------------------------------------------------------------------------
# requests


def _full_request() -> GenerationRequest:
    """Non-default values in every part; floats exact in float32, so equality holds."""
    return GenerationRequest(
        prompt_tokens=[1, 2, 3, 49151],
        sampling=SamplingParams(
            max_tokens=16,
            min_tokens=2,
            temperature=0.5,
            top_k=40,
            top_p=0.875,
            min_p=0.0625,
            repetition_penalty=1.25,
            presence_penalty=-0.5,
            frequency_penalty=1.5,
            dry_multiplier=0.75,
            dry_sequence_breakers=("\n", "é", "zebra"),
            lz_penalty=0.25,
            logit_bias_ids=(7, 9),
            logit_bias_values=(2.5, -100.0),
            seed=2**62 + 12345,
            stop_token_ids=(7, 8),
            ignore_eos=True,
            logprobs=True,
            top_logprobs=5,
            prompt_logprobs=0,
        ),
        guards=GuardParams(
            enable_thinking=True,
            thinking_budget=64,
            loop_min_pattern_size=2,
            loop_max_pattern_size=8,
            loop_min_count=0,
            timeout_s=2.5,
            tools_present=True,
            require_tool_call=True,
        ),
        grammar_kind="json_schema",
        grammar_spec='{"type": "object", "description": "café"}',
        lookup_tenant="acme",
        stream=True,
        disable_mtp=True,
    )


def test_a_request_round_trips_through_named_arrays():
    request = _full_request()
    arrays = encode_request(request)
    for name, array in arrays.items():
        spec = INPUTS_BY_NAME[name]
        assert array.dtype == spec.numpy_dtype, name
        assert array.ndim == 1, name
    assert arrays["seed"].tolist() == [2**62 + 12345]
    decoded = decode_request(arrays)
    assert decoded == request
    assert isinstance(decoded.prompt_tokens, list)
    assert decoded.sampling.seed == 2**62 + 12345 and decoded.sampling.prompt_logprobs == 0
    assert decoded.sampling.dry_sequence_breakers == ("\n", "é", "zebra")
    assert decoded.guards.timeout_s == 2.5 and decoded.guards.loop_min_count == 0


def test_fields_at_their_default_are_left_out():
    assert set(encode_request(GenerationRequest([1]))) == {"prompt_tokens"}
    explicit = GenerationRequest(
        [1],
        SamplingParams(temperature=1.0, seed=None, max_tokens=None, prompt_logprobs=None, stop_token_ids=()),
        GuardParams(thinking_budget=None, timeout_s=None),
        num_beams=1,
        lookup_tenant="",
    )
    assert set(encode_request(explicit)) == {"prompt_tokens"}
    arrays = encode_request(GenerationRequest([1], SamplingParams(temperature=0.5), GuardParams(timeout_s=0.0)))
    assert set(arrays) == {"prompt_tokens", "temperature", "timeout_s"}  # 0 is not the default None


def test_absent_inputs_take_their_defaults():
    decoded = decode_request({"prompt_tokens": np.array([5, 6], dtype=np.int32)})
    assert decoded == GenerationRequest([5, 6])


def test_a_session_hash_crosses_the_wire():
    request = GenerationRequest([1], session_hash="ab12")
    assert decode_request(encode_request(request)).session_hash == "ab12"
    request.validate()


PROMPT = np.array([1], np.int32)


@pytest.mark.parametrize(
    ("arrays", "field"),
    [
        ({}, "prompt_tokens"),
        ({"prompt_tokens": None}, "prompt_tokens"),
        ({"prompt_tokens": PROMPT, "bogus": np.array([1])}, "bogus"),
        ({"prompt_tokens": PROMPT, "model_info": np.array([True])}, "model_info"),  # a query is no request
        ({"prompt_tokens": PROMPT, "max_tokens": np.array([1, 2], np.int32)}, "max_tokens"),
        ({"prompt_tokens": PROMPT, "temperature": np.array([np.nan], np.float32)}, "temperature"),
        ({"prompt_tokens": PROMPT, "timeout_s": np.array([np.inf])}, "timeout_s"),
        ({"prompt_tokens": PROMPT, "lookup_tenant": np.array([b"\xff\xfe"], np.object_)}, "lookup_tenant"),
        (
            {"prompt_tokens": PROMPT, "dry_sequence_breakers": np.array([b"ok", b"\xc3("], np.object_)},
            "dry_sequence_breakers",
        ),
        ({"prompt_tokens": np.array([], np.int32)}, "prompt_tokens"),
        ({"prompt_tokens": PROMPT, "top_p": np.array([0.0], np.float32)}, "top_p"),
    ],
)
def test_malformed_arrays_name_the_field(arrays, field):
    with pytest.raises(ContractError) as info:
        decode_request(arrays)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_decode_checks_the_model_facts_it_is_given():
    arrays = encode_request(GenerationRequest([1, 2, 300]))
    assert decode_request(arrays).prompt_tokens == [1, 2, 300]
    with pytest.raises(ContractError) as info:
        decode_request(arrays, vocab_size=300)
    assert info.value.field == "prompt_tokens" and "300" in info.value.message
    with pytest.raises(ContractError) as info:
        decode_request(arrays, max_model_len=3)  # no room for a generated token
    assert info.value.field == "prompt_tokens"
    assert decode_request(arrays, vocab_size=301, max_model_len=4).prompt_tokens == [1, 2, 300]


# ---------------------------------------------------------------------------
# outputs


def _rich_output() -> RequestOutput:
    return RequestOutput(
        request_id="",  # not on the wire: the frontend knows its request
        token_ids=[5, 6, 7],
        logprobs=[
            Logprob(5, -0.5, [(5, -0.5), (9, -1.25)]),
            Logprob(6, -0.25, [(6, -0.25)]),  # a shorter row: padded on the wire
            Logprob(7, -3.0, [(8, -1.0), (7, -3.0)]),
        ],
        prompt_logprobs=[
            Logprob(1, None, []),  # nothing predicts the first prompt token
            Logprob(2, -2.0, [(4, -0.5)]),
            Logprob(3, -0.75, [(3, -0.75)]),
        ],
        starts_in_thinking=True,
        final=FinalEvent(
            FinishReason.STOP,
            FinishGuard.EOS,
            num_prompt_tokens=3,
            num_output_tokens=4,
            num_cached_tokens=2,
            num_reasoning_tokens=1,
            thinking_guard=FinishGuard.THINKING_BUDGET,
            time_to_first_token_s=0.125,
            decode_time_s=0.5,
            queue_time_s=0.0125,
        ),
    )


def test_an_output_round_trips_through_named_arrays():
    out = _rich_output()
    arrays = encode_output(out)
    assert set(arrays) >= {"token_ids", "token_logprobs", "top_logprob_ids", "prompt_logprobs", "finish_guard"}
    assert arrays["top_logprob_ids"].shape == (3, 2) and arrays["prompt_top_logprob_ids"].shape == (3, 1)
    assert math.isnan(arrays["prompt_logprobs"][0])
    decoded = decode_output(arrays, prompt_tokens=[1, 2, 3], final=True)
    assert decoded == out
    assert decoded.prompt_logprobs[0].logprob is None


def test_a_plain_middle_output_carries_only_its_tokens():
    arrays = encode_output(RequestOutput("r", [4]))
    assert set(arrays) == {"token_ids"}
    assert decode_output(arrays, prompt_tokens=[1], final=False) == RequestOutput("", [4])


def test_a_final_event_with_nothing_optional_round_trips():
    final = FinalEvent(FinishReason.ABORT, FinishGuard.CANCELLED, 5, 0)
    arrays = encode_output(RequestOutput("r", [], final=final))
    for name in ("thinking_guard", "time_to_first_token_s", "queue_time_s"):  # None: left out
        assert name not in arrays
    decoded = decode_output(arrays, prompt_tokens=[1, 2, 3, 4, 5], final=True)
    assert decoded == RequestOutput("", [], final=final)
    assert decoded.finished


def test_a_final_response_without_its_reason_is_refused():
    arrays = encode_output(RequestOutput("r", [1]))
    with pytest.raises(ContractError) as info:
        decode_output(arrays, prompt_tokens=[1], final=True)
    assert info.value.field == "finish_reason"


# ---------------------------------------------------------------------------
# the model's facts and errors


def test_model_info_round_trips():
    info = ModelInfo(
        max_model_len=8192,
        vocab_size=49152,
        sampling_defaults={"temperature": 0.2, "top_p": 0.9, "top_k": 40},
        think_start="<think>",
        think_end="</think>",
        tool_parser="hermes",
        tool_call_start="<tool_call>",
        tool_call_end="</tool_call>",
    )
    assert ModelInfo.decode(info.encode()) == info
    assert decode_model_info(encode_model_info(info)) == info
    query = model_info_query()
    assert is_model_info_query(query) and not is_model_info_query(encode_request(GenerationRequest([1])))
    with pytest.raises(ContractError) as error:
        decode_model_info({})
    assert error.value.field == "model_info"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            ContractError("top_p", "must be in (0, 1]"),
            ErrorReport(ErrorKind.INVALID_REQUEST, "top_p: must be in (0, 1]", "top_p"),
        ),
        (
            EngineUnavailable("the server is shutting down"),
            ErrorReport(ErrorKind.UNAVAILABLE, "the server is shutting down"),
        ),
        (RuntimeError("the engine failed: boom"), ErrorReport(ErrorKind.INTERNAL, "the engine failed: boom")),
        (RuntimeError(), ErrorReport(ErrorKind.INTERNAL, "RuntimeError")),
    ],
)
def test_error_reports_round_trip(error, expected):
    report = ErrorReport.of(error)
    assert report == expected
    assert ErrorReport.decode(report.encode()) == report


@pytest.mark.parametrize(
    "text", ["Stub process 'llm_0_0' is not healthy.", "{}", '{"kind": "nope", "message": "x"}', "[1]"]
)
def test_messages_that_are_not_reports_do_not_decode(text):
    assert ErrorReport.decode(text) is None


# ---------------------------------------------------------------------------
# apply_inputs: fields by their contract names


def test_apply_inputs_sets_fields_by_contract_name():
    request = GenerationRequest([1], SamplingParams(min_p=0.125))
    apply_inputs(
        request,
        {
            "temperature": 1,  # an int is a fine float
            "top_k": 3,
            "seed": 2**40,
            "stop_token_ids": [5, 6],
            "dry_sequence_breakers": ["\n"],
            "thinking_budget": 10,
            "timeout_s": 2,
            "require_tool_call": True,
            "lookup_tenant": "t",
            "min_p": None,  # None: left as it is
        },
    )
    sampling, guards = request.sampling, request.guards
    assert sampling.temperature == 1.0 and isinstance(sampling.temperature, float)
    assert (sampling.top_k, sampling.seed, sampling.min_p) == (3, 2**40, 0.125)
    assert sampling.stop_token_ids == (5, 6) and sampling.dry_sequence_breakers == ("\n",)
    assert guards.thinking_budget == 10 and guards.timeout_s == 2.0 and isinstance(guards.timeout_s, float)
    assert guards.require_tool_call is True and request.lookup_tenant == "t"
    assert decode_request(encode_request(request)) == request  # and it still travels


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"bogus": 1}, "bogus"),
        ({"sampling": {}}, "sampling"),  # a part is not a field
        ({"model_info": True}, "model_info"),
        ({"top_k": True}, "top_k"),  # a bool is not an int
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),  # a string is not a float
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"lookup_tenant": 5}, "lookup_tenant"),
        ({"stop_token_ids": 5}, "stop_token_ids"),  # not a list
        ({"stop_token_ids": [5, "6"]}, "stop_token_ids"),
    ],
)
def test_apply_inputs_refuses_unknown_names_and_wrong_types(values, field):
    request = GenerationRequest([1])
    with pytest.raises(ContractError) as info:
        apply_inputs(request, values)
    assert info.value.field == field
    assert request == GenerationRequest([1])  # nothing was set
