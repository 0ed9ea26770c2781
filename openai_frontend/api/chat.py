"""POST /v1/chat/completions: messages -> prompt, tools and reasoning, one response or a stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response

from backend.contract import GenerationRequest, ModelInfo
from openai_frontend.api.chat_protocol import ChatCompletionRequest
from openai_frontend.api.errors import bad_request
from openai_frontend.api.logprobs import chat_logprobs
from openai_frontend.api.request_builder import build_request, validated
from openai_frontend.api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    guard_fields,
    usage_of,
)
from openai_frontend.api.serving import Serving, json_response
from openai_frontend.api.sse import ChatChunkFormat
from openai_frontend.generation.choices import collect_all
from openai_frontend.generation.deltas import Delta
from openai_frontend.operations.limits import ticket_of
from openai_frontend.parsing.chat_reasoning import ChatReasoning
from openai_frontend.parsing.chat_tools import ChatTools, finish_reason


async def chat(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    serving.check_model(body.model)
    info = await serving.model_info()
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    dump = serving.dump(response_id, "chat", body)
    messages = [m.template_dict() for m in body.messages]
    tools = ChatTools.of(serving.tool_parser, body)
    ticket = ticket_of(request)
    generation = _request(serving, body, messages, tools, info, ticket.tenant)
    streams = serving.generate(body, generation, "chat", ticket, dump)
    reasoning = ChatReasoning.of(info)
    token_text = serving.tokenization.token_text

    def logprobs(_: int, delta: Delta) -> dict[str, Any] | None:
        return chat_logprobs(delta.logprobs, token_text) if body.logprobs and delta.logprobs is not None else None

    if body.stream:
        streams = [_parsed(stream, reasoning, tools) for stream in streams]
        fmt = ChatChunkFormat(response_id, int(time.time()), serving.model_name, body.include_usage(), logprobs)
        return await serving.stream(body, streams, fmt, request, dump)
    wholes = await serving.until_done(body, collect_all(streams), request)
    choices = [_choice(i, whole, reasoning, tools, logprobs(i, whole)) for i, whole in enumerate(wholes)]
    finals = [whole.final for whole in wholes]
    response = ChatCompletionResponse(
        id=response_id, created=int(time.time()), model=serving.model_name, choices=choices, usage=usage_of(finals)
    )
    return json_response(response, finals, dump)


def _request(
    serving: Serving,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    tools: ChatTools | None,
    info: ModelInfo,
    tenant: str,
) -> GenerationRequest:
    """The conversation through the chat template, and the request for it."""
    tokenization = serving.tokenization
    if tools is None:
        prompt = tokenization.encode_chat(messages, None, body.template_kwargs())
    else:
        if body.response_format is not None and body.response_format.type != "text":
            raise bad_request("response_format", "cannot be combined with tools unless tool_choice is none")
        in_template = tokenization.template_has_tools
        template_messages = tools.template_messages(messages, in_template)
        prompt = tokenization.encode_chat(
            template_messages, body.tools if in_template else None, body.template_kwargs()
        )
    # Stop strings are matched here, so the model streams to let us cancel it early.
    stream = body.stream or bool(body.stop_strings())
    generation = build_request(body, prompt, info, tenant=tenant, stream=stream, presets=info.sampling_defaults)
    if tools is not None:
        tools.constrain(generation, messages)
    return validated(body, generation, info)


def _parsed(
    deltas: AsyncIterator[Delta], reasoning: ChatReasoning | None, tools: ChatTools | None
) -> AsyncIterator[Delta]:
    """A streamed choice with its thinking split off, then its tool calls parsed out."""
    if reasoning is not None:
        deltas = reasoning.stream(deltas)
    if tools is not None:
        deltas = tools.stream(deltas)
    return deltas


def _choice(
    index: int, whole: Delta, reasoning: ChatReasoning | None, tools: ChatTools | None, logprobs: dict | None
) -> ChatChoice:
    thinking, answer = reasoning.split(whole) if reasoning is not None else (None, whole.text)
    content, calls = tools.parse(answer) if tools is not None else (answer, [])
    final = whole.final
    final.finish_reason = finish_reason(final.finish_reason, bool(calls), final.finish_guard)
    message = AssistantMessage(content=content, reasoning_content=thinking, tool_calls=calls)
    return ChatChoice(
        index=index, message=message, logprobs=logprobs, finish_reason=final.finish_reason.value, **guard_fields(final)
    )
