"""A Responses body as the chat body the chat pipeline runs (api/chat.py's pieces), and
errors named back in the Responses API's fields."""

from __future__ import annotations

from typing import Any, ClassVar

from openai_frontend.api.chat_protocol import ChatCompletionRequest
from openai_frontend.api.errors import OpenAIError, bad_request
from openai_frontend.responses_api.protocol import ResponsesRequest

_FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict"}

# a chat body's field -> the Responses field behind it
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "chat_template_kwargs.enable_thinking": "reasoning.effort",
}


class ResponsesChat(ChatCompletionRequest):
    """The chat body of a Responses request: errors name the Responses fields."""

    PROMPT_PARAM: ClassVar[str] = "input"

    def param_of(self, field: str) -> str:
        param = super().param_of(field)
        return _PARAMS.get(param, param)


def renamed(error: OpenAIError) -> OpenAIError:
    """A chat-named error (`reasoning_effort: ...`) named by the Responses field."""
    param = _PARAMS.get(error.param or "")
    if param is None:
        return error
    message = error.message
    if message.startswith(f"{error.param}:"):
        message = param + message[len(error.param) :]
    return OpenAIError(error.status, message, param, error.type, error.code, error.headers)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; any other tool type is a 400 naming it."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{i}].type", f"tools[{i}].type: tools of type {kind!r} are not supported; only function tools"
            )
        unknown = sorted(set(tool) - _FUNCTION_KEYS)
        if unknown:
            raise bad_request(f"tools[{i}].{unknown[0]}", f"tools[{i}].{unknown[0]}: not a field of a function tool")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}].name", f"tools[{i}].name: a function tool needs a name")
        function = {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None
        }
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) - {"type", "name"}:
        raise bad_request("tool_choice", "tool_choice: none, auto, required or {type: function, name}")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise bad_request("text.format", "text.format: a json_schema format needs a name and a schema")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ResponsesChat:
    """The chat body of the same request (validated as chat validates its own)."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body),
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": bool(body.stream),
        "user": body.user,
        "prompt_cache_key": body.prompt_cache_key,  # the conversation, for the router (REPLICAS)
    }
    return ResponsesChat.model_validate({k: v for k, v in fields.items() if v is not None})
