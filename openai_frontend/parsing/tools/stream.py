"""Tool calls out of a stream of text, sent on as soon as they are certain.

The stream is a small state machine over the text received and not yet decided:

    TEXT       content; a trigger starts a candidate call
    HEAD       the candidate's head, trigger to the `{` of the arguments
    ARGUMENTS  the arguments object, sent in pieces as it arrives
    TAIL       after the arguments: `}` and a separator (HEAD again) or the section's end

What is sent never depends on how the text was cut into pieces: every step decides
only once the text decides it (a prefix that could still become a trigger or a head is
held back), and `finish` decides the rest. `ToolParser.parse` is this same machine fed
the whole text, so a stream and `parse` agree by construction, for any chunking.

Rules, which `parse` shares:
- A call is announced (header delta) once its head is whole and names a known tool
  (any name when no tools are given); its arguments then stream as written.
- A call is well formed when its arguments are valid JSON and its tail is right
  (e.g. `}\\n</tool_call>`). Only well-formed calls are in `tool_calls`.
- A candidate that fails becomes content: its first character is content, and the
  text after it is read again as text (so a real call just after a false trigger
  still counts). A failure in the head sends nothing but content. A failure after
  the call was announced (bad argument JSON, wrong tail) cannot take back what was
  sent: the call's index goes to `abandoned`, its text becomes content like any
  failed candidate, and content still equals `parse()`'s.
- A call the output's end cuts short (max_tokens in the middle of a head or of its
  arguments) is dropped, never shown as content: the parser's syntax is not the
  answer. One whose arguments are whole and only its tail is cut counts as made.
  A dropped call that was announced goes to `abandoned` too. (A head opened by a
  trigger that is the call's own `{`, as llama3_json's bare JSON, and cut before it
  named a tool, stays content: it may as well be an answer in JSON.)
- Each chunk has at most one delta per call index: a call's header and the first
  pieces of its arguments travel as one entry (OpenAI's shape, which the SDKs'
  stream helpers assemble by index).
- Whitespace that only separates a well-formed call from the start, the end or
  another call is dropped (so "Let me look.\n<tool_call>...</tool_call>\n" has the
  content "Let me look."); whitespace between a call and content after it is kept,
  and content is otherwise unchanged.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from openai_frontend.parsing.tools.calls import Delta, ToolCall, arguments_piece, call_header, new_call_id
from openai_frontend.parsing.tools.syntax import JSON_WHITESPACE, CallSyntax, JsonObjectScanner, Outcome, Pattern, match


class _State(enum.Enum):
    TEXT = enum.auto()
    HEAD = enum.auto()
    ARGUMENTS = enum.auto()
    TAIL = enum.auto()


@dataclass(slots=True)
class _OpenCall:
    index: int
    name: str
    id: str = field(default_factory=new_call_id)
    arguments: str = ""
    scanner: JsonObjectScanner = field(default_factory=JsonObjectScanner)


class ToolCallStream:
    """Feed text deltas in, get content and tool-call deltas out; see the module doc."""

    def __init__(self, syntax: CallSyntax, tool_names: frozenset[str] | None = None):
        self._syntax = syntax
        self._tool_names = tool_names
        self._state = _State.TEXT
        self._pending = ""  # text received and not yet decided
        self._after_call = False  # no content since the last well-formed call
        self._head: Pattern = ()
        self._continuation = False  # the head follows a separator, not a trigger
        self._marked = False  # a marker opened the candidate (not the call's own `{`)
        self._lead_whitespace = ""  # before the candidate's trigger; content if it fails
        self._raw = ""  # the candidate's text taken from `_pending` so far
        self._call: _OpenCall | None = None
        self._next_index = 0
        self._out: list[Delta] = []
        self.tool_calls: list[ToolCall] = []
        self.abandoned: list[int] = []

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        self._advance(at_end=False)
        return self._take()

    def finish(self) -> list[Delta]:
        """The output ended: decide everything held back."""
        self._advance(at_end=True)
        return self._take()

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _advance(self, at_end: bool) -> None:
        steps = {
            _State.TEXT: self._text,
            _State.HEAD: self._head_step,
            _State.ARGUMENTS: self._arguments,
            _State.TAIL: self._tail,
        }
        while steps[self._state](at_end):
            pass

    # Each step returns True when it moved on (run the next one), False to wait for text.

    def _text(self, at_end: bool) -> bool:
        pending = self._pending
        if at_end and self._after_call and not pending.strip(JSON_WHITESPACE):
            self._pending = ""  # trailing whitespace after the calls
            return False
        hold = len(pending) if at_end else self._possible_trigger_start(pending)
        found = self._first_trigger(pending)
        if found is not None and found[0] <= hold:
            start, trigger = found
            before = pending[:start].rstrip(JSON_WHITESPACE)
            self._emit_content(before)
            self._lead_whitespace = pending[len(before) : start]
            self._pending = pending[start:]
            self._begin_head(self._syntax.head_after(trigger), continuation=False)
            self._marked = bool(self._syntax.triggers[trigger])
            return True
        if not at_end:  # whitespace before a possible trigger may belong to a call
            hold = len(pending[:hold].rstrip(JSON_WHITESPACE))
        self._emit_content(pending[:hold])
        self._pending = pending[hold:]
        return False

    def _head_step(self, at_end: bool) -> bool:
        if self._continuation:  # whitespace after a well-formed call is dropped
            self._pending = self._pending.lstrip(JSON_WHITESPACE)
            if not self._pending:
                if at_end:
                    self._state = _State.TEXT
                return False
        head = match(self._head, self._pending, at_end)
        if head.outcome is Outcome.PARTIAL:
            return False
        if at_end and self._marked and match(self._head, self._pending, False).outcome is Outcome.PARTIAL:
            self._drop()  # the output ended inside the head
            return True
        if head.outcome is Outcome.FAIL or not self._is_known(head.name):
            self._fail()
            return True
        arguments_start = head.end - 1  # a head ends with the arguments' `{`
        self._raw, self._pending = self._pending[:arguments_start], self._pending[arguments_start:]
        self._call = _OpenCall(index=self._next_index, name=head.name)
        self._next_index += 1
        self._out.append(call_header(self._call.index, self._call.id, self._call.name))
        self._state = _State.ARGUMENTS
        return True

    def _arguments(self, at_end: bool) -> bool:
        call = self._call
        end = call.scanner.scan(self._pending)
        piece = self._pending if end is None else self._pending[:end]
        self._pending = self._pending[len(piece) :]
        if piece:
            call.arguments += piece
            self._raw += piece
            self._emit_arguments(call.index, piece)
        if end is None:
            if at_end:
                self._drop()  # the output ended inside the arguments
            return at_end
        if _is_json(call.arguments):
            self._state = _State.TAIL
        else:
            self._fail()
        return True

    def _tail(self, at_end: bool) -> bool:
        separator = self._syntax.separator
        more = match(separator, self._pending, at_end) if separator else None
        close = match(self._syntax.close, self._pending, at_end)
        if Outcome.PARTIAL in (close.outcome, more and more.outcome):
            return False
        if at_end and match(self._syntax.close, self._pending, False).outcome is Outcome.PARTIAL:
            self._complete_call(len(self._pending))  # whole arguments; only the tail was cut
            self._state = _State.TEXT
            self._after_call = True
        elif more is not None and more.outcome is Outcome.MATCH:
            self._complete_call(more.end)
            self._begin_head(self._syntax.call_head, continuation=True)
            self._marked = True  # inside a section of calls
        elif close.outcome is Outcome.MATCH:
            self._complete_call(close.end)
            self._state = _State.TEXT
            self._after_call = True
        else:
            self._fail()
        return True

    def _begin_head(self, head: Pattern, continuation: bool) -> None:
        self._head, self._continuation = head, continuation
        self._state = _State.HEAD

    def _complete_call(self, tail_end: int) -> None:
        call = self._call
        self.tool_calls.append(ToolCall(name=call.name, arguments=call.arguments, id=call.id))
        self._pending = self._pending[tail_end:]
        self._call, self._raw, self._lead_whitespace = None, "", ""

    def _fail(self) -> None:
        """The candidate is no call: its first character is content, the rest is read again."""
        text = self._raw + self._pending
        self._emit_content(self._lead_whitespace + text[:1])
        self._pending = text[1:]
        if self._call is not None:
            self.abandoned.append(self._call.index)
        self._call, self._raw, self._lead_whitespace = None, "", ""
        self._state = _State.TEXT

    def _drop(self) -> None:
        """The output ended inside a candidate: nothing of it is content."""
        if self._call is not None:
            self.abandoned.append(self._call.index)
        self._pending, self._call, self._raw, self._lead_whitespace = "", None, "", ""
        self._state = _State.TEXT

    def _is_known(self, name: str | None) -> bool:
        return bool(name) and (self._tool_names is None or name in self._tool_names)

    def _first_trigger(self, text: str) -> tuple[int, str] | None:
        """The earliest trigger in `text` (the longest, if several start there)."""
        found = [(text.find(trigger), -len(trigger), trigger) for trigger in self._syntax.triggers]
        found = [hit for hit in found if hit[0] >= 0]
        if not found:
            return None
        start, _, trigger = min(found)
        return start, trigger

    def _possible_trigger_start(self, text: str) -> int:
        """Where the longest end of `text` that could grow into a trigger starts."""
        longest = max(len(trigger) for trigger in self._syntax.triggers)
        for start in range(max(0, len(text) - longest + 1), len(text)):
            tail = text[start:]
            if any(trigger.startswith(tail) and trigger != tail for trigger in self._syntax.triggers):
                return start
        return len(text)

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        self._after_call = False
        if self._out and isinstance(self._out[-1], str):
            self._out[-1] += text
        else:
            self._out.append(text)

    def _emit_arguments(self, index: int, text: str) -> None:
        last = self._out[-1] if self._out else None
        if isinstance(last, dict) and last["index"] == index:  # its header or an earlier piece
            last["function"]["arguments"] += text
        else:
            self._out.append(arguments_piece(index, text))


def _is_json(text: str) -> bool:
    try:
        json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return False
    return True


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
