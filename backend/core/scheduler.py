"""Continuous batching under one token budget per step, and each sequence's lifecycle.

The scheduler owns a sequence from admission to its end (as vLLM v1's and nano-vllm's
do): `add`, `schedule` a step, `update` from what the step computed (append tokens,
consult the guards, finish), `abort`. Each step, running sequences come first (a
decode costs one token, an unfinished prompt a chunk of it), then waiting sequences
are admitted while the budget, `max_num_seqs` and the block pool allow. A prompt
alone (no decode beside it, nobody waiting) takes the whole budget as its chunk, and
prompts alone are chunked in arrival order. Beside a decode, or while sequences wait,
a prompt's chunk is at most `shared_chunk` (a quarter of the budget), and the running
prompts' chunks leave that quarter to the decodes behind them and the admissions. So a
long prompt (prompt logprobs included) holds the others for one step at most: the
steps that carry their decodes or admit them compute a quarter-budget chunk of it, and
a request that arrives during its prefill is admitted at the next step. When the pool
runs dry for a running sequence, the most recently admitted one (SCHEDULING_POLICY=
priority: the lowest priority; backend.core.ordering) is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed (its
cached prefix blocks usually survive, so the recompute is mostly cache hits). A beam
request's rows are one unit throughout (backend.core.beam_scheduling).
"""

from __future__ import annotations

import collections
import time

from backend.contract import ContractError, FinishGuard, FinishReason, Logprob, RequestOutput
from backend.core.admission import Admission
from backend.core.beam_scheduling import BeamScheduling
from backend.core.block_manager import BlockManager
from backend.core.ordering import POLICIES, Ordering
from backend.core.outputs import final_event, token_output
from backend.core.sequence import Sequence, SequenceStatus
from backend.core.step import ScheduledSeq, SchedulerOutput, StepResult
from backend.core.vision_scheduling import VisionScheduling
from backend.guards.policy import Guards, finish_reason
from backend.lora.lanes import LoraLanes
from backend.speculation.speculator import Speculator


class Scheduler(Admission, BeamScheduling, VisionScheduling, Ordering):
    def __init__(
        self,
        block_manager: BlockManager,
        guards: Guards,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        speculator: Speculator | None = None,
        lora: LoraLanes | None = None,
        policy: str = "fcfs",
    ):
        if policy not in POLICIES:
            raise ValueError(f"SCHEDULING_POLICY must be one of {POLICIES}, got {policy!r}")
        self.policy = policy  # the order sequences are served in (backend.core.ordering)
        self.block_manager = block_manager
        self.lora = lora  # the adapters' lanes: a sequence with an adapter runs only while it holds one
        self.guards = guards
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._ended: list[Sequence] = []  # finished between steps (abort, deadline): final next update
        self.block_copies: list[tuple[int, int]] = []  # forked beams' partial blocks (take_block_copies)

    # -- lifecycle ----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ContractError("request_id", f"{seq.request_id!r} is already in flight")
        self.requests[seq.request_id] = seq
        self._queue(seq)

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (abort) comes out of the next update."""
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self._end(seq, FinishReason.ABORT, FinishGuard.CANCELLED)

    def has_unfinished(self) -> bool:
        """Sequences to work on, or finals still to report."""
        return bool(self.requests or self._ended)

    def request_ids(self) -> list[str]:
        """Every request whose final output has not come out of an update yet."""
        return [*self.requests, *(seq.request_id for seq in self._ended)]

    def _end(self, seq: Sequence, reason: FinishReason, guard: FinishGuard) -> None:
        """Finish outside a step: the final output waits for the next update."""
        self._finish(seq, reason, guard)
        self._ended.append(seq)

    def _finish(self, seq: Sequence, reason: FinishReason, guard: FinishGuard) -> None:
        seq.finish_reason, seq.finish_guard = reason, guard
        if seq in self.waiting:
            self.waiting.remove(seq)
        for row in seq.beam.rows if seq.beam is not None else [seq]:
            row.status = SequenceStatus.FINISHED
            if row in self.running:
                self.running.remove(row)
            self._drop_lane(row)
            self.block_manager.free(row)
        if seq.encoder is not None:
            self.block_manager.free_encoder(seq.encoder)
        del self.requests[seq.request_id]

    def _final_output(self, seq: Sequence, now: float) -> RequestOutput:
        final = final_event(seq, now)
        if seq.beam is not None:
            return seq.beam.output(final)
        return RequestOutput(seq.request_id, [], final=final)

    # -- one step: schedule ---------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        now = time.monotonic()
        self._expire_deadlines(now)
        out = SchedulerOutput()
        self._reset_encoder_budget()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
        self._order_running()  # for the next step: the policy's order
        if self.speculator is not None and not out.preempted:
            self._add_drafts(out, budget)
        self.num_preemptions += len(out.preempted)
        for item in out.scheduled:  # a sequence's queue time ends with its first step
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        return out

    def _expire_deadlines(self, now: float) -> None:
        """Every sequence past its deadline ends with what it has, waiting ones included."""
        for seq in [s for s in self.requests.values() if self.guards.expired(s, now)]:
            self._end(seq, FinishReason.LENGTH, FinishGuard.DEADLINE)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.beam is not None:
                taken = self._schedule_group(seq.beam, out, budget)
                if taken is None:
                    return budget
                budget -= taken
                i += len(seq.beam.rows)
                continue
            start = seq.num_computed_tokens
            num_new, encoder_cost = self._fit_vision(seq, start, self._chunk(seq.num_tokens - start, budget))
            if not num_new:  # its next image waits for a step with encoder budget
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                if self._preempt_last(out) is seq:
                    if not self.running:  # alone, and the pool cannot hold it (a translation's source
                        self._end(seq, FinishReason.LENGTH, FinishGuard.CONTEXT_LENGTH)  # takes blocks too)
                    return budget
            out.scheduled.append(ScheduledSeq(seq, num_new))
            self._charge_encoder(encoder_cost)
            budget -= num_new
            i += 1
        return budget

    @property
    def shared_chunk(self) -> int:
        """The most prompt tokens a sequence computes in a step it shares with others."""
        return max(1, self.max_num_batched_tokens // 4)

    def _chunk(self, remaining: int, budget: int, admitting: bool = False) -> int:
        """The tokens a sequence with `remaining` to compute takes of `budget`. A decode, or a
        prompt with no decode beside it and no admission to make, takes all it can; else a
        prompt chunk is at most `shared_chunk`, and a running one leaves `shared_chunk` of
        the budget (to the decodes behind it and the admissions)."""
        if remaining <= 1:
            return min(remaining, budget)
        others_wait = len(self.waiting) > (1 if admitting else 0) and len(self.running) < self.max_num_seqs
        decoding = any(seq.num_tokens - seq.num_computed_tokens == 1 for seq in self.running)
        if not (others_wait or decoding):
            return min(remaining, budget)
        room = budget if admitting else budget - self.shared_chunk
        return max(0, min(remaining, room, self.shared_chunk))

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Drafts for the sequences that sample this step, from the budget the step left,
        each where the block pool has room for them (a draft never preempts). Room is made
        first, since a model proposer writes its own keys there; what a grammar refuses
        is cut before the verify step."""
        candidates = [item for item in out.scheduled if item.seq.spec is not None and item.completes]
        if not candidates or budget <= 0:
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

    def _preempt(self, seq: Sequence) -> None:
        for row in seq.beam.rows if seq.beam is not None else [seq]:
            self._drop_lane(row)
            self.block_manager.free(row)
            row.num_computed_tokens = 0
            row.status = SequenceStatus.WAITING
        if seq.encoder is not None:
            self.block_manager.free_encoder(seq.encoder)
        seq.num_preemptions += 1
        self._queue(seq, front=True)

    # -- one step: update from what it computed ---------------------------------

    def update(self, plan: SchedulerOutput, result: StepResult | None) -> list[RequestOutput]:
        """The step's outputs: the finals of sequences ended since the last update, then
        one per sequence that sampled a token."""
        now = time.monotonic()
        outputs = [self._final_output(seq, now) for seq in self._ended]
        self._ended.clear()
        if result is None:
            return outputs
        completing = list(zip(plan.completing, result.first_rows, strict=True))  # before the sequences advance
        for item in plan.scheduled:  # the runner ran the encoder of each source new to it
            if item.seq.encoder is not None:
                item.seq.encoder.encoded = True
        for seq, start, computed in result.prompt_logprobs:
            del seq.prompt_logprobs[start:]  # a preempted prompt is recomputed from its start
            seq.prompt_logprobs.extend(computed)
        for item in plan.scheduled:  # drafts are computed, not committed: they wait for _verify
            item.seq.num_computed_tokens += item.num_new_tokens - len(item.draft_tokens)
        plain = [(item, row) for item, row in completing if item.seq.beam is None]
        outputs += self._verify(plain, result, now)
        outputs += self._advance_beams([pair for pair in completing if pair[0].seq.beam is not None], result, now)
        for item in plan.scheduled:
            if not item.seq.is_finished:
                self.block_manager.cache_full_blocks(item.seq)
        return outputs

    def _verify(self, items: list[tuple[ScheduledSeq, int]], result: StepResult, now: float) -> list[RequestOutput]:
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
                out = self._append(seq, token, logprob, now)
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

    def _append(self, seq: Sequence, token: int, logprob: Logprob | None, now: float) -> RequestOutput:
        if seq.sampling.max_tokens == 0:  # the prompt is computed: nothing is generated
            return self._prompt_only(seq, now)
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
            self._finish(seq, reason, guard)
        out = token_output(seq, emitted, logprob)
        if out.prompt_logprobs is not None:
            seq.prompt_logprobs = None  # sent: a later recompute (preemption) may use the prefix cache
        return out

    def _prompt_only(self, seq: Sequence, now: float) -> RequestOutput:
        """max_tokens 0: the step's token is dropped; the final carries the prompt's logprobs."""
        self.block_manager.cache_full_blocks(seq)
        self._finish(seq, FinishReason.LENGTH, FinishGuard.MAX_TOKENS)
        out = token_output(seq, [], None)
        seq.prompt_logprobs = None
        out.final = final_event(seq, now)
        return out
