"""OpenAI request and response shapes, and the mapping of a request to contract fields.

Fields follow the order of the OpenAI API reference; a marked block of extensions
(vLLM-style, sent by clients as extra body fields) follows. Unknown top-level fields
are accepted and logged, as vLLM does. A field this server cannot honour is never
dropped: the frontend rejects it with a 400 naming it, or forwards it to the model,
whose contract rejects features it has not built (and that error names the field).
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backend import contract
from openai_frontend.errors import bad_request

log = logging.getLogger(__name__)

MAX_CHOICES = 8  # `n`: each choice is its own model request (the prefix cache shares the prompt)
MAX_TIMEOUT_S = 86_400.0 * 365  # `timeout`: a year; a bound keeps deadline_ms finite (1e308 s overflowed)

# Contract inputs a client may not set directly: the frontend derives them.
_PRIVATE_INPUTS = frozenset({"prompt_tokens", "stream", "lookup_tenant"})
# OpenAI fields that carry no meaning for generation here; ignored without a warning.
_HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})
# contract input -> the request field a client sets it with (for error messages)
_PARAM_OF_INPUT = {
    "logit_bias_ids": "logit_bias",
    "logit_bias_values": "logit_bias",
    "grammar_kind": "response_format",
    "grammar_spec": "response_format",
    "stop_tokens": "stop_token_ids",
    "tools_present": "tools",
    "require_tool_call": "tool_choice",
    "suppress_tool_call": "tool_choice",
    "enable_thinking": "chat_template_kwargs.enable_thinking",
    "loop_min_pattern_size": "repetition_detection.min_pattern_size",
    "loop_max_pattern_size": "repetition_detection.max_pattern_size",
    "loop_min_count": "repetition_detection.min_count",
    "deadline_ms": "timeout",
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class RepetitionDetection(BaseModel):
    """The loop detectors' settings for one request (absent fields: the model's defaults):
    a pattern of min_pattern_size..max_pattern_size tokens repeated min_count times in a
    row (0 turns the detectors off)."""

    model_config = ConfigDict(extra="forbid")

    min_pattern_size: int | None = Field(None, ge=1)
    max_pattern_size: int | None = Field(None, ge=1)
    min_count: int | None = Field(None, ge=0)


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

    def grammar_fields(self) -> dict[str, Any]:
        """The output constraint as contract fields (none for "text")."""
        if self.type == "text":
            return {}
        if self.type == "json_object":
            return {"grammar_kind": "json_object", "grammar_spec": ""}
        return {"grammar_kind": "json_schema", "grammar_spec": json.dumps(self.json_schema.schema_)}


class GenerationRequest(BaseModel):
    """What both endpoints share: the extensions, and the mapping to the contract."""

    model_config = ConfigDict(extra="allow")
    PROMPT_PARAM: ClassVar[str] = "prompt"

    # --- extensions (vLLM-style extra body fields) ---
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM sends -1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # DRY's sequence breakers, as llama.cpp's server takes them; absent or empty: its defaults
    dry_sequence_breakers: list[str] | None = None
    # guards: loop detectors, and a deadline in seconds (the answer ends with what it has)
    repetition_detection: RepetitionDetection | None = None
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    # Any other contract input not derived by the frontend (num_beams, dry_multiplier,
    # thinking_budget, ...) may be sent by its contract name and is forwarded as is.

    @field_validator("logit_bias", check_fields=False)
    @classmethod
    def _token_ids_to_bounded_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # the vocabulary bound is the model's to check (its error names logit_bias too)
        for key, value in (bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise ValueError(f"keys must be token ids, got {key!r}") from None
            if not 0 <= token_id < 2**31:
                raise ValueError(f"token id {token_id} is out of range")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be in [-100, 100], got {value} for token {token_id}")
        return bias

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> list[str]:
        stop = self.stop
        return [stop] if isinstance(stop, str) else list(stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def contract_fields(self, prompt_tokens: list[int], stream: bool) -> dict[str, Any]:
        """The request as contract input values (None: left out, the model's default)."""
        fields = self._forwarded_extras()
        bias = self.logit_bias or {}
        fields.update(
            prompt_tokens=prompt_tokens,
            max_tokens=self.max_new_tokens(),
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_k=self.top_k if self.top_k and self.top_k > 0 else None,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias_ids=[int(k) for k in bias] or None,
            logit_bias_values=list(bias.values()) or None,
            seed=self.seed,
            stop_tokens=self.stop_token_ids or None,
            ignore_eos=self.ignore_eos or None,
            dry_sequence_breakers=self.dry_sequence_breakers or None,
            deadline_ms=round(self.timeout * 1000) if self.timeout is not None else None,
            stream=stream,
        )
        loops = self.repetition_detection
        if loops is not None:
            fields.update(
                loop_min_pattern_size=loops.min_pattern_size,
                loop_max_pattern_size=loops.max_pattern_size,
                loop_min_count=loops.min_count,
            )
        return fields

    def with_presets(self, fields: dict[str, Any], presets: dict[str, Any]) -> dict[str, Any]:
        """The model's sampling presets (MODEL.toml) under the request's own values: a
        preset applies only to a field the request did not set."""
        explicit = set(self.model_fields_set) | set(self.model_extra or {})
        if "max_completion_tokens" in explicit:
            explicit.add("max_tokens")
        return {**fields, **{k: v for k, v in presets.items() if k not in explicit and fields.get(k) is None}}

    def choice_fields(self, fields: dict[str, Any], index: int) -> dict[str, Any]:
        """Choice `index`'s fields: with a seed, seed + index (distinct yet reproducible)."""
        if self.seed is None:
            return dict(fields)
        return {**fields, "seed": self.seed + index}

    def check_sizes(self, max_messages: int, max_string_chars: int) -> None:
        """A 400 naming the first string over `max_string_chars` characters (0: no bound),
        so no tokenizer or template ever runs on one."""
        path = _long_string(self.model_dump(exclude_unset=True, by_alias=True), max_string_chars)
        if path is not None:
            raise bad_request(path, f"{path}: longer than {max_string_chars} characters")

    def check_context(self, prompt_len: int, max_model_len: int | None) -> int:
        """The most new tokens a choice may ask for: max_tokens, else what the context
        leaves (0 when the context length is unknown). A 400 with the numbers when the
        prompt, or the prompt and max_tokens, do not fit the model's context."""
        asked = self.max_new_tokens()
        if max_model_len is None:
            return asked or 0
        if prompt_len >= max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"{self.PROMPT_PARAM} resulted in {prompt_len} tokens. Please reduce the length of the "
                f"{self.PROMPT_PARAM}."
            )
            raise bad_request(self.PROMPT_PARAM, message)
        if asked is not None and prompt_len + asked > max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + asked} tokens ({prompt_len} in the {self.PROMPT_PARAM}, {asked} in the "
                f"completion). Please reduce the length of the {self.PROMPT_PARAM} or completion."
            )
            raise bad_request(self.param_of("max_tokens"), message)
        return asked if asked is not None else max_model_len - prompt_len

    def param_of(self, input_name: str) -> str:
        """The request field behind a contract input, to name it in an error."""
        if input_name == "prompt_tokens":
            return self.PROMPT_PARAM
        return _PARAM_OF_INPUT.get(input_name, input_name)

    def _forwarded_extras(self) -> dict[str, Any]:
        forwarded = {}
        for name, value in (self.model_extra or {}).items():
            if name in contract.INPUTS_BY_NAME and name not in _PRIVATE_INPUTS:
                forwarded[name] = value
            elif name not in _HARMLESS:
                log.warning("ignoring unknown request field %r", name)
        return forwarded


def _long_string(value: Any, limit: int, path: str = "") -> str | None:
    """The dotted path (`messages.3.content`) of the first string longer than `limit`."""
    if not limit:
        return None
    if isinstance(value, str):
        return path if len(value) > limit else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _long_string(item, limit, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------
# /v1/chat/completions


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


class ChatCompletionRequest(GenerationRequest):
    PROMPT_PARAM: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    response_format: ResponseFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0)
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    top_p: float | None = Field(None, gt=0, le=1)
    user: str | None = None

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

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def contract_fields(self, prompt_tokens: list[int], stream: bool) -> dict[str, Any]:
        """The request's own fields; with tools, the serving layer adds the tool fields
        (and their grammar, which then replaces response_format's)."""
        fields = super().contract_fields(prompt_tokens, stream)
        if self.response_format is not None:
            fields.update(self.response_format.grammar_fields())
        if self.logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or None)
        thinking = self.template_kwargs().get("enable_thinking")
        if thinking:  # a thinking block the template did not open is forced (reasoning models)
            fields["enable_thinking"] = True
        return fields

    def param_of(self, input_name: str) -> str:
        if input_name in ("grammar_kind", "grammar_spec") and self.tools and self.tool_choice != "none":
            return "tools"
        if input_name == "max_tokens" and self.max_completion_tokens:
            return "max_completion_tokens"
        return super().param_of(input_name)


# ---------------------------------------------------------------------------
# /v1/completions


class CompletionRequest(GenerationRequest):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1, le=1)
    echo: bool = False
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI allows up to 5
    max_tokens: int | None = Field(16, ge=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server yet")
        return value

    def contract_fields(self, prompt_tokens: list[int], stream: bool) -> dict[str, Any]:
        fields = super().contract_fields(prompt_tokens, stream)
        if self.logprobs is not None:
            fields.update(logprobs=True, top_logprobs=self.logprobs or None)
            # echo's text is the frontend's; the model adds the prompt's logprobs (and
            # as many alternatives as the generated tokens get)
            if self.echo:
                fields.update(echo=True, prompt_logprobs=self.logprobs or None)
        return fields


# ---------------------------------------------------------------------------
# responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # a reasoning model's thinking (vLLM's field name); left out for models that do not reason
    reasoning_content: str | None = Field(None, exclude_if=lambda text: text is None)
    # left out of the JSON when there are none, as OpenAI does
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, exclude_if=lambda calls: not calls)


def _guard() -> Any:
    """An extension field naming the guard that ended a choice; left out when none did."""
    return Field(None, exclude_if=lambda guard: not guard)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str
    finish_guard: str | None = _guard()  # eos, max_tokens, stop_string, content_loop, deadline, ...
    thinking_guard: str | None = _guard()  # thinking_budget, thinking_loop


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    finish_guard: str | None = _guard()
    thinking_guard: str | None = _guard()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llm-serving"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
