"""Guards on a running generation: a detector for output stuck in a loop.

A model that repeats the same phrase over and over will usually do so until
max_tokens, wasting the budget and the user's time. `LoopDetector` watches the tokens
as they are sampled and says when the output ends with a short pattern repeated
`min_count` times in a row, so the engine can stop the sequence (stop_guard "loop").

Cost: O(max_pattern_size) per token, never a rescan of the output. For each period p
the detector keeps `run[p]`, the number of consecutive latest positions i with
token[i] == token[i - p]. The output ends with k full repeats of a p-token pattern
exactly when run[p] >= (k - 1) * p: the last (k - 1) * p tokens each equal the token p
before them, which chains the last k * p tokens into copies of one p-token block.
"""

from __future__ import annotations

from backend.settings.model_settings import check_loop_settings


class LoopDetector:
    """Fed one token at a time; reports the period of a loop the output ends with."""

    def __init__(self, min_pattern_size: int, max_pattern_size: int, min_count: int):
        check_loop_settings(min_pattern_size, max_pattern_size, min_count)
        self.min_pattern_size = min_pattern_size
        self.max_pattern_size = max_pattern_size
        self.min_count = min_count
        self._periods = range(min_pattern_size, max_pattern_size + 1)
        # run length at which period p fires: the last (min_count - 1) * p tokens match
        self._needed = [(min_count - 1) * p for p in self._periods]
        self.reset()

    def reset(self) -> None:
        """Forget every token: the next push starts a fresh sequence (e.g. content after thinking)."""
        self._history = [0] * self.max_pattern_size  # ring buffer: the last max_pattern_size tokens
        self._runs = [0] * len(self._periods)
        self._count = 0  # tokens pushed since the reset

    def push(self, token: int) -> int | None:
        """Add the next token; the smallest period p whose pattern now repeats min_count times, else None."""
        n = self._count
        history, size = self._history, self.max_pattern_size
        fired = None
        for slot, p in enumerate(self._periods):
            # the slot of token[n - p]; read before token n overwrites slot n % size (p == size)
            if n >= p and history[(n - p) % size] == token:
                self._runs[slot] += 1
            else:
                self._runs[slot] = 0
            if fired is None and self._runs[slot] >= self._needed[slot]:
                fired = p
        history[n % size] = token
        self._count = n + 1
        return fired
