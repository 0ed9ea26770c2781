"""Which sequences draft, how many tokens, and what their drafts earned.

The scheduler asks `limit` and then `plan` how many tokens each sampling sequence of
a step drafts, makes room for them, asks `propose` for them all at once, and reports back
through `verified` what the verify step accepted; the engine feeds `observe` every
step's size and time, for the cost model, and `keep_hidden` its hidden states, for
MTP. A sequence's proposer is fixed at admission (`admit`): its prediction when the
request gave one, else the mode's. `disable_mtp` (or SPECULATIVE=off) makes a
sequence ineligible for its whole life: it gets no state, and nothing here ever sees
it again.

Modes: `auto` drafts only as many tokens as the cost model says pay (backend.speculation.cost),
from SPEC_DRAFT_MODEL when one is set, else from the checkpoint's MTP layers when it
has them, else by n-gram lookup; `ngram`, `draft` and `mtp` always draft the most the
limits allow, from that proposer. Either way a draft never runs past the request's
max_tokens, the context, or the step's token budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.contract import GenerationRequest
from backend.speculation.cost import StepCost
from backend.speculation.model_proposers import DraftModelProposer, MtpProposer
from backend.speculation.proposers import NgramProposer, PredictionProposer, Proposer, Want, occurrences

MODES = ("auto", "off", "ngram", "draft", "mtp")
# a new sequence's acceptance is its proposer's rate over the sequences before it (weight
# _RATE_ALPHA per verified position), starting from these priors
_PRIOR = {"prediction": 0.6, "ngram": 0.3, "draft": 0.6, "mtp": 0.6}
_ALPHA = 0.2  # weight of each verified position in a sequence's running acceptance
_RATE_ALPHA = 0.05
_PROBE_EVERY = 16  # in auto mode, a sequence the cost model stopped drafts one token this often
_REALIGN_N = (8, 2)  # usage's count re-aligns on the longest output suffix of 8..2 tokens found ahead


@dataclass(slots=True)
class SpecState:
    """One speculating sequence's proposer and record; written by the Speculator only."""

    proposer: Proposer
    acceptance: float  # running rate at which a drafted position is accepted
    prediction: np.ndarray | None = None  # the request's predicted tokens
    prediction_pos: int = 0  # where in the prediction the latest draft started
    num_drafted: int = 0
    num_accepted: int = 0  # drafts the verify step took (the bonus token excluded)
    match_pos: int = 0  # usage's count: where in the prediction the next output token is compared
    num_prediction_matched: int = 0  # usage's count: prediction tokens the output reproduced, in order
    place: Any = None  # where a model proposer's own KV stands (backend.speculation.model_proposers)
    idle_steps: int = 0  # sampling steps since its last draft (auto mode probes after _PROBE_EVERY)


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
    def __init__(self, mode: str, max_k: int, max_model_len: int, runner=None):
        """`runner`: the ModelRunner, whose drafters (MTP layers, draft model) propose."""
        if mode not in MODES:
            raise ValueError(f"SPECULATIVE={mode!r}: expected one of {', '.join(MODES)}")
        if max_k < 0:
            raise ValueError(f"SPEC_TOKENS={max_k}: must be 0 or more")
        self.mode, self.max_k, self.max_model_len = mode, max_k, max_model_len
        self.cost = StepCost()
        self.stats = SpecStats(accepted_per_pos=[0] * max_k)
        self._ngram, self._prediction = NgramProposer(), PredictionProposer()
        self._default = self._default_proposer(mode, runner)
        self._rates: dict[str, float] = {}  # each proposer's acceptance over all its sequences

    def _default_proposer(self, mode: str, runner) -> Proposer:
        """The proposer of a sequence without a prediction."""
        draft, mtp = getattr(runner, "draft", None), getattr(runner, "mtp", None)
        if mode == "draft" and draft is None:
            raise ValueError("SPECULATIVE=draft needs SPEC_DRAFT_MODEL=/path/to/a smaller model, same tokenizer")
        if mode == "mtp" and mtp is None:
            raise ValueError("SPECULATIVE=mtp: this checkpoint ships no MTP layers (config num_nextn_predict_layers)")
        if mode in ("auto", "draft") and draft is not None:
            return DraftModelProposer(draft)
        if mode in ("auto", "mtp") and mtp is not None:
            return MtpProposer(mtp)
        return self._ngram

    def admit(self, request: GenerationRequest) -> SpecState | None:
        """A new sequence's state, or None when it never speculates."""
        if request.disable_mtp or self.mode == "off" or self.max_k == 0:
            return None
        if request.prediction_tokens:
            prediction = np.asarray(request.prediction_tokens, dtype=np.int64)
            return SpecState(self._prediction, self._rate(self._prediction.name), prediction)
        return SpecState(self._default, self._rate(self._default.name))

    def _rate(self, name: str) -> float:
        return self._rates.setdefault(name, _PRIOR.get(name, 0.3))

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` query tokens took `seconds`."""
        self.cost.observe(num_tokens, seconds)

    def limit(self, seq, budget: int) -> int:
        """The most tokens a sampling sequence may draft: within `budget`, the request's
        max_tokens and the context."""
        k = min(self.max_k, budget, self.max_model_len - seq.num_tokens - 1)
        if seq.sampling.max_tokens is not None:
            k = min(k, seq.sampling.max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    def plan(self, seqs: list, limits: list[int], num_tokens: int, num_sampling: int) -> list[int]:
        """How many tokens each of a step's drafting sequences drafts (at most its limit),
        for a step of `num_tokens` query tokens so far and `num_sampling` sampling sequences."""
        if self.mode != "auto":
            return list(limits)
        ks = self.cost.plan([seq.spec.acceptance for seq in seqs], limits, num_tokens, num_sampling)
        for i, seq in enumerate(seqs):
            # a probe now and then: acceptance changes with the text (an answer that starts
            # quoting), and only a verified draft can show it
            state = seq.spec
            state.idle_steps = 0 if ks[i] else state.idle_steps + 1
            if state.idle_steps > _PROBE_EVERY and limits[i]:
                ks[i], state.idle_steps = 1, 0
        return ks

    def propose(self, wants: list[Want]) -> list[list[int]]:
        """Drafts for each (sequence, k), each proposer asked once for all its sequences."""
        drafts: list[list[int]] = [[] for _ in wants]
        by_proposer: dict[int, list[int]] = {}
        for i, (seq, _) in enumerate(wants):
            by_proposer.setdefault(id(seq.spec.proposer), []).append(i)
        for indices in by_proposer.values():
            proposer = wants[indices[0]][0].spec.proposer
            for i, found in zip(indices, proposer.propose([wants[i] for i in indices]), strict=True):
                drafts[i] = found[: wants[i][1]]
        return drafts

    def keep_hidden(self, scheduled, starts: list[int], hidden, query_start: list[int]) -> None:
        """After a step: hand each MTP sequence the hidden states of the positions the
        step committed (from `starts[i]`, its first position this step)."""
        if not isinstance(self._default, MtpProposer):
            return  # no sequence drafts with MTP: nothing to keep, every step
        for i, (item, start) in enumerate(zip(scheduled, starts, strict=True)):
            seq = item.seq
            if seq.spec is None or seq.is_finished or not isinstance(seq.spec.proposer, MtpProposer):
                continue
            committed = seq.num_computed_tokens - start
            seq.spec.proposer.keep(seq, start, hidden[query_start[i] : query_start[i] + committed])

    def verified(self, seq, drafts: list[int], accepted: int, emitted: list[int]) -> None:
        """The verify step took `accepted` of `drafts`; `emitted`: the tokens it appended."""
        state, stats = seq.spec, self.stats
        state.num_drafted += len(drafts)
        state.num_accepted += accepted
        for i in range(min(len(drafts), accepted + 1)):  # positions seen: accepted, then the miss
            hit = 1.0 if i < accepted else 0.0
            state.acceptance += _ALPHA * (hit - state.acceptance)
            name = state.proposer.name
            self._rates[name] = self._rate(name) + _RATE_ALPHA * (hit - self._rate(name))
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += accepted
        for i in range(accepted):
            stats.accepted_per_pos[i] += 1
        if state.prediction is not None:
            _advance(state, emitted)

    def emitted(self, seq, tokens: list[int]) -> None:
        """A step appended `tokens` to `seq`, drafted or not: count the prediction tokens
        they reproduce (OpenAI's accepted_prediction_tokens). The count follows the
        output alone, so the cost model's choice to draft or not never changes it."""
        state = seq.spec
        if state is None or state.prediction is None:
            return
        size = len(seq.token_ids)
        for end in range(size - len(tokens) + 1, size + 1):
            _match(state, seq.token_ids, seq.num_prompt_tokens, end)


def _advance(state: SpecState, emitted: list[int]) -> None:
    """Move the proposer's place past the emitted tokens that follow the prediction there."""
    prediction, pos = state.prediction, state.prediction_pos
    for token in emitted:
        if pos >= len(prediction) or prediction[pos] != token:
            break
        pos += 1
    state.prediction_pos = pos


def _match(state: SpecState, tokens: list[int], output_start: int, end: int) -> None:
    """Usage's count, for the output token at end - 1 of `tokens` (the output starts at
    `output_start`): it matches the prediction at `match_pos`, or the output's suffix of
    _REALIGN_N tokens there re-aligns the count further on, and the suffix's tokens from
    `match_pos` on count. Forward only, so each prediction token counts at most once."""
    prediction, pos = state.prediction, state.match_pos
    if pos < len(prediction) and prediction[pos] == tokens[end - 1]:
        state.match_pos, state.num_prediction_matched = pos + 1, state.num_prediction_matched + 1
        return
    longest, shortest = _REALIGN_N
    for n in range(min(longest, end - output_start), shortest - 1, -1):
        starts = occurrences(prediction, np.asarray(tokens[end - n : end], dtype=np.int64), len(prediction) - n + 1)
        ahead = starts[starts + n > pos]  # the suffix's last token lands at or past the count's place
        if len(ahead):
            after = int(ahead[0]) + n
            state.match_pos, state.num_prediction_matched = after, state.num_prediction_matched + min(n, after - pos)
            return


def prediction_counts(state: SpecState | None) -> tuple[int, int]:
    """A request's (accepted, rejected) prediction tokens, as OpenAI's usage defines them:
    the prediction's tokens that appeared in the output (matched in order, `_match`),
    and the rest. (0, 0) without a prediction; the engine-wide counters (SpecStats)
    count every proposer."""
    if state is None or state.prediction is None:
        return 0, 0
    matched = state.num_prediction_matched
    return matched, len(state.prediction) - matched
