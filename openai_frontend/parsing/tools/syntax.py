"""The text around tool calls, matched on prefixes so a stream can decide early.

A stream sees an output a few characters at a time. Before it may announce a call, it
must know that the text from a trigger on is a well-formed call head (e.g.
`<tool_call>\\n{"name": "f", "arguments": {`) naming a known tool; before that it must
hold the text back, but no longer than needed. `match` answers for a text so far:
MATCH (the whole pattern, and where it ends), PARTIAL (a prefix of a match: wait for
more text) or FAIL (no continuation can match). Patterns are short sequences of
literals, JSON whitespace and a function name, enough for every format here and simple
enough to match in one pass without backtracking.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

JSON_WHITESPACE = " \t\n\r"
MAX_NAME_LENGTH = 64  # OpenAI's limit; a longer "name" is no call, and is not waited for


class Piece(enum.Enum):
    WHITESPACE = "any run of JSON whitespace, possibly empty"
    NAME = "a JSON string without escapes, captured: the function name"


# A literal string, a tuple of alternative literals (none a prefix of another), or a Piece.
Pattern = tuple[str | tuple[str, ...] | Piece, ...]


class Outcome(enum.Enum):
    MATCH = enum.auto()
    PARTIAL = enum.auto()
    FAIL = enum.auto()


@dataclass(frozen=True, slots=True)
class Match:
    outcome: Outcome
    end: int = 0
    name: str | None = None


def match(pattern: Pattern, text: str, at_end: bool) -> Match:
    """Match `pattern` at the start of `text`; with `at_end`, no more text will come.

    A pattern never ends with whitespace, so a MATCH never depends on text to come.
    """
    pos, name = 0, None
    for piece in pattern:
        if piece is Piece.WHITESPACE:
            while pos < len(text) and text[pos] in JSON_WHITESPACE:
                pos += 1
            continue
        if piece is Piece.NAME:
            outcome, pos, name = _match_name(text, pos)
        else:
            outcome, pos = _match_literal((piece,) if isinstance(piece, str) else piece, text, pos)
        if outcome is not Outcome.MATCH:
            return Match(Outcome.FAIL if at_end else outcome)
    return Match(Outcome.MATCH, pos, name)


def _match_literal(options: tuple[str, ...], text: str, pos: int) -> tuple[Outcome, int]:
    rest = text[pos:]
    for option in options:
        if rest.startswith(option):
            return Outcome.MATCH, pos + len(option)
    if any(option.startswith(rest) for option in options):
        return Outcome.PARTIAL, pos
    return Outcome.FAIL, pos


def _match_name(text: str, pos: int) -> tuple[Outcome, int, str | None]:
    if pos == len(text):
        return Outcome.PARTIAL, pos, None
    if text[pos] != '"':
        return Outcome.FAIL, pos, None
    too_long = pos + 2 + MAX_NAME_LENGTH  # where the closing quote of the longest name would be, plus one
    close = pos + 1
    while close < min(len(text), too_long) and text[close] not in '"\\':
        close += 1
    if close == too_long:
        return Outcome.FAIL, pos, None
    if close == len(text):
        return Outcome.PARTIAL, pos, None
    if text[close] == "\\":  # tool names never need escapes
        return Outcome.FAIL, pos, None
    return Outcome.MATCH, close + 1, text[pos + 1 : close]


def call_head(*argument_keys: str) -> Pattern:
    """`{"name": "<name>", "<key>": {`, the head of one call, up to its arguments' `{`.

    The name must come first: a stream can then announce the call before its arguments.
    """
    ws = Piece.WHITESPACE
    keys = tuple(f'"{key}"' for key in argument_keys)
    return (ws, "{", ws, '"name"', ws, ":", ws, Piece.NAME, ws, ",", ws, keys, ws, ":", ws, "{")


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a format writes its calls, for parsing.

    A section of calls starts at a trigger; `triggers` maps each trigger to the text
    the section opens with, before its first call head (the trigger itself, or nothing
    when the trigger is the call's own `{`). After a call's arguments, `separator`
    (through e.g. `},`) leads to another call head, and `close` (through e.g.
    `}</tool_call>`) ends the section. When the separator may still follow, the stream
    waits; a close that is a prefix of the separator wins once the separator cannot.
    """

    triggers: Mapping[str, Pattern]
    call_head: Pattern
    close: Pattern
    separator: Pattern | None = None

    def head_after(self, trigger: str) -> Pattern:
        return self.triggers[trigger] + self.call_head


@dataclass(slots=True)
class JsonObjectScanner:
    """Finds where a JSON object ends, without parsing it, across pieces of text.

    Only brackets outside strings count; whether the object is valid JSON is checked
    once it is whole.
    """

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> int | None:
        """Index just past the object's closing brace in `text`, or None if not there yet."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None
