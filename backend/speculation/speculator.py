"""Which sequences draft, how many tokens, and what their drafts earned.

The scheduler asks `propose` for each decoding sequence of a step and reports back
through `verified` what the verify step accepted; the engine feeds `observe` every
step's size and time, for the cost model. A sequence's proposer is fixed at admission
(`admit`): its prediction when the request gave one, else the mode's. `disable_mtp`
(or SPECULATIVE=off) makes a sequence ineligible for its whole life: it gets no state,
and nothing here ever sees it again.

Modes: `auto` drafts only as many tokens as the cost model says pay (backend.speculation.cost);
`ngram`, `draft` and `mtp` always draft the most the limits allow. Either way a draft
never runs past the request's max_tokens, the context, or the step's token budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.contract import GenerationRequest
from backend.speculation.cost import StepCost
from backend.speculation.proposers import NgramProposer, PredictionProposer, Proposer

MODES = ("auto", "off", "ngram", "draft", "mtp")
_PRIOR = {"prediction": 0.6, "ngram": 0.3}  # acceptance assumed before a sequence's first verify
_ALPHA = 0.2  # weight of each verified position in the running acceptance


@dataclass(slots=True)
class SpecState:
    """One speculating sequence's proposer and record; written by the Speculator only."""

    proposer: Proposer
    acceptance: float  # running rate at which a drafted position is accepted
    prediction: np.ndarray | None = None  # the request's predicted tokens
    prediction_pos: int = 0  # where in the prediction the latest draft started
    num_drafted: int = 0
    num_accepted: int = 0  # drafts the verify step took (the bonus token excluded)
    num_prediction_matched: int = 0  # output tokens equal to the prediction where it was aligned


@dataclass(slots=True)
class SpecStats:
    """Engine-wide counters, as vLLM names them (vllm:spec_decode_*)."""

    num_drafts: int = 0  # verify steps of a sequence with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos))


class Speculator:
    def __init__(self, mode: str, max_k: int, max_model_len: int):
        if mode not in MODES:
            raise ValueError(f"SPECULATIVE={mode!r}: expected one of {', '.join(MODES)}")
        if mode in ("draft", "mtp"):
            raise ValueError(f"SPECULATIVE={mode}: this server cannot draft with {mode} yet")
        if max_k < 0:
            raise ValueError(f"SPEC_TOKENS={max_k}: must be 0 or more")
        self.mode, self.max_k, self.max_model_len = mode, max_k, max_model_len
        self.cost = StepCost()
        self.stats = SpecStats(accepted_per_pos=[0] * max_k)
        self._ngram, self._prediction = NgramProposer(), PredictionProposer()

    def admit(self, request: GenerationRequest) -> SpecState | None:
        """A new sequence's state, or None when it never speculates."""
        if request.disable_mtp or self.mode == "off" or self.max_k == 0:
            return None
        if request.prediction_tokens:
            prediction = np.asarray(request.prediction_tokens, dtype=np.int64)
            return SpecState(self._prediction, _PRIOR["prediction"], prediction)
        return SpecState(self._ngram, _PRIOR["ngram"])

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` query tokens took `seconds`."""
        self.cost.observe(num_tokens, seconds)

    def propose(self, seq, budget: int, batch_size: int, num_tokens: int) -> list[int]:
        """Drafts for a decoding sequence (its state in `seq.spec`), within `budget` more
        query tokens, for a step of `batch_size` sequences and `num_tokens` tokens so far."""
        state = seq.spec
        params = seq.sampling
        k = min(self.max_k, budget, self.max_model_len - seq.num_tokens - 1)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - seq.num_output_tokens - 1)
        if self.mode == "auto" and k > 0:
            k = self.cost.drafts_worth(state.acceptance, batch_size, num_tokens + 1, k)
        if k <= 0:
            return []
        return state.proposer.propose(seq.token_ids, seq.num_prompt_tokens, k, state)

    def verified(self, seq, drafts: list[int], accepted: int, emitted: list[int]) -> None:
        """The verify step took `accepted` of `drafts`; `emitted`: the tokens it appended."""
        state, stats = seq.spec, self.stats
        state.num_drafted += len(drafts)
        state.num_accepted += accepted
        for i in range(min(len(drafts), accepted + 1)):  # positions seen: accepted, then the miss
            hit = 1.0 if i < accepted else 0.0
            state.acceptance += _ALPHA * (hit - state.acceptance)
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += accepted
        for i in range(accepted):
            stats.accepted_per_pos[i] += 1
        if state.prediction is not None:
            self._match_prediction(state, emitted)

    @staticmethod
    def _match_prediction(state: SpecState, emitted: list[int]) -> None:
        """Count the emitted tokens that equal the prediction from the draft's start on."""
        prediction, pos = state.prediction, state.prediction_pos
        for token in emitted:
            if pos >= len(prediction) or prediction[pos] != token:
                break
            pos += 1
        state.num_prediction_matched += pos - state.prediction_pos
        state.prediction_pos = pos


def prediction_counts(state: SpecState | None) -> tuple[int, int]:
    """A request's (accepted, rejected) prediction tokens, as OpenAI's usage defines them:
    the prediction's tokens that the output matched where aligned, and the rest. (0, 0)
    without a prediction; the engine-wide counters (SpecStats) count every proposer."""
    if state is None or state.prediction is None:
        return 0, 0
    matched = state.num_prediction_matched
    return matched, len(state.prediction) - matched
