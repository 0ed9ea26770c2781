"""The scheduler's part for vision requests (mixed into Scheduler): the vision encoder runs
inside prefill, under a budget of its own per step.

A prompt chunk that reaches an image or video the encoder has not run yet (not in the
encoder cache) pays its tokens from the step's encoder budget (MAX_NUM_BATCHED_TOKENS
tokens of encoder output); a chunk the budget cannot pay for stops before that item, and
the item runs in a later step. The first item of a step always runs, however large, or a
huge image would never run. A beam request's prompt runs outside this budget (its rows are
scheduled whole: backend.core.beam_scheduling).
"""

from __future__ import annotations

from backend.core.sequence import Sequence
from backend.vision.encoder_cache import EncoderCache


class VisionScheduling:
    """Mixed into the Scheduler: `encoder_cache` and `vision_merge` are set by the engine
    for a vision-language model (None and 0 otherwise)."""

    encoder_cache: EncoderCache | None = None
    vision_merge: int = 0

    def _reset_encoder_budget(self) -> None:
        self._encoder_left = self.max_num_batched_tokens
        self._encoder_fresh = True

    def _fit_vision(self, seq: Sequence, start: int, num_new: int) -> tuple[int, int]:
        """(the tokens of `num_new` from `start` the step's encoder budget lets `seq` compute
        (all of them for a sequence without images), the encoder tokens they cost): charge
        the cost (`_charge_encoder`) once the chunk is scheduled."""
        if seq.vision is None or self.encoder_cache is None or num_new <= 0:
            return num_new, 0
        return seq.vision.fit_chunk(
            start, num_new, self._encoder_left, self._encoder_fresh, self.vision_merge, self.encoder_cache.__contains__
        )

    def _charge_encoder(self, cost: int) -> None:
        if cost:
            self._encoder_left -= cost
            self._encoder_fresh = False
