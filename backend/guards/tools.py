"""The engine's tool-call guards, at the token level.

The frontend parses calls and forces their shape with a grammar; these guards are
what the engine adds, knowing the model's call tags (backend.settings.model_settings):

- `require_tool_call`: EOS and stop tokens are masked until the output has opened a
  call (written the trigger), so the turn cannot end without one.
- `suppress_tool_call` (the frontend sets it when the conversation loops on the same
  call): the token that would complete the trigger is masked, so no call opens. A
  trigger of several tokens is blocked at its last token, and only when the output
  already ends with the others; a one-token trigger is masked outright.
- `tools_present`: a stop token that is the model's closing call tag does not end the
  turn, so the model can make several calls (models whose closing tag is one special
  token; with the default model's multi-token tags this never applies).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.contract import GuardParams

if TYPE_CHECKING:
    from backend.types.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ToolGuards:
    # the trigger's tokenizations: alone, and merged with a leading space (" <" is one
    # token in byte-level vocabularies, so " <tool_call>" starts with another token)
    triggers: tuple[tuple[int, ...], ...] = ()
    end_token: int | None = None  # the closing tag, when it is a single token

    @classmethod
    def for_model(cls, call_tags: tuple[str, str], tokenizer) -> ToolGuards:
        if tokenizer is None:
            return cls()
        opening, closing = call_tags
        triggers: list[tuple[int, ...]] = []
        for prefix in ("", " ", "\n") if opening else ():
            ids = tuple(tokenizer.encode(prefix + opening, add_special_tokens=False))
            alone = tuple(tokenizer.encode(prefix, add_special_tokens=False)) if prefix else ()
            if alone and ids[: len(alone)] == alone:
                ids = ids[len(alone) :]  # the prefix is a token of its own: the plain trigger
            if ids and ids not in triggers:
                triggers.append(ids)
        end = tokenizer.encode(closing, add_special_tokens=False) if closing else []
        return cls(tuple(triggers), end[0] if len(end) == 1 else None)

    def observe(self, seq: Sequence) -> None:
        """After a token is appended: note when the output has just written a trigger.
        Only `require_tool_call` reads it, so other sequences skip the comparison."""
        state = seq.guard_state
        if state.tool_call_opened or not self.triggers or not seq.request.guards.require_tool_call:
            return
        for trigger in self.triggers:
            n = len(trigger)
            if seq.num_output_tokens >= n and tuple(seq.token_ids[-n:]) == trigger:
                state.tool_call_opened = True
                return

    def masked(self, seq: Sequence, stop_ids: Seq[int]) -> tuple[int, ...]:
        """The tokens the guards mask for the sequence's next draw."""
        params = seq.request.guards
        masked: tuple[int, ...] = ()
        if params.require_tool_call and self.triggers and not seq.guard_state.tool_call_opened:
            masked += tuple(stop_ids)
        if params.suppress_tool_call:
            for trigger in self.triggers:
                head, last = trigger[:-1], trigger[-1]
                if not head or (seq.num_output_tokens >= len(head) and tuple(seq.token_ids[-len(head) :]) == head):
                    masked += (last,)
        return masked

    def continues_turn(self, params: GuardParams, token: int) -> bool:
        """Whether stop token `token` is a closing call tag that must not end the turn."""
        return params.tools_present and token == self.end_token
