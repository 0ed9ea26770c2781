"""Noticing an agent stuck calling the same tool the same way, turn after turn."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Messages that may sit between two assistant turns of one tool-calling run.
_TOOL_RESULT_ROLES = ("tool", "function")


def tool_loop_detected(messages: Sequence[Any], min_repeats: int = 3) -> bool:
    """True when the last `min_repeats` assistant turns, consecutive but for tool results
    between them, each made the same tool calls: same functions, same arguments (as
    parsed JSON, key order ignored). Messages are OpenAI chat messages, as dicts or
    pydantic models."""
    if min_repeats < 1:
        raise ValueError("min_repeats must be at least 1")
    turns: list[list[tuple[str, str]]] = []  # newest first
    for message in reversed(messages):
        message = _as_dict(message)
        role = message.get("role")
        if role in _TOOL_RESULT_ROLES:
            continue
        if role != "assistant" or not message.get("tool_calls"):
            break
        turns.append(_signature(message["tool_calls"]))
        if len(turns) == min_repeats:
            return all(turn == turns[0] for turn in turns)
    return False


def _signature(tool_calls: Sequence[Any]) -> list[tuple[str, str]]:
    calls = []
    for call in tool_calls:
        function = _as_dict(_as_dict(call).get("function") or {})
        calls.append((str(function.get("name")), _canonical_json(function.get("arguments"))))
    return sorted(calls)


def _canonical_json(arguments: Any) -> str:
    """Arguments with keys sorted, so key order does not matter; unparsable text as is."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # a conversation's text, whatever it holds
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def _as_dict(item: Any) -> dict[str, Any]:
    return item.model_dump() if hasattr(item, "model_dump") else item
