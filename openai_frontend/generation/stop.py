"""Stop strings: cut the text at the first one, holding back what may start one.

OpenAI semantics: the text ends just before the first occurrence of any stop string,
which is not included. While streaming, the tail of the text that could be the start
of a stop string is held back and released once it cannot be; so no released text is
ever taken back. Only the held tail and the new piece are searched, since every
occurrence must start inside them.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Add new text; return the part that is safe to release."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        text = self._held + text
        cut, self.matched = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._partial_stop_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The sequence ended without a stop string: release what was held."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> tuple[int | None, str | None]:
        """(where the first stop string starts, which one: at one place, the longest)."""
        found = [(i, -len(s), s) for s, i in ((s, text.find(s)) for s in self._stops) if i >= 0]
        if not found:
            return None, None
        at, _, stop = min(found)
        return at, stop

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
