"""The scheduler's part for beam requests (backend.beams.group): a group of rows is
admitted, scheduled and preempted whole, and its rows complete in the same step.

A group's rows sit next to each other in `running`, so preempting from the end takes a
whole group and never one already scheduled this step. While rows are behind (the
prompt, or a recompute after preemption), a step that cannot complete every row
stops each one a token short of completing, so that no row ever waits complete
with nothing to compute: the search needs every row's log-probs in one step.
"""

from __future__ import annotations

from backend.beams.group import BeamGroup
from backend.contract import FinishGuard, FinishReason, RequestOutput
from backend.core.outputs import final_event
from backend.core.sequence import Sequence, SequenceStatus
from backend.core.step import ScheduledSeq, SchedulerOutput, StepResult


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


class BeamScheduling:
    """Mixed into the Scheduler: the state it reads is the Scheduler's."""

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The KV block copies the last update's forks need, to run before the next forward."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def _schedule_group(self, group: BeamGroup, out: SchedulerOutput, budget: int) -> int | None:
        """Schedule a running group whole; None when making room preempted the group itself."""
        rows = group.rows
        takes = row_takes([r.num_tokens - r.num_computed_tokens for r in rows], budget)
        if not any(takes):
            return 0
        for row, n in zip(rows, takes, strict=True):
            while not self.block_manager.allocate_slots(row, n):
                victim = self._preempt_last(out)
                if victim.beam is group:
                    if not self.running:  # alone, and the pool cannot hold it: it ends with what it has
                        self._end(group.lead, FinishReason.LENGTH, FinishGuard.CONTEXT_LENGTH)
                    return None
        out.scheduled.extend(ScheduledSeq(row, n) for row, n in zip(rows, takes, strict=True) if n)
        return sum(takes)

    def _admit_group(self, group: BeamGroup, out: SchedulerOutput, budget: int) -> int | None:
        """Admit a waiting group whole (its lanes are taken); None: no room, nothing changed."""
        bm, rows = self.block_manager, group.rows
        if len(self.running) + group.num_beams > self.max_num_seqs:
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
            self.running.append(row)
            if n:
                out.scheduled.append(ScheduledSeq(row, n))
        if group.lead.num_cached_tokens is None:
            group.lead.num_cached_tokens = group.lead.num_computed_tokens
        return sum(takes)

    def _preempt_last(self, out: SchedulerOutput) -> Sequence:
        """Preempt the last running sequence, its whole group when it is a beam's row."""
        victim = self.running.pop()
        if victim.beam is not None:
            self.running = [row for row in self.running if row.beam is not victim.beam]
            self._preempt(victim.beam.lead)
            out.preempted.append(victim.beam.lead)
        else:
            self._preempt(victim)
            out.preempted.append(victim)
        return victim

    def _advance_beams(self, items: list[tuple[ScheduledSeq, int]], result: StepResult, now: float):
        """Each group whose rows completed this step takes a search step; the ended ones' outputs."""
        rows_of: dict[BeamGroup, dict[Sequence, int]] = {}
        for item, row in items:
            rows_of.setdefault(item.seq.beam, {})[item.seq] = row
        outputs: list[RequestOutput] = []
        for group, logits_rows in rows_of.items():
            lead = group.lead
            if lead.first_token_time is None:
                lead.first_token_time = now
            log_probs = result.log_probs([logits_rows[row] for row in group.rows])
            made, copies = group.advance(log_probs, self.block_manager)
            self.block_copies += copies
            if made:
                at = self.running.index(lead) + 1
                self.running[at:at] = made
                for row in made:
                    self._take_lane(row)  # the lead's adapter is in a lane already: it cannot fail
            if group.search.done:
                self._finish(lead, FinishReason.STOP, FinishGuard.EOS)  # the output says how it ended
                outputs.append(group.output(final_event(lead, now)))
        return outputs
