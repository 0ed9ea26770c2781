"""A step's drafts and its tokens for plain sequences: `Verifier`, a part the Scheduler
creates and owns (backend.core.scheduler). At schedule it adds drafts (speculation) to
the sequences that sample; at update it samples each completing plain sequence depth by
depth through its drafts, appends the tokens, consults the guards and finishes the ones
that end (through the scheduler's `finish`, passed in). A beam request's rows take a
search step instead (backend.core.beam_scheduling).
"""

from __future__ import annotations

from collections.abc import Callable

from backend.contract import FinishGuard, FinishReason, Logprob, RequestOutput
from backend.core.outputs import final_event, token_output
from backend.guards.policy import Guards, finish_reason
from backend.kv.block_manager import BlockManager
from backend.speculation.speculator import Speculator
from backend.types.sequence import Sequence
from backend.types.step import ScheduledSeq, SchedulerOutput, StepResult

Finish = Callable[[Sequence, FinishReason, FinishGuard], None]  # the scheduler's: ends a sequence in a step


class Verifier:
    """Sampling and drafting under `guards`, the drafts from `speculator` (None: none),
    their room and the finished sequences' cached blocks in `block_manager`."""

    def __init__(self, guards: Guards, speculator: Speculator | None, block_manager: BlockManager):
        self.guards = guards
        self.speculator = speculator
        self.block_manager = block_manager

    def add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Drafts for the sequences that sample this step, from the budget the step left,
        each where the block pool has room for them (a draft never preempts). Room is made
        first, since a model proposer writes its own keys there; what a grammar refuses
        is cut before the verify step."""
        candidates = [item for item in out.scheduled if item.seq.spec is not None and item.completes]
        if self.speculator is None or not candidates or budget <= 0:
            return
        limits = [self.speculator.limit(item.seq, budget) for item in candidates]
        planned = self.speculator.plan([item.seq for item in candidates], limits, out.num_tokens, len(out.completing))
        wants = []
        for item, k in zip(candidates, planned, strict=True):
            k = min(k, budget)
            if k and self.block_manager.allocate_slots(item.seq, item.num_new_tokens + k):
                wants.append((item, k))
                budget -= k
        if not wants:
            return
        proposed = self.speculator.propose([(item.seq, k) for item, k in wants])
        for (item, _), drafts in zip(wants, proposed, strict=True):
            item.draft_tokens = self.guards.valid_drafts(item.seq, drafts)
            item.num_new_tokens += len(item.draft_tokens)

    def verify(
        self, items: list[tuple[ScheduledSeq, int]], result: StepResult, now: float, finish: Finish
    ) -> list[RequestOutput]:
        """Sample each completing sequence depth by depth: depth d samples the position
        after its d-th draft with the sequence as it stands (seed index, penalties'
        history, grammar and guards all past the tokens accepted so far), appends the
        token, and goes one deeper only when that token is the draft there. So every
        token is the one plain decoding would have sampled at its position. `items`: the
        completing sequences and their first logits rows."""
        completing = [item for item, _ in items]
        outputs: list[RequestOutput | None] = [None] * len(completing)
        appended: list[list[int]] = [[] for _ in completing]
        active, depth = list(range(len(completing))), 0
        while active:
            rows = [self.guards.sampling_row(completing[i].seq) for i in active]
            tokens, logprobs = result.sample([items[i][1] + depth for i in active], rows)
            still = []
            for i, token, logprob in zip(active, tokens, logprobs, strict=True):
                seq, drafts = completing[i].seq, completing[i].draft_tokens
                out = self._append(seq, token, logprob, now, finish)
                if outputs[i] is None:
                    outputs[i] = out
                else:
                    outputs[i].absorb(out)
                appended[i].append(token)
                if depth < len(drafts) and token == drafts[depth] and not seq.is_finished:
                    seq.num_computed_tokens += 1  # the draft's KV, written by this step, is now its own
                    still.append(i)
            active, depth = still, depth + 1
        for item, tokens, out in zip(completing, appended, outputs, strict=True):
            if item.draft_tokens:  # each accepted draft took the loop one deeper
                self.speculator.verified(item.seq, item.draft_tokens, len(tokens) - 1, tokens)
            if item.seq.spec is not None:  # a prediction's usage count follows every token
                self.speculator.emitted(item.seq, tokens)
            if item.seq.is_finished and out.final is None:  # after the step's accounting
                out.final = final_event(item.seq, now)
        return outputs

    def _append(self, seq: Sequence, token: int, logprob: Logprob | None, now: float, finish: Finish) -> RequestOutput:
        if seq.sampling.max_tokens == 0:  # the prompt is computed: nothing is generated
            return self._prompt_only(seq, now, finish)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_ids.append(token)
        guard = self.guards.after_token(seq, token)
        emitted = [token]
        if guard is not None:
            reason = finish_reason(guard)
            if reason is FinishReason.STOP:
                emitted = []  # a stopping token is counted, not emitted
            self.block_manager.cache_full_blocks(seq)
            finish(seq, reason, guard)
        out = token_output(seq, emitted, logprob)
        if out.prompt_logprobs is not None:
            seq.prompt_logprobs = None  # sent: a later recompute (preemption) may use the prefix cache
        return out

    def _prompt_only(self, seq: Sequence, now: float, finish: Finish) -> RequestOutput:
        """max_tokens 0: the step's token is dropped; the final carries the prompt's logprobs."""
        self.block_manager.cache_full_blocks(seq)
        finish(seq, FinishReason.LENGTH, FinishGuard.MAX_TOKENS)
        out = token_output(seq, [], None)
        seq.prompt_logprobs = None
        out.final = final_event(seq, now)
        return out
