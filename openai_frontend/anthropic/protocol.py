"""The body of Anthropic's /v1/messages and /v1/messages/count_tokens, as pydantic models.

Every model forbids fields it does not name, so an unknown field is a 400 naming it
(anthropic/errors.py), never dropped. Accepted on purpose, with no effect: `metadata`
(Anthropic's end-user id) and `cache_control`, top-level or on system, message and tool
blocks (this server caches every prompt's prefix by itself); a `thinking` block's `signature` and a
`redacted_thinking` block (earlier thinking is not sent to the model again).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # a response's text block sent back; none are made here


class ImageSource(_Strict):
    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    def data_url(self) -> str:
        """The image as the chat endpoint takes it: a data: URL, or its http(s) URL."""
        if self.type == "url":
            if not self.url:
                raise ValueError("a url source needs `url`")
            return self.url
        if not self.data or not self.media_type:
            raise ValueError("a base64 source needs `media_type` and `data`")
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Strict):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        content = self.content
        if content is None or isinstance(content, str):
            text = content or ""
        else:
            if any(part.type != "text" for part in content):
                raise ValueError("a tool_result's content may hold text blocks only here")
            text = "\n".join(part.text for part in content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    """A client tool (Anthropic's server tools, `web_search_...` and the like, are not served)."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """The body of /v1/messages/count_tokens: a message request without max_tokens."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def system_text(self) -> str | None:
        system = self.system
        return system if system is None or isinstance(system, str) else "\n".join(b.text for b in system)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # automatic prompt caching: this server's is always on
