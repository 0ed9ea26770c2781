"""A sequence's state while the engine works on it. Owned by the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from backend.request import EngineRequest, FinishReason, SamplingParams, StopGuard


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and progress.

    There are no prefill and decode phases: `num_computed_tokens` (tokens whose KV is
    in the cache) chases `num_tokens` (prompt + output). A step schedules some of the
    difference; when it catches up, the step's logits yield the next token.
    """

    request: EngineRequest
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks
    num_registered_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() of its first step: its queue time ends
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    stop_guard: StopGuard | None = None
    # logprobs of prompt tokens 1.. as computed so far, and their top alternatives when
    # asked; None when not asked for, or once sent (with the first token)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None
    grammar: Any = None  # backend.grammar.GrammarState when the output follows a grammar
    tool_call_opened: bool = False  # the output has written the tool-call trigger
    guards: Any = None  # backend.thinking.SequenceGuards: thinking phase, budget, loop detectors
    deadline: float | None = None  # time.monotonic() past which the sequence is finished

    @classmethod
    def from_request(cls, request: EngineRequest) -> Sequence:
        tokens = list(request.prompt_token_ids)
        seq = cls(request=request, token_ids=tokens, num_prompt_tokens=len(tokens))
        if request.sampling.prompt_logprobs:
            seq.prompt_logprobs = []
            seq.prompt_top_logprobs = [] if request.sampling.prompt_top_logprobs else None
        return seq

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason, guard: StopGuard) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_guard = guard
