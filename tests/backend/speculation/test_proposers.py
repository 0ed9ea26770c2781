"""Where drafts come from: prompt lookup, Predicted Outputs, and the cost model that
decides how many a step should verify."""

from types import SimpleNamespace

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
    assert ngram.draft(tokens, 4, k=3) == [2, 9, 6]
    assert ngram.draft(tokens, 4, k=1) == [2]
    # a longer suffix wins over a later, shorter one
    tokens = [1, 2, 3, 4, 50, 9, 3, 4, 60, 2, 3, 4]
    assert ngram.draft(tokens, 0, k=2) == [50, 9]


def test_ngram_needs_min_n_tokens_of_match_and_something_after_it():
    ngram = NgramProposer(min_n=2, max_n=4)
    assert ngram.draft([1, 2, 3, 4, 5, 6], 0, k=4) == []  # no repeat at all
    assert ngram.draft([1, 2, 3, 9, 3], 0, k=4) == []  # only a 1-token suffix repeats
    # the only earlier occurrence of the suffix ends right before it: what follows is the suffix itself
    assert ngram.draft([7, 7, 7], 0, k=2) == [7]


def _prediction_state(prediction: list[int]) -> SpecState:
    return SpecState(PredictionProposer(), 0.5, np.asarray(prediction, dtype=np.int64))


def test_prediction_starts_at_its_start_and_follows_the_output():
    proposer, state = PredictionProposer(), _prediction_state([10, 11, 12, 13, 14, 15, 16])
    prompt = [1, 2, 3]
    assert proposer.draft(prompt, 3, 3, state) == [10, 11, 12]
    assert proposer.draft([*prompt, 10, 11], 3, 3, state) == [12, 13, 14]
    assert state.prediction_pos == 2


def test_prediction_realigns_after_the_output_departs_from_it():
    """An edit: the output replaced 12 13 by 99, then went on as predicted."""
    proposer, state = PredictionProposer(), _prediction_state([10, 11, 12, 13, 14, 15, 16, 17])
    prompt = [1]
    assert proposer.draft([*prompt, 10, 11, 99], 1, 3, state) == []  # 99 is nowhere in the prediction
    assert proposer.draft([*prompt, 10, 11, 99, 14], 1, 3, state) == [15, 16, 17]
    assert proposer.draft([*prompt, 10, 11, 99, 14, 15, 16, 17], 1, 3, state) == []  # its end


def test_prediction_alignment_moves_forward_through_repeats():
    """A repeated line: the match at or after the last draft is taken, not the first."""
    proposer, state = PredictionProposer(), _prediction_state([7, 8, 1, 7, 8, 2, 7, 8, 3])
    output = [7, 8, 1, 7, 8]
    state.prediction_pos = 5
    assert proposer.draft([0, *output], 1, 2, state) == [2, 7]


def _measured(table: dict[int, float], rounds: int = 5) -> StepCost:
    cost = StepCost()
    for _ in range(rounds):
        for n, seconds in table.items():
            cost.observe(n, seconds)
    return cost


def test_step_cost_is_the_measured_table_between_and_past_its_counts():
    cost = StepCost()
    cost.observe(1, 0.030)
    assert cost.time(1) is None  # one count says nothing of what another costs
    cost = _measured({1: 0.030, 5: 0.034, 16: 0.100, 20: 0.110})
    assert cost.time(5) == pytest.approx(0.034)
    assert cost.time(3) == pytest.approx(0.032)  # between: interpolated
    assert cost.time(24) == pytest.approx(0.120)  # past the largest: its last slope
    cost.observe(5, 0.050)  # the latest steps weigh most
    assert 0.034 < cost.time(5) < 0.050


def test_a_plan_drafts_while_the_expected_tokens_outgrow_the_measured_time():
    flat = _measured({1: 0.030, 2: 0.031, 3: 0.032, 4: 0.033, 5: 0.034, 300: 0.400})
    assert flat.plan([0.9], [4], 1, 1) == [4]  # one stream, weight-bound: cheap drafts
    assert flat.plan([0.05], [4], 1, 1) == [0]  # rarely accepted: not worth even 3%
    assert flat.plan([0.9, 0.5, 0.0], [4, 4, 4], 3, 3) == [4, 2, 0]  # the likeliest first; a sure miss never
    # 16 streams where a 17th row costs a tenth of the step (a GEMM block edge), 18-20 little more
    cliff = _measured({16: 0.100, 17: 0.110, 18: 0.111, 19: 0.112, 20: 0.113, 32: 0.200})
    assert cliff.plan([0.3] * 16, [4] * 16, 16, 16) == [0] * 16
    assert sum(cliff.plan([0.9] * 16, [4] * 16, 16, 16)) == 4  # past the edge, the next rows are nearly free
    assert StepCost().plan([0.9], [4], 1, 1) == [0]  # nothing measured yet


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
    assert spec.limit(seq, budget=100) == 1  # 3 - 1 emitted - 1 sampled
    assert spec.propose([(seq, 1)]) == [[2]]
    seq = Seq(GenerationRequest(request.prompt_tokens), [1, 2, 3] * 9 + [1])  # 37 tokens of a 40-token context
    seq.spec = spec.admit(seq.request)
    assert spec.limit(seq, budget=100) == 2
    assert spec.limit(seq, budget=1) == 1
    assert spec.plan([seq], [2], 1, 1) == [2]  # SPECULATIVE=ngram: the limit, no cost model
    assert spec.propose([(seq, 2)]) == [[2, 3]]
    assert spec.admit(GenerationRequest([1], disable_mtp=True)) is None
    assert Speculator("off", 4, 40).admit(GenerationRequest([1])) is None
    with pytest.raises(ValueError, match="SPECULATIVE='fast'"):
        Speculator("fast", 4, 40)


def test_a_new_sequence_starts_from_its_proposers_rate_over_the_sequences_before_it():
    class Seq:
        pass

    spec = Speculator("auto", 4, max_model_len=100)
    first = spec.admit(GenerationRequest([1, 2, 3]))
    assert first.acceptance == 0.3  # n-gram's prior
    seq = Seq()
    seq.spec = first
    for _ in range(20):
        spec.verified(seq, [5, 6, 7, 8], 0, [9])  # every draft missed
    assert first.acceptance < 0.01
    later = spec.admit(GenerationRequest([1, 2, 3]))
    assert later.acceptance < 0.15  # drafts missed before: the next sequence does not start hopeful
    assert spec.admit(GenerationRequest([1, 2, 3], prediction_tokens=(4, 5))).acceptance == 0.6  # another proposer


def _counted(prediction: list[int], output: list[int], steps: list[int]) -> int:
    """OpenAI's accepted_prediction_tokens for `output`, appended `steps[i]` tokens a step."""
    speculator = Speculator("auto", 4, 4096)
    seq = SimpleNamespace(spec=_prediction_state(prediction), token_ids=[1, 2], num_prompt_tokens=2)
    done = 0
    for size in steps:
        seq.token_ids += output[done : done + size]
        speculator.emitted(seq, output[done : done + size])
        done += size
    assert done == len(output)
    return seq.spec.num_prediction_matched


@pytest.mark.parametrize("steps", [[1] * 7, [3, 1, 3], [7]], ids=["plain", "drafts", "one-step"])
def test_usage_counts_the_prediction_tokens_the_output_reproduced_however_it_was_stepped(steps):
    """An edit: 12 13 became 99; the 6 tokens around it appeared, whether drafted or not."""
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    assert _counted(prediction, [10, 11, 99, 14, 15, 16, 17], steps) == 6


def test_usage_counts_each_prediction_token_once_and_only_in_order():
    prediction = [10, 11, 12, 13]
    assert _counted(prediction, [10, 11, 12, 13, 10, 11, 12, 13], [8]) == 4  # the output repeats it
    assert _counted(prediction, [13, 12, 11, 10], [1] * 4) == 1  # reversed: one of them is in order
    assert _counted(prediction, [5, 6, 7], [1] * 3) == 0
    # a lone token found far ahead (3) does not move the count past what the output goes on to match
    assert _counted([10, 11, 12, 13, 14, 3, 20], [10, 3, 11, 12, 13, 14], [1] * 6) == 5
