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
a request that arrives during its prefill is admitted at the next step. A model whose state
layers cannot continue a state over a chunk (Mamba's) has each prompt computed whole: in the
step's budget, or beyond it where nothing but decodes came before it. When the pool
runs dry for a running sequence, the most recently admitted one (SCHEDULING_POLICY=
priority: the lowest priority; backend.core.ordering) is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed (its
cached prefix blocks usually survive, so the recompute is mostly cache hits). A beam
request's rows are one unit throughout (backend.core.beam_scheduling).

The Scheduler is built from parts it creates in `__init__` and owns, each handed what it
uses: the waiting queue and its policy (`WaitingQueue`, backend.core.ordering), admitting
one sequence (`Admission`, backend.core.admission), the encoder budget (`EncoderBudget`,
backend.core.vision_scheduling), the beam groups (`BeamRows`, backend.core.beam_scheduling),
the drafts and sampling of plain sequences (`Verifier`, backend.core.verify). Its own: the
table of sequences, the running batch, preemption, the adapters' lanes, ending sequences.
"""

from __future__ import annotations

import functools
import time

from backend.contract import ContractError, FinishGuard, FinishReason, RequestOutput
from backend.core.admission import Admission
from backend.core.beam_scheduling import BeamRows, groups_of
from backend.core.ordering import WaitingQueue
from backend.core.outputs import final_event
from backend.core.verify import Verifier
from backend.core.vision_scheduling import EncoderBudget
from backend.guards.policy import Guards
from backend.kv.block_manager import BlockManager
from backend.lora.lanes import LoraLanes
from backend.speculation.speculator import Speculator
from backend.types.sequence import Sequence, SequenceStatus
from backend.types.step import ScheduledSeq, SchedulerOutput, StepResult
from backend.vision.encoder_cache import EncoderCache


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        guards: Guards,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        speculator: Speculator | None = None,
        lora: LoraLanes | None = None,
        policy: str = "fcfs",
        encoder_cache: EncoderCache | None = None,
        vision_merge: int = 0,
        whole_prompts: bool = False,
    ):
        self.block_manager = block_manager
        self.whole_prompts = whole_prompts  # never chunked (a model whose state layers cannot continue a chunk)
        self.lora = lora  # the adapters' lanes: a sequence with an adapter runs only while it holds one
        self.guards = guards
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        self.waiting = WaitingQueue(policy)  # in the order sequences are served in (backend.core.ordering)
        self.running: list[Sequence] = []  # changed in place: the parts are handed this list
        self.num_preemptions = 0
        self._ended: list[Sequence] = []  # finished between steps (abort, deadline): final next update
        # a vision-language model's encoder cache and merge size (None and 0: no images)
        self.encoder = EncoderBudget(max_num_batched_tokens, encoder_cache, vision_merge)
        self.beams = BeamRows(block_manager, max_num_seqs)
        self.admission = Admission(block_manager, self.encoder, self.beams)
        self.verifier = Verifier(guards, speculator, block_manager)

    # -- lifecycle ----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ContractError("request_id", f"{seq.request_id!r} is already in flight")
        self.requests[seq.request_id] = seq
        self.waiting.push(seq)

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

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The KV block copies the last update's forks need, to run before the next forward."""
        return self.beams.take_block_copies()

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

    def _take_lane(self, seq: Sequence) -> bool:
        """Whether the sequence can run: no adapter, or its version placed in a lane."""
        if seq.adapter is None or seq.lora_lane is not None:
            return True
        seq.lora_lane = self.lora.acquire(seq.adapter, seq.adapter_weights)
        return seq.lora_lane is not None

    def _drop_lane(self, seq: Sequence) -> None:
        if seq.lora_lane is not None:
            self.lora.release(seq.lora_lane)
            seq.lora_lane = None

    # -- one step: schedule ---------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        now = time.monotonic()
        self._expire_deadlines(now)
        out = SchedulerOutput()
        self.encoder.reset()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
        self.waiting.order_running(self.running)  # for the next step: the policy's order
        if not out.preempted:
            self.verifier.add_drafts(out, budget)
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
                taken = self.beams.schedule(seq.beam, out, budget, self._preempt_last)
                if taken is None:  # making room preempted the group itself
                    if not self.running:  # alone, and the pool cannot hold it: it ends with what it has
                        self._end(seq.beam.lead, FinishReason.LENGTH, FinishGuard.CONTEXT_LENGTH)
                    return budget
                budget -= taken
                i += len(seq.beam.rows)
                continue
            start = seq.num_computed_tokens
            num_new, encoder_cost = self.encoder.fit(seq, start, self._chunk(seq.num_tokens - start, budget))
            if not num_new:  # its next image waits for a step with encoder budget
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                if self._preempt_last(out) is seq:
                    if not self.running:  # alone, and the pool cannot hold it (a translation's source
                        self._end(seq, FinishReason.LENGTH, FinishGuard.CONTEXT_LENGTH)  # takes blocks too)
                    return budget
            out.scheduled.append(ScheduledSeq(seq, num_new))
            self.encoder.charge(encoder_cost)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit in the queue's order; a sequence whose adapter finds no free lane waits
        (later ones may pass it), one that finds no blocks stops the admissions."""
        passed: list[Sequence] = []
        admitting_chunk = functools.partial(self._chunk, admitting=True)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.first()
            rows = seq.beam.rows if seq.beam is not None else [seq]
            if not all([self._take_lane(row) for row in rows]):
                for row in rows:
                    self._drop_lane(row)
                passed.append(self.waiting.pop_first())
                continue
            left = self.admission.admit(seq, out, budget, self.running, admitting_chunk)
            if left is None:
                for row in rows:
                    self._drop_lane(row)
                if not self.running and not out.scheduled:  # an empty pool cannot hold it: it never will
                    self.waiting.pop_first()
                    self._end(seq, FinishReason.LENGTH, FinishGuard.CONTEXT_LENGTH)
                    continue
                break
            self.waiting.pop_first()
            budget = left
        self.waiting.put_back(passed)
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
        if self.whole_prompts:  # whole, in the budget or with nothing but decodes before it
            alone = budget >= self.max_num_batched_tokens - len(self.running)
            return remaining if remaining <= budget or alone else 0
        others_wait = len(self.waiting) > (1 if admitting else 0) and len(self.running) < self.max_num_seqs
        decoding = any(seq.num_tokens - seq.num_computed_tokens == 1 for seq in self.running)
        if not (others_wait or decoding):
            return min(remaining, budget)
        room = budget if admitting else budget - self.shared_chunk
        return max(0, min(remaining, room, self.shared_chunk))

    def _preempt_last(self, out: SchedulerOutput) -> Sequence:
        """Preempt the last running sequence, its whole group when it is a beam's row."""
        victim = self.running.pop()
        if victim.beam is not None:
            self.running[:] = [row for row in self.running if row.beam is not victim.beam]
            self._preempt(victim.beam.lead)
            out.preempted.append(victim.beam.lead)
        else:
            self._preempt(victim)
            out.preempted.append(victim)
        return victim

    def _preempt(self, seq: Sequence) -> None:
        for row in seq.beam.rows if seq.beam is not None else [seq]:
            self._drop_lane(row)
            self.block_manager.free(row)
            row.num_computed_tokens = 0
            row.status = SequenceStatus.WAITING
        if seq.encoder is not None:
            self.block_manager.free_encoder(seq.encoder)
        seq.num_preemptions += 1
        self.waiting.push(seq, front=True)

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
        for item in plan.scheduled:  # drafts are computed, not committed: they wait for the verifier
            item.seq.num_computed_tokens += item.num_new_tokens - len(item.draft_tokens)
        plain = [(item, row) for item, row in completing if item.seq.beam is None]
        outputs += self.verifier.verify(plain, result, now, self._finish)
        outputs += self._advance_beams([pair for pair in completing if pair[0].seq.beam is not None], result, now)
        for item in plan.scheduled:
            if not item.seq.is_finished:
                self.block_manager.cache_full_blocks(item.seq)
        return outputs

    def _advance_beams(self, items: list[tuple[ScheduledSeq, int]], result: StepResult, now: float):
        """Each group whose rows completed this step takes a search step; the ended ones' outputs."""
        outputs: list[RequestOutput] = []
        for group, logits_rows in groups_of(items).items():
            for row in self.beams.advance(group, logits_rows, result, now, self.running):
                self._take_lane(row)  # the lead's adapter is in a lane already: it cannot fail
            if group.search.done:
                self._finish(group.lead, FinishReason.STOP, FinishGuard.EOS)  # the output says how it ended
                outputs.append(group.output(final_event(group.lead, now)))
        return outputs
