"""One step, as the scheduler plans it and as the model runner answers it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.contract import Logprob
from backend.types.sequence import Sequence

# (logits rows, their sampling rows) -> (a token per row, its logprob when the row asks)
Sample = Callable[[list[int], list[Any]], tuple[list[int], list[Logprob | None]]]


@dataclass(slots=True)
class ScheduledSeq:
    """A sequence's part of the step: `num_new_tokens` query tokens, the last
    `len(draft_tokens)` of them speculative (proposed, not yet part of the sequence)."""

    seq: Sequence
    num_new_tokens: int
    draft_tokens: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """True when this step computes the sequence's last token, so it samples the next."""
        real = self.num_new_tokens - len(self.draft_tokens)
        return self.seq.num_computed_tokens + real == self.seq.num_tokens


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
    """What one forward produced. Each completing sequence owns 1 + len(drafts) logits
    rows from `first_rows[i]` on: the row at depth d predicts the token after its d-th
    draft. `sample` draws from rows on demand, so that the scheduler can sample a depth
    only once it knows which drafts the depths before it accepted."""

    sample: Sample
    # logits rows -> their raw log_softmax [rows, vocab] float32 (what a beam search scores)
    log_probs: Callable[[list[int]], Any] | None = None
    first_rows: list[int] = field(default_factory=list)  # per completing sequence, in order
    # (sequence, first prompt position of the chunk, logprobs of prompt tokens start+1 ..)
    prompt_logprobs: list[tuple[Sequence, int, list[Logprob]]] = field(default_factory=list)
    # the step's hidden states [T, hidden] (what lm_head reads; MTP drafts from them), and
    # where each scheduled sequence's rows start (prefix sums of the query lengths)
    hidden_states: Any = None
    query_start: list[int] = field(default_factory=list)
