"""Split a reasoning model's output into its thinking and its answer.

Reasoning models (DeepSeek-R1, Qwen3, QwQ) write their thinking between two markers,
e.g. "<think>...</think>", then the answer. The OpenAI-style API returns the two
apart: `reasoning_content` and `content`. The rules, after vLLM's DeepSeek-R1 and
Qwen3 parsers, with the choices this module makes spelled out:

- The thinking block is the output's first thing: it is open when the output starts
  with `think_start` (after optional whitespace, which is dropped) or when
  `starts_in_thinking` says the prompt already opened it (Qwen3-Thinking and
  DeepSeek-R1 templates end the prompt with "<think>\\n"; a `think_start` the model
  writes anyway is then dropped too). There is at most one block: a `think_start` later
  in the output, or anything after the block, is plain content. (vLLM's Qwen3 parser
  also finds a block mid-text and drops the text before it; we keep that text.)
- Everything up to `think_end` is reasoning. If `think_end` never comes (a truncated or
  budget-cut generation), all of it is reasoning and content is None.
- After `think_end` the leading whitespace run is dropped: models write
  "</think>\\n\\n" before the answer. vLLM keeps it; an answer starting with blank
  lines is noise to a client, so we strip it.
- An output with no block is all content. Empty pieces are None, as in vLLM.
- `think_start == ""` means the model does not reason: everything is content.

Streaming gives the same split for any chunking: `ReasoningStream` holds back a tail
that could still be the start of a marker (or leading whitespace whose fate is not
yet decided) until the next delta or `finish()` decides it.
"""

from __future__ import annotations

import enum


class ReasoningParser:
    """Reasoning/content split for one pair of markers; `split` whole text, `stream` deltas."""

    def __init__(self, think_start: str, think_end: str, starts_in_thinking: bool = False):
        if think_start and not think_end:
            raise ValueError("think_end must be set when think_start is")
        if think_start != think_start.lstrip():
            raise ValueError(f"think_start must not begin with whitespace (it is skipped): {think_start!r}")
        self.think_start = think_start
        self.think_end = think_end
        self.starts_in_thinking = starts_in_thinking and bool(think_start)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where a part is empty or absent."""
        if not self.think_start:
            return None, text or None
        stripped = text.lstrip()
        if stripped.startswith(self.think_start):
            body = stripped[len(self.think_start) :]
        elif self.starts_in_thinking:
            body = text
        else:
            return None, text or None
        reasoning, found_end, rest = body.partition(self.think_end)
        content = rest.lstrip() if found_end else ""
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        """A fresh incremental splitter for one generation."""
        return ReasoningStream(self)


class _State(enum.Enum):
    OPENING = "opening"  # at the start: is a think_start coming?
    THINKING = "thinking"  # inside the block: waiting for think_end
    AFTER_END = "after_end"  # past think_end: dropping the whitespace before the answer
    CONTENT = "content"  # the rest passes through


class ReasoningStream:
    """Incremental `split`: feed text deltas, get (reasoning piece, content piece) back."""

    def __init__(self, parser: ReasoningParser):
        self._parser = parser
        self._pending = ""  # text received but not yet given out
        self._state = _State.OPENING if parser.think_start else _State.CONTENT

    def feed(self, text_delta: str) -> tuple[str, str]:
        """The reasoning and content decided by this delta (either may be "")."""
        self._pending += text_delta
        reasoning, content = [], []
        while self._pending and self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back tail at the end of the output: no marker can complete any more."""
        pending, self._pending = self._pending, ""
        if self._state is _State.OPENING:
            # never saw a think_start: the same choice split() makes
            return (pending, "") if self._parser.starts_in_thinking else ("", pending)
        if self._state is _State.THINKING:
            return pending, ""
        if self._state is _State.AFTER_END:
            return "", ""  # only whitespace was held: it is dropped
        return "", pending

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the current state can decide; False when it must wait for more text."""
        match self._state:
            case _State.OPENING:
                return self._open()
            case _State.THINKING:
                return self._think(reasoning)
            case _State.AFTER_END:
                return self._skip_whitespace()
            case _State.CONTENT:
                content.append(self._pending)
                self._pending = ""
                return True

    def _open(self) -> bool:
        start = self._parser.think_start
        stripped = self._pending.lstrip()
        if stripped.startswith(start):
            self._pending = stripped[len(start) :]
            self._state = _State.THINKING
            return True
        if start.startswith(stripped):
            return False  # whitespace and maybe a partial think_start so far: undecided
        self._state = _State.THINKING if self._parser.starts_in_thinking else _State.CONTENT
        return True

    def _think(self, reasoning: list[str]) -> bool:
        end = self._parser.think_end
        before, found_end, after = self._pending.partition(end)
        if found_end:
            reasoning.append(before)
            self._pending = after
            self._state = _State.AFTER_END
            return True
        held = _partial_marker_length(self._pending, end)
        reasoning.append(self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _skip_whitespace(self) -> bool:
        self._pending = self._pending.lstrip()
        if not self._pending:
            return False  # the answer has not begun yet
        self._state = _State.CONTENT
        return True


def _partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
