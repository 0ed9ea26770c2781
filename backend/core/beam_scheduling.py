"""A beam request's rows as one unit: `BeamRows`, a part the Scheduler creates and owns
(backend.core.scheduler), and `row_takes`. A group of rows (backend.beams.group) is
admitted, scheduled and preempted whole, and its rows complete in the same step; after
the step the group takes its search step, and the forks' KV block copies wait here for
the engine (`take_block_copies`, run before the next forward).

A group's rows sit next to each other in `running`, so preempting from the end takes a
whole group and never one already scheduled this step. While rows are behind (the
prompt, or a recompute after preemption), a step that cannot complete every row
stops each one a token short of completing, so that no row ever waits complete
with nothing to compute: the search needs every row's log-probs in one step.

What is the Scheduler's stays there: it preempts (`preempt_last`, passed in), ends a group
the pool cannot hold, takes the lanes of the rows a search step made and finishes a group
whose search is done; BeamRows reports what happened.
"""

from __future__ import annotations

from collections.abc import Callable

from backend.beams.group import BeamGroup
from backend.kv.block_manager import BlockManager
from backend.types.sequence import Sequence, SequenceStatus
from backend.types.step import ScheduledSeq, SchedulerOutput, StepResult


def row_takes(remaining: list[int], budget: int) -> list[int]:
    """Tokens each row computes this step: all that is left when the budget holds every
    row's, else each row up to a token short of complete, in order."""
    if len(remaining) == 1:
        return [min(remaining[0], budget)]
    if sum(remaining) <= budget:
        return list(remaining)
    takes = []
    for left in remaining:
        n = min(max(left - 1, 0), budget)
        takes.append(n)
        budget -= n
    return takes


def groups_of(items: list[tuple[ScheduledSeq, int]]) -> dict[BeamGroup, dict[Sequence, int]]:
    """The completing beam rows of a step (each with its logits row), by group."""
    rows_of: dict[BeamGroup, dict[Sequence, int]] = {}
    for item, row in items:
        rows_of.setdefault(item.seq.beam, {})[item.seq] = row
    return rows_of


class BeamRows:
    """The beam groups' admission, scheduling and search step over `block_manager`, at most
    `max_num_seqs` rows running; the block copies the forks of the last update need."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.block_copies: list[tuple[int, int]] = []  # forked beams' partial blocks (take_block_copies)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The KV block copies the last update's forks need, to run before the next forward."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def schedule(
        self, group: BeamGroup, out: SchedulerOutput, budget: int, preempt_last: Callable[[SchedulerOutput], Sequence]
    ) -> int | None:
        """Schedule a running group whole: the step tokens it takes; None when making room
        (`preempt_last`: the scheduler's, it returns the sequence it took) preempted the
        group itself."""
        rows = group.rows
        takes = row_takes([r.num_tokens - r.num_computed_tokens for r in rows], budget)
        if not any(takes):
            return 0
        for row, n in zip(rows, takes, strict=True):
            while not self.block_manager.allocate_slots(row, n):
                if preempt_last(out).beam is group:
                    return None
        out.scheduled.extend(ScheduledSeq(row, n) for row, n in zip(rows, takes, strict=True) if n)
        return sum(takes)

    def admit(self, group: BeamGroup, out: SchedulerOutput, budget: int, running: list[Sequence]) -> int | None:
        """Admit a waiting group whole into `running` (its lanes are taken): the step tokens it
        takes; None: no room, nothing changed."""
        bm, rows = self.block_manager, group.rows
        if len(running) + group.num_beams > self.max_num_seqs:
            return None
        hits = [[] if row.prompt_logprobs is not None else bm.get_computed_blocks(row) for row in rows]
        takes = row_takes([row.num_tokens - len(h) * bm.block_size for row, h in zip(rows, hits, strict=True)], budget)
        for i, row in enumerate(rows):
            if not bm.allocate_slots(row, takes[i], hits[i]):
                for done in rows[:i]:
                    bm.free(done)
                return None
        for row, h, n in zip(rows, hits, takes, strict=True):
            row.num_computed_tokens = len(h) * bm.block_size
            row.status = SequenceStatus.RUNNING
            running.append(row)
            if n:
                out.scheduled.append(ScheduledSeq(row, n))
        if group.lead.num_cached_tokens is None:
            group.lead.num_cached_tokens = group.lead.num_computed_tokens
        return sum(takes)

    def advance(
        self,
        group: BeamGroup,
        logits_rows: dict[Sequence, int],
        result: StepResult,
        now: float,
        running: list[Sequence],
    ) -> list[Sequence]:
        """The search step of a group whose rows completed this step (`logits_rows`: each
        row's): the rows it made, placed in `running` after the lead; their lanes and, when
        `group.search.done`, the group's end are the caller's."""
        lead = group.lead
        if lead.first_token_time is None:
            lead.first_token_time = now
        log_probs = result.log_probs([logits_rows[row] for row in group.rows])
        made, copies = group.advance(log_probs, self.block_manager)
        self.block_copies += copies
        if made:
            at = running.index(lead) + 1
            running[at:at] = made
        return made
