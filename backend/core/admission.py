"""Admitting one waiting sequence: `Admission`, a part the Scheduler creates and owns
(backend.core.scheduler). A sequence is admitted with its prefix-cache hits, its chunk
of the step's budget, its blocks and, for a translation, its encoder's blocks and tokens
in the budget; a beam request's group is admitted whole (backend.core.beam_scheduling).

The Scheduler's admission loop keeps what is its own: which waiting sequence is tried
next (the waiting queue), the adapters' lanes, and ending a sequence that an empty pool
cannot hold.
"""

from __future__ import annotations

from collections.abc import Callable

from backend.core.beam_scheduling import BeamRows
from backend.core.vision_scheduling import EncoderBudget
from backend.kv.block_manager import BlockManager
from backend.types.sequence import Sequence, SequenceStatus
from backend.types.step import ScheduledSeq, SchedulerOutput


class Admission:
    """Admissions into the blocks of `block_manager`, charging images to `encoder` and
    admitting beam groups through `beams`."""

    def __init__(self, block_manager: BlockManager, encoder: EncoderBudget, beams: BeamRows):
        self.block_manager = block_manager
        self.encoder = encoder
        self.beams = beams

    def admit(
        self,
        seq: Sequence,
        out: SchedulerOutput,
        budget: int,
        running: list[Sequence],
        chunk: Callable[[int, int], int],
    ) -> int | None:
        """Admit `seq` (its lanes taken) into `running` and the step: the budget it leaves;
        None: not in this step (no blocks, or its encoder does not fit), nothing changed.
        `chunk(remaining, budget)`: the tokens an admitted prompt takes (the scheduler's rule)."""
        encoding = self._take_encoder(seq, out, budget)
        if encoding is None:
            return None
        room = max(budget - encoding, 1)
        if seq.beam is not None:
            taken = self.beams.admit(seq.beam, out, room, running)
        else:
            taken = self._admit_one(seq, out, room, running, chunk)
        if taken is None:
            if encoding and seq.encoder is not None:
                self.block_manager.free_encoder(seq.encoder)
            return None
        return room - taken

    def _admit_one(
        self,
        seq: Sequence,
        out: SchedulerOutput,
        budget: int,
        running: list[Sequence],
        chunk: Callable[[int, int], int],
    ) -> int | None:
        """Admit a sequence that is not a beam's: the step tokens it takes; None: no blocks."""
        bm = self.block_manager
        # prompt logprobs need every prompt position computed: no prefix hits
        hits = [] if seq.prompt_logprobs is not None else bm.get_computed_blocks(seq)
        num_hit_tokens = len(hits) * bm.block_size
        num_new, encoder_cost = self.encoder.fit(seq, num_hit_tokens, chunk(seq.num_tokens - num_hit_tokens, budget))
        if not num_new or not bm.allocate_slots(seq, num_new, hits):
            return None
        self.encoder.charge(encoder_cost)
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_tokens
        seq.status = SequenceStatus.RUNNING
        running.append(seq)
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
