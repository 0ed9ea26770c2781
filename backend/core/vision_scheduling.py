"""The vision encoder's budget per step: `EncoderBudget`, a part the Scheduler creates and
owns (backend.core.scheduler). The vision encoder runs inside prefill, under a budget of
its own per step.

A prompt chunk that reaches an image or video the encoder has not run yet (not in the
encoder cache) pays its tokens from the step's encoder budget (MAX_NUM_BATCHED_TOKENS
tokens of encoder output); a chunk the budget cannot pay for stops before that item, and
the item runs in a later step. The first item of a step always runs, however large, or a
huge image would never run. A beam request's prompt runs outside this budget (its rows are
scheduled whole: backend.core.beam_scheduling).
"""

from __future__ import annotations

from backend.types.sequence import Sequence
from backend.vision.encoder_cache import EncoderCache


class EncoderBudget:
    """`tokens` of encoder output per step. `cache` (the encoder cache the runner fills) and
    `merge_size` (the vision tower's) are a vision-language model's: None and 0 otherwise,
    and then every chunk fits."""

    def __init__(self, tokens: int, cache: EncoderCache | None = None, merge_size: int = 0):
        self.tokens = tokens
        self.cache = cache
        self.merge_size = merge_size
        self.left = tokens  # what this step has left
        self.fresh = True  # no item has run this step: the next one runs however large

    def reset(self) -> None:
        """A new step: the whole budget."""
        self.left = self.tokens
        self.fresh = True

    def fit(self, seq: Sequence, start: int, num_new: int) -> tuple[int, int]:
        """(the tokens of `num_new` from `start` the step's budget lets `seq` compute (all of
        them for a sequence without images), the encoder tokens they cost): `charge` the
        cost once the chunk is scheduled."""
        if seq.vision is None or self.cache is None or num_new <= 0:
            return num_new, 0
        return seq.vision.fit_chunk(start, num_new, self.left, self.fresh, self.merge_size, self.cache.__contains__)

    def charge(self, cost: int) -> None:
        if cost:
            self.left -= cost
            self.fresh = False
