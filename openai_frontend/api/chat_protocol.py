"""The body of /v1/chat/completions: messages, response_format, tools, and the chat extensions."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from openai_frontend.api.errors import bad_request
from openai_frontend.api.protocol import GenerationBody


class JsonSchemaFormat(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow a pydantic BaseModel attribute
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is always enforced (a grammar), strict or not

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_is_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self

    def grammar(self) -> tuple[str, str] | None:
        """The output constraint as a grammar (kind, spec); None for "text"."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return "json_object", ""
        return "json_schema", json.dumps(self.json_schema.schema_)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            # a non-string type (a fuzzer's {}) is left to the TextPart validation: a 400
            types = [part.get("type") for part in content if isinstance(part, dict)]
            kinds = {kind for kind in types if isinstance(kind, str)} - {"text"}
            if kinds:
                raise ValueError(f"only text content parts are supported, not {', '.join(sorted(kinds))}")
        return content

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(GenerationBody):
    PROMPT_PARAM: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = None

    # --- extensions ---
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None  # the same as chat_template_kwargs.enable_thinking

    def check_sizes(self, max_messages: int, max_string_chars: int) -> None:
        if max_messages and len(self.messages) > max_messages:
            message = f"messages: at most {max_messages} messages per request, got {len(self.messages)}"
            raise bad_request("messages", message)
        super().check_sizes(max_messages, max_string_chars)

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template receives besides the messages (and tools)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.enable_thinking is not None:
            kwargs.setdefault("enable_thinking", self.enable_thinking)
        return kwargs

    def grammar(self) -> tuple[str, str] | None:
        return self.response_format.grammar() if self.response_format is not None else None

    def forces_thinking(self) -> bool:
        """enable_thinking: a thinking block the template did not open is forced (reasoning models)."""
        return bool(self.template_kwargs().get("enable_thinking"))

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_counts(self) -> tuple[bool, int]:
        return bool(self.logprobs), (self.top_logprobs or 0) if self.logprobs else 0

    def param_of(self, field: str) -> str:
        if field in ("grammar_kind", "grammar_spec") and self.tools and self.tool_choice != "none":
            return "tools"
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().param_of(field)
