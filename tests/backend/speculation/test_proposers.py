"""Where drafts come from: prompt lookup, Predicted Outputs, and the cost model that
decides how many a step should verify."""

import numpy as np
import pytest

from backend.contract import GenerationRequest, SamplingParams
from backend.speculation.cost import StepCost
from backend.speculation.proposers import NgramProposer, PredictionProposer
from backend.speculation.speculator import SpecState, Speculator


def test_ngram_proposes_what_followed_the_longest_suffix_seen_before():
    ngram = NgramProposer(min_n=2, max_n=4)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 8, 2, 9, 6, 7, 8]
    # the suffix 6 7 8 occurred at 1 and 5; the latest occurrence (5) proposes 2 9 6 ...
    assert ngram.propose(tokens, 4, k=3) == [2, 9, 6]
    assert ngram.propose(tokens, 4, k=1) == [2]
    # a longer suffix wins over a later, shorter one
    tokens = [1, 2, 3, 4, 50, 9, 3, 4, 60, 2, 3, 4]
    assert ngram.propose(tokens, 0, k=2) == [50, 9]


def test_ngram_needs_min_n_tokens_of_match_and_something_after_it():
    ngram = NgramProposer(min_n=2, max_n=4)
    assert ngram.propose([1, 2, 3, 4, 5, 6], 0, k=4) == []  # no repeat at all
    assert ngram.propose([1, 2, 3, 9, 3], 0, k=4) == []  # only a 1-token suffix repeats
    # the only earlier occurrence of the suffix ends right before it: what follows is the suffix itself
    assert ngram.propose([7, 7, 7], 0, k=2) == [7]


def _prediction_state(prediction: list[int]) -> SpecState:
    return SpecState(PredictionProposer(), 0.5, np.asarray(prediction, dtype=np.int64))


def test_prediction_starts_at_its_start_and_follows_the_output():
    proposer, state = PredictionProposer(), _prediction_state([10, 11, 12, 13, 14, 15, 16])
    prompt = [1, 2, 3]
    assert proposer.propose(prompt, 3, 3, state) == [10, 11, 12]
    assert proposer.propose([*prompt, 10, 11], 3, 3, state) == [12, 13, 14]
    assert state.prediction_pos == 2


def test_prediction_realigns_after_the_output_departs_from_it():
    """An edit: the output replaced 12 13 by 99, then went on as predicted."""
    proposer, state = PredictionProposer(), _prediction_state([10, 11, 12, 13, 14, 15, 16, 17])
    prompt = [1]
    assert proposer.propose([*prompt, 10, 11, 99], 1, 3, state) == []  # 99 is nowhere in the prediction
    assert proposer.propose([*prompt, 10, 11, 99, 14], 1, 3, state) == [15, 16, 17]
    assert proposer.propose([*prompt, 10, 11, 99, 14, 15, 16, 17], 1, 3, state) == []  # its end


def test_prediction_alignment_moves_forward_through_repeats():
    """A repeated line: the match at or after the last draft is taken, not the first."""
    proposer, state = PredictionProposer(), _prediction_state([7, 8, 1, 7, 8, 2, 7, 8, 3])
    output = [7, 8, 1, 7, 8]
    state.prediction_pos = 5
    assert proposer.propose([0, *output], 1, 2, state) == [2, 7]


def test_step_cost_recovers_a_linear_step_time():
    cost = StepCost()
    assert cost.per_token(4) == (1.0 / 4, 1.0)  # no evidence: an extra token costs a whole step's share
    for n in [1, 5, 1, 3, 64, 1, 2, 1, 9, 1] * 3:
        cost.observe(n, 0.030 + 0.002 * n)
    extra, step = cost.per_token(16)
    assert extra == pytest.approx(0.002, rel=1e-6)
    assert step == pytest.approx(0.030 + 0.002 * 16, rel=1e-6)


def test_drafts_pay_less_as_the_batch_grows_and_acceptance_falls():
    cost = StepCost()
    for n in [1, 5, 1, 3, 64, 1, 2, 1, 9, 1] * 3:
        cost.observe(n, 0.030 + 0.002 * n)
    one = [cost.drafts_worth(r, 1, 1, 8) for r in (0.9, 0.6, 0.3, 0.05)]
    assert one == sorted(one, reverse=True) and one[0] == 8 and one[-1] == 0
    many = [cost.drafts_worth(0.4, b, 2 * b, 8) for b in (1, 8, 32, 128)]
    assert many == sorted(many, reverse=True) and many[-1] == 0


def test_speculator_limits_drafts_to_what_the_request_and_context_allow():
    class Seq:
        def __init__(self, request, output):
            self.request, self.sampling = request, request.sampling
            self.token_ids = [*request.prompt_tokens, *output]
            self.num_prompt_tokens = len(request.prompt_tokens)
            self.num_tokens, self.num_output_tokens = len(self.token_ids), len(output)

    spec = Speculator("ngram", 4, max_model_len=40)
    request = GenerationRequest([1, 2, 3, 1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=3))
    seq = Seq(request, [1])
    seq.spec = spec.admit(request)
    assert spec.propose(seq, budget=100, batch_size=1, num_tokens=1) == [2]  # 3 - 1 emitted - 1 sampled
    seq = Seq(GenerationRequest(request.prompt_tokens), [1, 2, 3] * 9 + [1])  # 37 tokens of a 40-token context
    seq.spec = spec.admit(seq.request)
    assert len(spec.propose(seq, budget=100, batch_size=1, num_tokens=1)) == 2
    assert len(spec.propose(seq, budget=1, batch_size=1, num_tokens=1)) == 1
    assert spec.admit(GenerationRequest([1], disable_mtp=True)) is None
    assert Speculator("off", 4, 40).admit(GenerationRequest([1])) is None
    with pytest.raises(ValueError, match="SPECULATIVE='fast'"):
        Speculator("fast", 4, 40)
