"""The Response object: its echo of the request, its output items, status and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

from backend.contract import FinalEvent, FinishReason
from openai_frontend.responses_api.protocol import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def head(body: ResponsesRequest, response_id: str, created: int, model: str) -> dict[str, Any]:
    """The response's fields before any output: the request echoed, status in_progress."""
    reasoning = body.reasoning
    optional = {
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
    }
    return {
        **{name: value for name, value in optional.items() if value is not None},  # strings in the spec, never null
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": False,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None, "summary": None},
        "service_tier": "default",
        "temperature": body.temperature,
        "text": {"format": body.format_dict(), "verbosity": "medium"},
        "tool_choice": body.tool_choice or "auto",
        "tools": [_echo_tool(tool) for tool in body.tools or []],
        "top_p": body.top_p,
        "truncation": "disabled",
    }  # usage comes with the output (an object in the spec, never null)


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "description": None, "parameters": None, "strict": True, **tool}


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": rid or item_id("rs"), "type": "reasoning", "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str = "completed", mid: str | None = None) -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"id": mid or item_id("msg"), "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(call: dict[str, Any], status: str = "completed", fid: str | None = None) -> dict[str, Any]:
    function = call["function"]
    return {
        "id": fid or item_id("fc"),
        "type": "function_call",
        "call_id": call.get("id") or item_id("call"),
        "name": function["name"],
        "arguments": function.get("arguments") or "",
        "status": status,
    }


def output_items(reasoning: str | None, content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Thinking first, then the answer's text (left out when it is empty and calls were made), then the calls."""
    items = [reasoning_item(reasoning)] if reasoning else []
    if content or not calls:
        items.append(message_item(content or ""))
    return items + [call_item(call) for call in calls]


def usage(final: FinalEvent) -> dict[str, Any]:
    prompt, output = final.num_prompt_tokens, final.num_output_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens or 0, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": final.num_reasoning_tokens or 0},
        "total_tokens": prompt + output,
    }


def finished(response: dict[str, Any], final: FinalEvent, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The response once its generation ended: its output, status and usage."""
    cut = final.finish_reason is FinishReason.LENGTH
    status = "incomplete" if cut else "completed"
    if cut:  # the last item was cut short
        for item in items[-1:]:
            item["status"] = "incomplete"
    return {
        **response,
        "status": status,
        "completed_at": int(time.time()) if not cut else None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": items,
        "usage": usage(final),
    }
