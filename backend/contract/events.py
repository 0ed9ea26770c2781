"""What comes back from the engine: outputs carrying tokens, the last one the final event.

One type from the engine to HTTP: the engine's step returns `RequestOutput`s, the
model's sender merges a stream's pending ones into one (`absorb`) and sends it as one
Triton response, and the frontend decodes that response into a `RequestOutput` again.
Times are seconds throughout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token, or (frontend) a stop string
    LENGTH = "length"  # max_tokens, the context length, or a guard that cut the output
    ABORT = "abort"  # cancelled by the client
    TOOL_CALLS = "tool_calls"  # (frontend) the turn ended with tool calls
    FUNCTION_CALL = "function_call"  # (frontend) the same, for a request in the older `functions` form


class FinishGuard(enum.Enum):
    """Which guard ended a sequence, or its thinking; reported in the final event."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    MAX_TOKENS = "max_tokens"
    CONTEXT_LENGTH = "context_length"
    CANCELLED = "cancelled"
    CONTENT_LOOP = "content_loop"  # the answer repeats a pattern: finished
    DEADLINE = "deadline"  # the request's time ran out: finished with what it has
    THINKING_LOOP = "thinking_loop"  # thinking repeated a pattern: its end was forced
    THINKING_BUDGET = "thinking_budget"  # thinking spent its budget: its end was forced
    STOP_STRING = "stop_string"  # (frontend) a stop string ended the text


@dataclass(slots=True)
class Logprob:
    """A token's logprob in the raw distribution and its most likely alternatives
    (token id, logprob), descending. `logprob` is None for the first prompt token,
    which nothing predicts."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Hypothesis:
    """One result of a beam search. Its tokens end as a plain generation's output does (a
    stopping token counted in the final event, not emitted); `logprobs`, when asked, are
    aligned with them; `score` is transformers' sum of the search's log-probs over the
    generated length ** length_penalty (the stopping token counted)."""

    token_ids: list[int]
    score: float
    finish_reason: FinishReason
    logprobs: list[Logprob] | None = None


@dataclass(slots=True)
class FinalEvent:
    """How a generation ended."""

    finish_reason: FinishReason
    finish_guard: FinishGuard
    num_prompt_tokens: int
    num_output_tokens: int  # generated, a stopping token included (OpenAI's completion tokens)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_reasoning_tokens: int = 0  # output tokens written while thinking, markers included
    # Predicted Outputs (OpenAI's usage): the prediction's tokens the output matched where
    # aligned, and the rest; 0 without a prediction
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    thinking_guard: FinishGuard | None = None  # the guard that ended thinking, if one did
    time_to_first_token_s: float | None = None  # arrival -> first token; None: no token
    decode_time_s: float = 0.0  # first token -> last token
    queue_time_s: float | None = None  # arrival -> first scheduled; None: not known


@dataclass(slots=True)
class RequestOutput:
    """Tokens produced for one request since its previous output.

    `logprobs` (when asked) is aligned with `token_ids`. The first output of a request
    also carries its prompt's logprobs (when asked) and whether its output starts
    inside a thinking block (the prompt opened one); the last carries `final`. A beam
    search sends no tokens until it ends: its last output carries `hypotheses`, best first.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob] | None = None
    starts_in_thinking: bool | None = None
    final: FinalEvent | None = None
    hypotheses: list[Hypothesis] | None = None

    @property
    def finished(self) -> bool:
        return self.final is not None

    def absorb(self, later: RequestOutput) -> None:
        """Append a later output of the same request (what one response carries)."""
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.starts_in_thinking is not None:
            self.starts_in_thinking = later.starts_in_thinking
        if later.hypotheses is not None:
            self.hypotheses = later.hypotheses
        self.final = later.final
