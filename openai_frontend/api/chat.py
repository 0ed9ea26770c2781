"""POST /v1/chat/completions: messages -> prompt, tools and reasoning, one response or a stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response

from backend.contract import GenerationRequest, ModelInfo
from backend.contract.vision import VisionItem
from openai_frontend.api.chat_protocol import ChatCompletionRequest
from openai_frontend.api.errors import bad_request
from openai_frontend.api.logprobs import chat_logprobs
from openai_frontend.api.request_builder import build_request, returns_token_ids, validated
from openai_frontend.api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    guard_fields,
    usage_of,
)
from openai_frontend.api.serving import Reply, Serving, json_response
from openai_frontend.api.sse import ChatChunkFormat
from openai_frontend.api.translation import source_text, translates
from openai_frontend.generation.choices import collect_all
from openai_frontend.generation.deltas import Delta
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.media.parts import check_parts, expand_placeholders, media_parts, prepare_items, processor_for
from openai_frontend.operations.limits import ticket_of
from openai_frontend.parsing.chat_reasoning import ChatReasoning
from openai_frontend.parsing.chat_tools import ChatTools


async def chat(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    reply = await serving.start(body, "chat", "chatcmpl")
    info, dump = reply.info, reply.dump
    vision = await chat_vision(serving, body, info)
    messages = [m.template_dict() for m in body.messages]
    tools = ChatTools.of(serving.tool_parser, body)
    ticket = ticket_of(request)
    generation = await chat_request(serving, body, messages, tools, reply, ticket.tenant, vision)
    streams = serving.generate(body, [generation], "chat", ticket, dump)
    reasoning = ChatReasoning.of(info)
    token_text = serving.tokenization.token_text

    def logprobs(_: int, delta: Delta) -> dict[str, Any] | None:
        return chat_logprobs(delta.logprobs, token_text) if body.logprobs and delta.logprobs is not None else None

    if body.stream:
        streams = [parsed_stream(stream, reasoning, tools) for stream in streams]
        fmt = ChatChunkFormat(reply.id, reply.created, reply.model, body.include_usage(), logprobs, body.n)
        if returns_token_ids(body):
            fmt.prompt_token_ids = [list(generation.prompt_tokens)]
        return await serving.stream(body, streams, fmt, request, dump, searching=generation.num_beams > 1)
    wholes = await serving.until_done(body, collect_all(streams), request)
    choices = [_choice(i, whole, reasoning, tools, logprobs(i, whole)) for i, whole in enumerate(wholes)]
    finals = [whole.final for whole in wholes]
    response = ChatCompletionResponse(
        id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=usage_of(finals, body.n)
    )
    if returns_token_ids(body):  # vLLM's shape: the prompt's tokens top-level, each choice's own
        response.prompt_token_ids = list(generation.prompt_tokens)
        for choice, whole in zip(choices, wholes, strict=True):
            choice.token_ids = whole.token_ids
    return json_response(response, finals, dump)


async def chat_request(
    serving: Serving,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    tools: ChatTools | None,
    reply: Reply,
    tenant: str,
    vision: tuple[VisionItem, ...] = (),
) -> GenerationRequest:
    """The conversation's prompt (each image's and video's placeholder expanded), and the request for it."""
    tokenization, info = serving.tokenization, reply.info
    prompt = await chat_prompt(tokenization, body, messages, tools, info)
    if info.vision is not None:
        prompt = expand_placeholders(prompt, vision, info.vision)
    # Stop strings are matched here, so the model streams to let us cancel it early.
    stream = body.stream or bool(body.stop_strings())
    prediction = await tokenization.encode_text(body.prediction.text()) if body.prediction else []
    generation = build_request(
        body, prompt, info, tenant=tenant, stream=stream, presets=info.sampling_defaults, prediction=prediction,
        adapter_slot=reply.adapter_slot,
    )  # fmt: skip
    generation.vision = vision
    if tools is not None:
        tools.constrain(generation, messages)
    return validated(body, generation, info)


async def chat_vision(serving: Serving, body: ChatCompletionRequest, info: ModelInfo) -> tuple[VisionItem, ...]:
    """The messages' images and videos, checked and preprocessed (media/parts.py); a 400
    naming the first bad part."""
    parts = media_parts(body.messages)
    if not parts:
        return ()
    check_parts(parts, info, serving.media)
    processor = processor_for(serving.images, info.vision, body.mm_processor_kwargs)
    return await prepare_items(parts, processor, serving.media, info.max_model_len)


async def chat_prompt(
    tokenization: Tokenization,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    tools: ChatTools | None,
    info: ModelInfo,
) -> list[int]:
    """The conversation through the chat template; for a translation model, the text of
    its last user message alone (api/translation.py)."""
    if translates(info):
        if tools is not None:
            param = "functions" if body.legacy_functions else "tools"
            raise bad_request(param, f"{param}: a translation model does not call tools")
        return await tokenization.encode_text(source_text(body.messages))
    if tools is None:
        return await tokenization.encode_chat(messages, None, body.template_kwargs())
    in_template = tokenization.template_has_tools
    template_messages = tools.template_messages(messages, in_template)
    template_tools = body.tools if in_template else None
    return await tokenization.encode_chat(template_messages, template_tools, body.template_kwargs())


def parsed_stream(
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
    final = whole.final
    if tools is None:
        message = AssistantMessage(content=answer, reasoning_content=thinking)
    else:
        content, calls = tools.parse(answer)
        tools.settle(final, bool(calls))
        message = AssistantMessage(content=content, reasoning_content=thinking)
        if tools.legacy:
            message.function_call = calls[0]["function"] if calls else None
        else:
            message.tool_calls = calls
    return ChatChoice(
        index=index, message=message, logprobs=logprobs, finish_reason=final.finish_reason.value, **guard_fields(final)
    )
