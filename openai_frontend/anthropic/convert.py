"""An Anthropic Messages body -> the chat endpoint's body (api/chat_protocol.py), so that
both endpoints share one pipeline: template, tools, reasoning, request, generation.

- `system` is the first message; a user turn's `tool_result` blocks become tool messages
  (before the turn's text), an assistant turn's `tool_use` blocks its tool calls; earlier
  `thinking` blocks are not sent to the model again (as Anthropic does).
- `tools` are functions (`input_schema` their parameters); `tool_choice` auto / any /
  tool / none is "auto" / "required" / the named function / "none", and
  `disable_parallel_tool_use` turns parallel calls off.
- `thinking` enabled is the template's enable_thinking and the contract's
  thinking_budget (`budget_tokens`); disabled turns thinking off.
"""

from __future__ import annotations

import json
from typing import Any

from openai_frontend.anthropic.protocol import CountTokensRequest, Message, MessagesRequest
from openai_frontend.api.chat_protocol import ChatCompletionRequest
from openai_frontend.api.errors import bad_request


def chat_body(body: CountTokensRequest, reasons: bool) -> ChatCompletionRequest:
    """The chat body of the same request (`reasons`: whether the model has thinking markers)."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    fields.update(_tool_fields(body))
    fields.update(_thinking_fields(body, reasons))
    if isinstance(body, MessagesRequest):
        fields.update(_sampling_fields(body))
    return ChatCompletionRequest.model_validate(fields)


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = body.system_text()
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        messages.extend(_turn(index, message))
    return messages


def _turn(index: int, message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user turn's tool results come first)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    parts: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for number, block in enumerate(message.content):
        where = f"messages[{index}].content[{number}]"
        if block.type in ("tool_use", "tool_result") and _role_of(block.type) != message.role:
            raise bad_request(where, f"{where}: a {block.type} block belongs in a {_role_of(block.type)} turn")
        if block.type == "text":
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(where, block)}})
        elif block.type == "tool_use":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif block.type == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(where, block)})
    turn: list[dict[str, Any]] = list(results)
    if parts or calls or not results:
        chat: dict[str, Any] = {"role": message.role, "content": _content(parts)}
        if calls:
            chat["tool_calls"] = calls
        turn.append(chat)
    return turn


def _role_of(block_type: str) -> str:
    return "assistant" if block_type == "tool_use" else "user"


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if any(part["type"] != "text" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def _image_url(where: str, block) -> str:
    try:
        return block.source.data_url()
    except ValueError as exc:
        raise bad_request(f"{where}.source", f"{where}.source: {exc}") from None


def _result_text(where: str, block) -> str:
    try:
        return block.text()
    except ValueError as exc:
        raise bad_request(f"{where}.content", f"{where}.content: {exc}") from None


def _tool_fields(body: CountTokensRequest) -> dict[str, Any]:
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice.type in ("any", "tool"):
            raise bad_request("tool_choice", f"tool_choice: {choice.type!r} needs `tools`")
        return {}
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in body.tools
    ]
    fields: dict[str, Any] = {"tools": tools}
    if choice is None:
        return fields
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice.name", "tool_choice.name: a tool choice of type 'tool' names the tool")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _thinking_fields(body: CountTokensRequest, reasons: bool) -> dict[str, Any]:
    thinking = body.thinking
    if thinking is None:
        return {}
    if thinking.type == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}} if reasons else {}
    if not reasons:
        raise bad_request("thinking", "thinking: this model does not reason; thinking cannot be enabled")
    if thinking.budget_tokens is None:
        raise bad_request("thinking.budget_tokens", "thinking.budget_tokens: required when thinking is enabled")
    if isinstance(body, MessagesRequest) and thinking.budget_tokens >= body.max_tokens:
        raise bad_request("thinking.budget_tokens", "thinking.budget_tokens: must be less than max_tokens")
    return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget": thinking.budget_tokens}


def _sampling_fields(body: MessagesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": body.stream}
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    return fields
