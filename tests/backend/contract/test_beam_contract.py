"""The beam search fields of the contract: what they accept, what they refuse (naming
the field), and the final output's hypotheses over the wire."""

from __future__ import annotations

import pytest

from backend.contract import (
    ContractError,
    FinalEvent,
    FinishGuard,
    FinishReason,
    GenerationRequest,
    GuardParams,
    Hypothesis,
    Logprob,
    RequestOutput,
    SamplingParams,
    decode_output,
    decode_request,
    encode_output,
    encode_request,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _beams(**fields) -> GenerationRequest:
    sampling = fields.pop("sampling", GREEDY)
    return GenerationRequest([1, 2, 3], sampling, num_beams=4, **fields)


def test_a_beam_request_travels_whole():
    request = _beams(num_return_sequences=3, length_penalty=0.6, early_stopping="never")
    assert decode_request(encode_request(request)) == request


@pytest.mark.parametrize(
    ("field", "request_"),
    [
        ("num_beams", GenerationRequest([1], GREEDY, num_beams=0)),
        ("num_return_sequences", _beams(num_return_sequences=5)),
        ("num_return_sequences", _beams(num_return_sequences=0)),
        ("early_stopping", _beams(early_stopping="sometimes")),
        ("length_penalty", GenerationRequest([1], GREEDY, length_penalty=2.0)),
        ("early_stopping", GenerationRequest([1], GREEDY, early_stopping="true")),
        ("temperature", _beams(sampling=SamplingParams(temperature=0.7, max_tokens=8))),
        ("top_p", _beams(sampling=SamplingParams(temperature=0.0, top_p=0.9))),
        ("seed", _beams(sampling=SamplingParams(temperature=0.0, seed=3))),
        ("repetition_penalty", _beams(sampling=SamplingParams(temperature=0.0, repetition_penalty=1.2))),
        ("max_tokens", _beams(sampling=SamplingParams(temperature=0.0, max_tokens=0))),
        ("grammar_kind", _beams(grammar_kind="json_object")),
        ("prediction_tokens", _beams(prediction_tokens=(4, 5))),
        ("require_tool_call", _beams(guards=GuardParams(require_tool_call=True))),
        ("enable_thinking", _beams(guards=GuardParams(enable_thinking=True))),
    ],
)
def test_what_a_beam_search_cannot_take_is_refused_by_name(field, request_):
    with pytest.raises(ContractError) as info:
        decode_request(encode_request(request_))
    assert info.value.field == field


def test_what_applies_to_beams_is_accepted():
    sampling = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, logit_bias_ids=(5,),
                              logit_bias_values=(1.0,), stop_token_ids=(9,), logprobs=True, top_logprobs=2,
                              prompt_logprobs=1)  # fmt: skip
    _beams(sampling=sampling, stream=True, guards=GuardParams(timeout_s=5.0, tools_present=True)).validate()


def test_hypotheses_cross_the_wire_with_their_logprobs():
    final = FinalEvent(FinishReason.STOP, FinishGuard.EOS, num_prompt_tokens=3, num_output_tokens=6)
    hyps = [
        Hypothesis([7, 8], -0.5, FinishReason.STOP, [Logprob(7, -0.1, [(7, -0.1), (3, -2.0)]), Logprob(8, -0.2, [])]),
        Hypothesis([7, 9, 10], -0.9, FinishReason.LENGTH, [Logprob(t, -0.3, []) for t in (7, 9, 10)]),
    ]
    out = RequestOutput("r", [], final=final, hypotheses=hyps)
    back = decode_output(encode_output(out), [1, 2, 3], final=True)
    assert back.token_ids == [] and back.final == final
    assert [(h.token_ids, h.finish_reason) for h in back.hypotheses] == [(h.token_ids, h.finish_reason) for h in hyps]
    assert [round(h.score, 6) for h in back.hypotheses] == [-0.5, -0.9]
    assert back.hypotheses[0].logprobs[0].top == [(7, pytest.approx(-0.1)), (3, -2.0)]
    assert [e.token_id for e in back.hypotheses[1].logprobs] == [7, 9, 10]


def test_hypotheses_without_logprobs_and_an_empty_search():
    final = FinalEvent(FinishReason.ABORT, FinishGuard.CANCELLED, num_prompt_tokens=3, num_output_tokens=0)
    back = decode_output(encode_output(RequestOutput("r", [], final=final, hypotheses=[])), [1, 2, 3], final=True)
    assert back.hypotheses == [] and back.final.finish_reason is FinishReason.ABORT
    hyps = [Hypothesis([4], -1.0, FinishReason.LENGTH)]
    back = decode_output(encode_output(RequestOutput("r", [], final=final, hypotheses=hyps)), [1, 2, 3], final=True)
    assert back.hypotheses[0].logprobs is None and back.hypotheses[0].token_ids == [4]
