"""The scheduler's admissions (mixed into Scheduler): waiting sequences, in arrival order,
into the running batch, each with its prefix-cache hits, its adapter's lane and, for a
translation, its encoder's blocks and tokens in the step's budget. A beam request's
group is admitted whole (backend.core.beam_scheduling).
"""

from __future__ import annotations

from backend.contract import FinishGuard, FinishReason
from backend.core.sequence import Sequence, SequenceStatus
from backend.core.step import ScheduledSeq, SchedulerOutput


class Admission:
    """Mixed into the Scheduler: the state it reads is the Scheduler's."""

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit in arrival order; a sequence whose adapter finds no free lane waits
        (later ones may pass it), one that finds no blocks stops the admissions."""
        bm = self.block_manager
        passed: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            rows = seq.beam.rows if seq.beam is not None else [seq]
            if not all([self._take_lane(row) for row in rows]):
                for row in rows:
                    self._drop_lane(row)
                passed.append(self.waiting.popleft())
                continue
            encoding = self._take_encoder(seq, out, budget)
            admit = self._admit_group if seq.beam is not None else self._admit_one
            taken = None if encoding is None else admit(seq.beam or seq, out, max(budget - encoding, 1))
            if taken is None:
                for row in rows:
                    self._drop_lane(row)
                if encoding and seq.encoder is not None:
                    bm.free_encoder(seq.encoder)
                if not self.running and not out.scheduled:  # an empty pool cannot hold it: it never will
                    self.waiting.popleft()
                    self._end(seq, FinishReason.LENGTH, FinishGuard.CONTEXT_LENGTH)
                    continue
                break
            self.waiting.popleft()
            budget = max(budget - encoding, 1) - taken
        self.waiting.extendleft(reversed(passed))
        return budget

    def _admit_one(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Admit a waiting sequence: the step tokens it takes; None: no blocks, nothing changed."""
        bm = self.block_manager
        # prompt logprobs need every prompt position computed: no prefix hits
        hits = [] if seq.prompt_logprobs is not None else bm.get_computed_blocks(seq)
        num_hit_tokens = len(hits) * bm.block_size
        chunk = self._chunk(seq.num_tokens - num_hit_tokens, budget, admitting=True)
        num_new, encoder_cost = self._fit_vision(seq, num_hit_tokens, chunk)
        if not num_new or not bm.allocate_slots(seq, num_new, hits):
            return None
        self._charge_encoder(encoder_cost)
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, num_new))
        return num_new

    def _take_encoder(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """The step tokens a translation's encoder costs when it is admitted (0: no encoder to
        run), its blocks taken; None: not in this step. Alone in a step, a source longer than
        the budget still runs."""
        encoder = seq.encoder
        if encoder is None or encoder.blocks:
            return 0
        cost = len(encoder.tokens)
        if (cost >= budget and out.scheduled) or not self.block_manager.allocate_encoder(encoder):
            return None
        return cost

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
