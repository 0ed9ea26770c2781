"""Anthropic's response shapes from a chat generation: content blocks, stop reason, usage."""

from __future__ import annotations

import json
import uuid
from typing import Any

from backend.contract import FinalEvent, FinishGuard, FinishReason

# the chat pipeline's finish reason (after the tool parser settled it) -> Anthropic's stop_reason
_STOP_REASONS = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
    FinishReason.FUNCTION_CALL: "tool_use",
}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_of(final: FinalEvent, stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): `stop_string` is the one that ended the text (Delta's)."""
    if final.finish_guard is FinishGuard.STOP_STRING:
        return "stop_sequence", stop_string
    return _STOP_REASONS.get(final.finish_reason, "end_turn"), None


def usage(final: FinalEvent | None, input_tokens: int | None = None) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt's uncached tokens, as Anthropic counts
    them (their sum with cache_read_input_tokens is the prompt); nothing is written to a
    cache on request, so cache_creation_input_tokens is 0."""
    cached = final.num_cached_tokens if final is not None else 0
    prompt = final.num_prompt_tokens if final is not None else (input_tokens or 0)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": final.num_output_tokens if final is not None else 0,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (the tool parser's) as a tool_use block, its arguments an object."""
    function = call["function"]
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = {}
    return {
        "type": "tool_use",
        "id": tool_use_id(),
        "name": function["name"],
        "input": parsed if isinstance(parsed, dict) else {},
    }


def message(
    reply_id: str, model: str, content: list[dict[str, Any]], final: FinalEvent, stop_string: str | None
) -> dict[str, Any]:
    reason, sequence = stop_of(final, stop_string)
    return {
        "id": reply_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(final),
    }


def blocks(thinking: str | None, text: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A whole answer's content: its thinking, its text, then its tool calls."""
    content = [thinking_block(thinking)] if thinking else []
    if text:
        content.append(text_block(text))
    content.extend(tool_use_block(call) for call in calls)
    return content
