"""Reasoning and loop guards at the token level: what each sequence is doing (thinking
or answering), and the guards that watch it.

- Thinking markers come from the model settings (`[reasoning]` of MODEL.toml). A
  sequence starts in thinking when its prompt's tail opened a thinking block (a
  Qwen3-style template with enable_thinking), or enters it when its output begins
  with the start marker (DeepSeek-R1 style), or is forced into it when the request
  sets `enable_thinking` and the prompt did not open one. It leaves thinking when the
  output writes the end marker.
- `thinking_budget` N: after N thinking tokens the end marker is forced, token by
  token if it is several tokens; the model then answers. reasoning_tokens counts the
  output tokens written while thinking, the end marker included (N + its length).
- Loop detectors (backend.guards.loops), one per phase, reset when thinking ends: a
  thinking loop forces the end of thinking (the model still answers); a content loop
  finishes the sequence (FinishGuard.CONTENT_LOOP).
- A grammar (structured output, tool calls) constrains the answer only: a sequence
  that thinks gets its grammar state when thinking ends, whether the model ended it
  or a guard forced it (backend.guards.policy).

Each token costs O(max loop period + marker length): no rescan of the output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from backend.contract import FinishGuard, GuardParams
from backend.guards.loops import LoopDetector
from backend.settings.model_settings import GuardSettings, ReasoningSettings, check_loop_settings

PROMPT_TAIL = 16  # tokens of the prompt's end searched for an opened thinking block


@dataclass(frozen=True, slots=True)
class Markers:
    """The model's thinking markers as token ids (empty: the model does not reason)."""

    start: tuple[int, ...] = ()
    end: tuple[int, ...] = ()

    @classmethod
    def for_model(cls, reasoning: ReasoningSettings, tokenizer) -> Markers:
        if tokenizer is None or not reasoning.think_start:
            return cls()
        encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        return cls(encode(reasoning.think_start), encode(reasoning.think_end))

    @property
    def enabled(self) -> bool:
        return bool(self.start and self.end)

    def prompt_opens_thinking(self, prompt: list[int]) -> bool:
        """Whether the prompt ends inside an opened thinking block."""
        if not self.enabled:
            return False
        tail = prompt[-PROMPT_TAIL:]
        opened = _last_index(tail, self.start)
        return opened >= 0 and _last_index(tail, self.end) < opened


@dataclass(slots=True)
class LoopLimits:
    min_pattern_size: int
    max_pattern_size: int
    min_count: int  # 0: off

    @classmethod
    def of(cls, params: GuardParams, defaults: GuardSettings, ignore_eos: bool) -> LoopLimits | None:
        """The request's loop limits, each absent one from the model's defaults; None
        when the detectors are off. A bad combination is a ContractError naming it.

        An `ignore_eos` request (a benchmark asking for exactly max_tokens) gets no
        default detectors, only the ones it asks for itself."""
        own = (params.loop_min_pattern_size, params.loop_max_pattern_size, params.loop_min_count)
        if ignore_eos and all(value is None for value in own):
            return None
        limits = cls(
            _or(params.loop_min_pattern_size, defaults.loop_min_pattern_size),
            _or(params.loop_max_pattern_size, defaults.loop_max_pattern_size),
            _or(params.loop_min_count, defaults.loop_min_count),
        )
        if limits.min_count == 0:
            return None
        check_loop_settings(limits.min_pattern_size, limits.max_pattern_size, limits.min_count)
        return limits

    def detector(self) -> LoopDetector:
        return LoopDetector(self.min_pattern_size, self.max_pattern_size, self.min_count)


@dataclass(slots=True)
class PhaseGuard:
    """One sequence's phase (thinking or answering) and the guards of each phase; fed
    every appended token."""

    markers: Markers
    budget: int | None = None  # thinking tokens allowed, None: no budget
    loops: LoopLimits | None = None
    thinking: bool = False
    starts_in_thinking: bool = False  # the prompt opened a thinking block (the frontend's parser is told)
    thinking_tokens: int = 0  # output tokens written while thinking, markers included
    spent: int = 0  # thinking tokens that count against the budget: those after the start marker
    output_tokens: int = 0
    thinking_guard: FinishGuard | None = None  # the guard that ended thinking, if one did
    forced: deque[int] = field(default_factory=deque)
    _recent: deque[int] = field(default_factory=deque)  # the last tokens, for marker matching
    _detector: LoopDetector | None = None

    def __post_init__(self) -> None:
        self._detector = self.loops.detector() if self.loops is not None else None
        self._recent = deque(maxlen=max(len(self.markers.start), len(self.markers.end), 1))

    def start(self, prompt: list[int], enable_thinking: bool) -> None:
        """Before the first token: thinking if the prompt opened it, or forced into it."""
        if self.markers.prompt_opens_thinking(prompt):
            self.thinking = self.starts_in_thinking = True
            self._check_budget()
        elif enable_thinking and self.markers.enabled:
            self.forced.extend(self.markers.start)

    def next_forced(self) -> int | None:
        return self.forced[0] if self.forced else None

    def observe(self, token: int) -> tuple[FinishGuard | None, bool]:
        """Account for an appended token: (a guard that finishes the sequence, whether
        thinking just ended)."""
        if self.forced and self.forced[0] == token:
            self.forced.popleft()
        self.output_tokens += 1
        self._recent.append(token)
        if not self.thinking:
            if self._opens_thinking():
                self.thinking = True
                self.thinking_tokens = len(self.markers.start)
                self._reset_detector()
                self._check_budget()
                return None, False
            if self._detector is not None and self._detector.push(token) is not None:
                return FinishGuard.CONTENT_LOOP, False
            return None, False
        self.thinking_tokens += 1
        if self._ends_with(self.markers.end):
            self.thinking = False
            self.forced.clear()
            self._reset_detector()
            return None, True
        if not self.forced:
            self.spent += 1
            if self._detector is not None and self._detector.push(token) is not None:
                self._force_end(FinishGuard.THINKING_LOOP)
            else:
                self._check_budget()
        return None, False

    def _check_budget(self) -> None:
        if not self.forced and self.budget is not None and self.spent >= self.budget:
            self._force_end(FinishGuard.THINKING_BUDGET)

    def _opens_thinking(self) -> bool:
        """The output's very first tokens are the start marker (only there, as the
        frontend's reasoning parser reads it)."""
        start = self.markers.start
        return bool(start) and self.output_tokens == len(start) and self._ends_with(start)

    def _force_end(self, guard: FinishGuard) -> None:
        self.thinking_guard = guard
        self.forced.extend(self.markers.end)

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        n = len(marker)
        return bool(n) and len(self._recent) >= n and tuple(self._recent)[-n:] == marker

    def _reset_detector(self) -> None:
        if self._detector is not None:
            self._detector.reset()


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _last_index(tokens: list[int], marker: tuple[int, ...]) -> int:
    n = len(marker)
    for i in range(len(tokens) - n, -1, -1):
        if tuple(tokens[i : i + n]) == marker:
            return i
    return -1
