"""The body of POST /v1/responses: what is honoured, what is accepted with no effect, what is refused.

Every top-level field is in FIELDS; any other is a 400 naming it. Nested objects
(`text`, `reasoning`, input items, tools) are checked by name too (api/errors.py's
shape, `param` the dotted path: `input[2].call_id`, `tools[0].type`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from openai_frontend.api.errors import bad_request

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced (a grammar)


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the one verbosity: the model's own


class ReasoningConfig(_Strict):
    effort: Literal[EFFORTS] | None = None
    # no summaries are made: "auto" (the server's choice) is accepted and makes none
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None


# name -> what it does here ("" = honoured; a note = accepted with no effect)
NO_EFFECT = {
    "user": "OpenAI's end-user id for abuse monitoring",
    "safety_identifier": "OpenAI's end-user id for abuse monitoring",
    "metadata": "kept with the stored response and echoed",
}


class ResponsesRequest(BaseModel):
    """POST /v1/responses (and /v1/responses/input_tokens, which reads the prompt's fields)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # accepted at the one value this server has
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # reasoning.encrypted_content: reasoning items come back in clear (content), never encrypted
    include: list[Literal["reasoning.encrypted_content"]] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, metadata):
        if metadata and len(metadata) > 16:
            raise ValueError("at most 16 keys")
        for key, value in (metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("keys are at most 64 characters, values at most 512")
        return metadata

    def check_fields(self) -> None:
        """A 400 naming the first field this API does not have (nothing is ignored)."""
        for name in self.model_extra or {}:
            raise bad_request(name, f"{name}: is not a field of the Responses API here (or is not supported)")

    @property
    def stores(self) -> bool:
        return self.store is not False

    def format_dict(self) -> dict[str, Any]:
        """text.format as the response echoes it."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return {"type": "text"}
        return fmt.model_dump(by_alias=True, exclude_none=True)
