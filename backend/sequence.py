"""A sequence's state while the engine works on it. Owned by the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    stop_guard: StopGuard | None = None
    # logprobs of prompt tokens 1.. as computed so far; None when not asked for, or
    # once sent (with the first token)
    prompt_logprobs: list[float] | None = None

    @classmethod
    def from_request(cls, request: EngineRequest) -> Sequence:
        tokens = list(request.prompt_token_ids)
        prompt_logprobs = [] if request.sampling.prompt_logprobs else None
        return cls(request=request, token_ids=tokens, num_prompt_tokens=len(tokens), prompt_logprobs=prompt_logprobs)

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
