"""One step, as the scheduler plans it and as the model runner answers it."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.contract import Logprob
from backend.core.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """True when this step computes the sequence's last token, so it samples the next."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step; `completing`: the scheduled sequences that sample a token."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def completing(self) -> list[ScheduledSeq]:
        return [item for item in self.scheduled if item.completes]


@dataclass(slots=True)
class StepResult:
    """What one forward produced: a token per completing sequence, and the logprobs asked for."""

    tokens: list[int] = field(default_factory=list)
    # per completing sequence, None where its request did not ask
    logprobs: list[Logprob | None] = field(default_factory=list)
    # (sequence, first prompt position of the chunk, logprobs of prompt tokens start+1 ..)
    prompt_logprobs: list[tuple[Sequence, int, list[Logprob]]] = field(default_factory=list)
