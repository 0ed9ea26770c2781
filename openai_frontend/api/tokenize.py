"""vLLM's POST /tokenize and POST /detokenize: the served model's tokenizer and chat template.

/tokenize takes a `prompt` (text, `add_special_tokens` as vLLM: true) or `messages`
(through the chat template as /v1/chat/completions renders them; `add_generation_prompt`
true, `continue_final_message`, `chat_template_kwargs`, `tools`) and answers
{"count", "max_model_len", "tokens"} (+ "token_strs", the vocabulary's strings, when
`return_token_strs`). /detokenize takes `tokens` and answers {"prompt": text}. Both are
behind the same API keys as /v1/ (operations/gate.py GATED_PATHS); a bad field is a 400
in OpenAI's error shape naming it, an unknown `model` a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from openai_frontend.api.chat_protocol import ChatMessage
from openai_frontend.api.errors import bad_request
from openai_frontend.api.serving import Serving
from openai_frontend.generation.chat_template import template_variables

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # prompt: true; messages: false (the template writes them)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is None and (self.continue_final_message or self.chat_template_kwargs or self.tools):
            raise ValueError("continue_final_message, chat_template_kwargs and tools go with messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _serving(request: Request) -> Serving:
    return request.app.state.serving


async def _checked_model(serving: Serving, model: str | None) -> None:
    if model is not None and model != serving.model_name:
        await serving.model_card(model)  # a 404 model_not_found for any other name


@router.post("/tokenize", response_model_exclude_none=True)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    serving = _serving(request)
    await _checked_model(serving, body.model)
    info = await serving.model_info()
    tokenization = serving.tokenization
    if body.messages is None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await tokenization.encode_text(body.prompt, add_special_tokens=special)
    else:
        tokens = await _chat_tokens(serving, body)
    strs = (
        await tokenization.off_loop(tokenization.tokenizer.convert_ids_to_tokens, tokens)
        if body.return_token_strs
        else None
    )
    return TokenizeResponse(count=len(tokens), max_model_len=info.max_model_len, tokens=tokens, token_strs=strs)


async def _chat_tokens(serving: Serving, body: TokenizeRequest) -> list[int]:
    """The messages as /v1/chat/completions renders them (tools only where the template takes them)."""
    tokenization = serving.tokenization
    messages = [message.template_dict() for message in body.messages]
    tools = body.tools if body.tools and tokenization.template_has_tools else None
    variables = template_variables(body.chat_template_kwargs)
    options = (body.add_generation_prompt, body.continue_final_message, bool(body.add_special_tokens))
    return await tokenization.encode_chat(messages, tools, variables, *options)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    serving = _serving(request)
    await _checked_model(serving, body.model)
    tokenizer = serving.tokenization.tokenizer
    vocab = len(tokenizer)  # the ids the tokenizer can write (the model's rows may be padded past them)
    for index, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request("tokens", f"tokens[{index}]: token id {token} is not in the vocabulary (0..{vocab - 1})")
    return DetokenizeResponse(prompt=await serving.tokenization.off_loop(tokenizer.decode, body.tokens))
