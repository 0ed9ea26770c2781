"""A sequence's outputs: a step's token (and its logprob), and the final event.

The first output of a request also carries its prompt logprobs (when asked; they are
whole once the prompt is) and whether its output starts inside a thinking block; a
stopping token (EOS or a stop token) is counted but not emitted, and its logprob goes
with it.
"""

from __future__ import annotations

from backend.contract import FinalEvent, Logprob, RequestOutput
from backend.speculation.speculator import prediction_counts
from backend.types.sequence import Sequence


def token_output(seq: Sequence, emitted: list[int], logprob: Logprob | None) -> RequestOutput:
    out = RequestOutput(seq.request_id, emitted)
    if logprob is not None:
        out.logprobs = [logprob] if emitted else []
    if seq.num_output_tokens <= 1:  # the request's first output (max_tokens 0: its only one)
        out.starts_in_thinking = seq.guard_state.phase.starts_in_thinking
    if seq.prompt_logprobs is not None:  # not sent yet
        out.prompt_logprobs = [Logprob(seq.token_ids[0], None, []), *seq.prompt_logprobs]
    return out


def final_event(seq: Sequence, now: float) -> FinalEvent:
    arrival, first = seq.arrival_time, seq.first_token_time
    phase = seq.guard_state.phase
    accepted, rejected = prediction_counts(seq.spec)
    return FinalEvent(
        finish_reason=seq.finish_reason,
        finish_guard=seq.finish_guard,
        # a translation's prompt is its source, as the encoder read it
        num_prompt_tokens=seq.num_prompt_tokens if seq.encoder is None else len(seq.encoder.tokens),
        num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens or 0,
        num_reasoning_tokens=phase.thinking_tokens,
        num_accepted_prediction_tokens=accepted,
        num_rejected_prediction_tokens=rejected,
        thinking_guard=phase.thinking_guard,
        time_to_first_token_s=(first - arrival) if first is not None else None,
        decode_time_s=(now - first) if first is not None else 0.0,
        queue_time_s=(seq.first_scheduled_time or now) - arrival,  # never scheduled: it waited throughout
    )
