"""The body of /v1/chat/completions: messages, response_format, tools, and the chat extensions."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from openai_frontend.api.fields import CHAT, CHAT_EXTENSIONS, FieldRule
from openai_frontend.api.protocol import GenerationBody
from openai_frontend.generation.chat_template import template_variables


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

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema an answer follows; None for "text"."""
        if self.type == "text":
            return None
        return {"type": "object"} if self.type == "json_object" else self.json_schema.schema_

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


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # low: a smaller pixel budget (media/parts.py)


class ImageURLPart(BaseModel):
    """OpenAI's image part: a data:, http(s):// or file:// URL (media/sources.py's policy)."""

    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(BaseModel):
    url: str


class VideoURLPart(BaseModel):
    """vLLM's video part: an MP4 or WebM file's URL, sampled at VIDEO_FPS (media/video.py)."""

    type: Literal["video_url"]
    video_url: VideoURL


class VideoFramesPart(BaseModel):
    """A video as its frames, each an image URL (as vLLM and qwen-vl-utils take them)."""

    type: Literal["video"]
    video: list[str]


MEDIA_PART_TYPES = ("image_url", "video_url", "video")
ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart | VideoFramesPart, Field(discriminator="type")]


_PART = TypeAdapter(ContentPart)
_SUPPORTED = ", ".join(("text", *MEDIA_PART_TYPES))


def _part(index: int, part: Any) -> Any:
    """One content part, validated; a `content_part` error (its index in ctx) otherwise."""
    kind = part.get("type") if isinstance(part, dict) else None
    if isinstance(kind, str) and kind not in ("text", *MEDIA_PART_TYPES):
        why = f"content parts of type {kind} are not supported; use {_SUPPORTED}"
        raise PydanticCustomError("content_part", "content[{part}]: {why}", {"part": index, "why": why})
    try:
        return _PART.validate_python(part)
    except ValidationError as exc:
        first = exc.errors()[0]
        inner = ".".join(str(name) for name in first["loc"][1:])  # loc[0]: the part type's tag
        why = f"{inner + ': ' if inner else ''}{first['msg']}"
        raise PydanticCustomError("content_part", "content[{part}]: {why}", {"part": index, "why": why}) from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, function_call, ...

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _parts_named(cls, content, handler):
        """A bad part's error names the part (api/errors.py makes it `messages[i].content[j]`)
        and its field, not the union's str branch."""
        if not isinstance(content, list):
            return handler(content)
        return [_part(index, part) for index, part in enumerate(content)]

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(part.type != "text" for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content as one string; the older
        function messages as tool messages, an assistant's function_call as its tool call."""
        content = self.content
        if self.has_media:  # the template places each image's and video's placeholder
            content = [_template_part(part) for part in content]
        elif isinstance(content, list):
            content = "\n".join(part.text for part in content)
        extra = dict(self.model_extra or {})
        call = extra.pop("function_call", None)
        if call and self.role == "assistant" and not extra.get("tool_calls"):
            extra["tool_calls"] = [{"id": "call_0", "type": "function", "function": call}]
        role = "tool" if self.role == "function" else self.role
        return {**extra, "role": role, "content": content or ""}


def _template_part(part) -> dict[str, Any]:
    """A content part as the chat template renders it (Qwen2-VL's: {"type": "image"} ...)."""
    if part.type == "text":
        return {"type": "text", "text": part.text}
    return {"type": "image" if part.type == "image_url" else "video"}


class ChatCompletionRequest(GenerationBody):
    PROMPT_PARAM: ClassVar[str] = "messages"
    FIELDS: ClassVar[dict[str, FieldRule]] = {**CHAT, **CHAT_EXTENSIONS}

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = None

    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    functions: list[dict[str, Any]] | None = None  # the older tools
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None  # the older tool_choice

    # --- extensions ---
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the image processor's resize bounds for this request's images and videos
    mm_processor_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None  # the same as chat_template_kwargs.enable_thinking

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _pixel_bounds(cls, kwargs):
        """min_pixels and max_pixels only: positive integers, min_pixels <= max_pixels."""
        if not kwargs:
            return kwargs
        unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels"})
        if unknown:
            raise ValueError(f"only min_pixels and max_pixels are supported, not {', '.join(unknown)}")
        for name, value in kwargs.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if kwargs.get("min_pixels", 1) > kwargs.get("max_pixels", kwargs.get("min_pixels", 1)):
            raise ValueError("min_pixels must not exceed max_pixels")
        return kwargs

    def check_fields(self) -> None:
        super().check_fields()
        template_variables(self.chat_template_kwargs)

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template receives besides the messages (and tools): variables only
        (generation/chat_template.py); reasoning_effort turns thinking on (any effort but
        none) or off, unless enable_thinking says."""
        kwargs = template_variables(self.chat_template_kwargs)
        if self.enable_thinking is not None:
            kwargs.setdefault("enable_thinking", self.enable_thinking)
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    def reasoning_effort_asked(self) -> str | None:
        return self.reasoning_effort

    @model_validator(mode="after")
    def _functions_are_tools(self):
        """The older `functions` / `function_call` are tools with at most one call."""
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("functions and function_call replace tools and tool_choice: send one pair")
        self.tools = [{"type": "function", "function": function} for function in self.functions or []]
        call = self.function_call
        self.tool_choice = (
            {"type": "function", "function": {"name": call.get("name")}} if isinstance(call, dict) else call
        )
        self.parallel_tool_calls = False
        return self

    @property
    def legacy_functions(self) -> bool:
        """The body used the older functions: the answer's call is a function_call."""
        return self.functions is not None

    def grammar(self) -> tuple[str, str] | None:
        return self.response_format.grammar() if self.response_format is not None else None

    def forced_tool_param(self) -> str | None:
        forced = self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))
        if not forced:
            return None
        return "function_call" if self.legacy_functions else "tool_choice"

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
