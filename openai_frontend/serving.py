"""Serving one generation request: contract fields in, an OpenAI response out."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from backend.model_settings import ModelSettings
from openai_frontend.chat_reasoning import ChatReasoning
from openai_frontend.chat_tools import ChatTools, finish_reason
from openai_frontend.dump import RequestDump
from openai_frontend.errors import OpenAIError, bad_request, model_not_found, server_error
from openai_frontend.generation import (
    Delta,
    Outcome,
    collect_all,
    generate_text,
    heads,
    interleave,
    total_usage,
)
from openai_frontend.limits import Ticket, ticket_of
from openai_frontend.logprobs import CompletionLogprobs, chat_logprobs
from openai_frontend.metrics import Metrics
from openai_frontend.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
)
from openai_frontend.sse import ChatChunkFormat, ChunkFormat, CompletionChunkFormat, guard_fields, sse_events
from openai_frontend.tokenization import Tokenization
from openai_frontend.tools import get_tool_parser
from openai_frontend.triton_client import EngineError, TritonLLM

T = TypeVar("T")
log = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


class ClientGone(Exception):
    pass


class Serving:
    """What the handlers share: the tokenizer, the Triton client and the counters."""

    def __init__(
        self,
        tokenization: Tokenization,
        served_model_name: str,
        engine: TritonLLM | None = None,
        dump_dir: Path | None = None,
    ):
        self.tokenization = tokenization
        self.model_settings = ModelSettings.load(tokenization.model_path)
        self.tool_parser = get_tool_parser(self.model_settings.tools.parser)
        self.model_name = served_model_name
        self.engine = engine  # set in the app's lifespan
        self.dump_dir = dump_dir  # --dump: one JSON file per request
        self.metrics = Metrics(served_model_name, tokenization.max_model_len or 8192)
        self.created = int(time.time())

    def models(self) -> ModelList:
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.tokenization.max_model_len)
        return ModelList(data=[card])

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        dump = self._dump(response_id, "chat", request, body)
        messages = [m.template_dict() for m in body.messages]
        tools = ChatTools.of(self.tool_parser, body)
        extra_fields: dict[str, Any] = {}
        if tools is not None:
            if body.response_format is not None and body.response_format.type != "text":
                raise bad_request("response_format", "cannot be combined with tools unless tool_choice is none")
            has_tools_section = self.tokenization.template_has_tools
            prompt = self.tokenization.encode_chat(
                tools.template_messages(messages, has_tools_section),
                body.tools if has_tools_section else None,
                body.template_kwargs(),
            )
            extra_fields = tools.contract_fields(messages)
        else:
            prompt = self.tokenization.encode_chat(messages, None, body.template_kwargs())
        reasoning = ChatReasoning.of(self.model_settings.reasoning, self.tokenization.tokenizer, prompt)
        streams = self._generate(
            body, prompt, "chat", extra_fields, self.model_settings.sampling, dump, ticket=ticket_of(request)
        )
        if body.stream:
            if reasoning is not None:
                streams = [reasoning.stream(stream) for stream in streams]
            if tools is not None:
                streams = [tools.stream(stream) for stream in streams]
        token_text = self.tokenization.token_text

        def logprobs(_: int, delta: Delta) -> dict[str, Any] | None:
            return chat_logprobs(delta.logprobs, token_text) if body.logprobs and delta.logprobs is not None else None

        if body.stream:
            fmt = ChatChunkFormat(response_id, int(time.time()), self.model_name, body.include_usage(), logprobs)
            return await self._stream(body, streams, fmt, request, dump)
        wholes = await self._until_done(body, collect_all(streams), request)
        choices = []
        for i, whole in enumerate(wholes):
            thinking, answer = reasoning.split(whole.text) if reasoning is not None else (None, whole.text)
            content, calls = tools.parse(answer) if tools is not None else (answer, [])
            message = AssistantMessage(content=content, reasoning_content=thinking, tool_calls=calls)
            reason = finish_reason(whole.outcome.finish_reason, bool(calls), whole.outcome.stop_guard)
            choices.append(
                ChatChoice(
                    index=i, message=message, logprobs=logprobs(i, whole), finish_reason=reason,
                    **guard_fields(whole.outcome),
                )
            )  # fmt: skip
        usage = total_usage([whole.outcome for whole in wholes])
        response = ChatCompletionResponse(
            id=response_id, created=int(time.time()), model=self.model_name, choices=choices, usage=usage
        )
        return _json(response, [whole.outcome for whole in wholes], dump)

    async def complete(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        dump = self._dump(response_id, "completions", request, body)
        prompt = self.tokenization.encode_prompt(body.prompt)
        streams = self._generate(body, prompt, "completions", dump=dump, ticket=ticket_of(request))
        if body.echo:
            prompt_text = self.tokenization.prompt_text(body.prompt)
            offsets = self.tokenization.text_offsets(prompt)
            streams = [_echoed(stream, prompt_text, offsets) for stream in streams]
        # one per choice: text offsets run on within a choice
        formatters = [CompletionLogprobs(self.tokenization.token_text) for _ in streams]

        def logprobs(index: int, delta: Delta) -> dict[str, Any] | None:
            wanted = body.logprobs is not None and delta.logprobs is not None
            return formatters[index].format(delta.logprobs) if wanted else None

        if body.stream:
            fmt = CompletionChunkFormat(response_id, int(time.time()), self.model_name, body.include_usage(), logprobs)
            return await self._stream(body, streams, fmt, request, dump)
        wholes = await self._until_done(body, collect_all(streams), request)
        choices = [
            CompletionChoice(
                index=i,
                text=w.text,
                logprobs=logprobs(i, w),
                finish_reason=w.outcome.finish_reason,
                **guard_fields(w.outcome),
            )
            for i, w in enumerate(wholes)
        ]
        usage = total_usage([w.outcome for w in wholes])
        response = CompletionResponse(
            id=response_id, created=int(time.time()), model=self.model_name, choices=choices, usage=usage
        )
        return _json(response, [w.outcome for w in wholes], dump)

    def _generate(
        self,
        body: GenerationRequest,
        prompt: list[int],
        endpoint: str,
        extra_fields: dict[str, Any] | None = None,
        presets: dict[str, Any] | None = None,
        dump: RequestDump | None = None,
        *,
        ticket: Ticket,
    ) -> list[AsyncIterator[Delta]]:
        """One delta stream per choice: n model requests for the same prompt tokens (the
        model's prefix cache shares the prompt's KV blocks between them). `presets`: the
        model's sampling defaults, under the request's own values. `ticket`: the tenant
        it runs as (scoping the prefix cache) and its token budget, charged here."""
        stops = body.stop_strings()
        # Stop strings are matched here, so the model streams to let us cancel it early.
        fields = body.contract_fields(prompt, stream=body.stream or bool(stops))
        fields.update(extra_fields or {})
        fields["lookup_tenant"] = ticket.tenant.encode()
        tenant = ticket.tenant
        self.metrics.received(endpoint, tenant)
        if presets:
            fields = body.with_presets(fields, presets)
        max_new_tokens = body.check_context(len(prompt), self.tokenization.max_model_len)
        ticket.reserve(len(prompt), fields.get("max_tokens") or max_new_tokens, body.n)
        streams = []
        for index in range(body.n):
            detokenizer = self.tokenization.detokenizer(prompt)
            choice_fields = body.choice_fields(fields, index)
            if dump is not None:
                dump.tensors(choice_fields)
            text = generate_text(self.engine, choice_fields, detokenizer, stops)
            streams.append(ticket.metered(self._observed(text, index, dump, tenant)))
        return streams

    def _dump(self, response_id: str, endpoint: str, request: Request, body: GenerationRequest) -> RequestDump | None:
        directory = self.dump_dir
        if directory is None:
            return None
        return RequestDump(directory, response_id, endpoint, body.model_dump(mode="json", exclude_unset=True))

    async def _stream(
        self,
        body: GenerationRequest,
        streams: list[AsyncIterator[Delta]],
        fmt: ChunkFormat,
        request: Request,
        dump: RequestDump | None = None,
    ) -> Response:
        # Every choice's first delta comes before the response begins: a refused request
        # still gets its HTTP status.
        deltas = interleave(streams)
        first = await self._until_done(body, heads(deltas, len(streams)), request)

        def to_error(exc: Exception) -> OpenAIError:
            error = self._error(body, exc)
            self.metrics.errors[error.status] += 1
            return error

        events = sse_events(first, deltas, len(streams), fmt, to_error)
        if dump is not None:
            events = _recorded(events, dump)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _until_done(self, body: GenerationRequest, work: Awaitable[T], request: Request) -> T:
        try:
            return await _unless_disconnected(request, work)
        except ClientGone:
            raise OpenAIError(CLIENT_CLOSED_REQUEST, "the client closed the connection") from None
        except Exception as exc:
            raise self._error(body, exc) from exc

    def _error(self, body: GenerationRequest, exc: Exception) -> OpenAIError:
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, EngineError) and exc.field is not None:
            return bad_request(body.param_of(exc.field), exc.message)
        if not isinstance(exc, EngineError):
            log.error("generation failed", exc_info=exc)
        return server_error(str(exc) or type(exc).__name__)

    async def _observed(
        self, deltas: AsyncIterator[Delta], index: int = 0, dump: RequestDump | None = None, tenant: str = ""
    ) -> AsyncIterator[Delta]:
        """Counts a generation: running, tokens, latencies, and how it ended ("abort":
        client left). Its end-to-end latency runs from here: the first pull starts its
        model request."""
        metrics = self.metrics
        metrics.running += 1
        started = time.monotonic()
        ended = False
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    if delta.outcome is not None:
                        ended = True
                        self._record(delta.outcome, time.monotonic() - started, tenant)
                        if dump is not None:
                            dump.final(index, delta.outcome)
                    yield delta
        except (GeneratorExit, asyncio.CancelledError):
            if not ended:
                metrics.aborted()
            raise
        finally:
            metrics.running -= 1

    def _record(self, outcome: Outcome, e2e_s: float, tenant: str = "") -> None:
        self.metrics.finished(outcome, e2e_s, tenant)


async def _echoed(deltas: AsyncIterator[Delta], prompt_text: str, prompt_offsets: list[int]) -> AsyncIterator[Delta]:
    """Completions `echo`: the prompt's text (and its logprobs, when asked) come first;
    the generated tokens' text offsets move past the prompt's text."""
    first = True
    async with aclosing(deltas):
        async for delta in deltas:
            for entry in delta.logprobs or ():
                if entry.offset is not None:
                    entry.offset += len(prompt_text)
            if first:
                first = False
                delta.text = prompt_text + delta.text
                if delta.prompt_logprobs is not None:
                    for entry, offset in zip(delta.prompt_logprobs, prompt_offsets, strict=False):
                        entry.offset = offset
                    delta.logprobs = delta.prompt_logprobs + (delta.logprobs or [])
            yield delta


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and so its Triton request) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


FINISH_GUARD_HEADER = "x-finish-guard"
THINKING_GUARD_HEADER = "x-thinking-guard"


def _json(model, outcomes: list[Outcome] | None = None, dump: RequestDump | None = None) -> Response:
    """The response; its headers name the guard that ended each choice (and the one that
    ended its thinking, if one did), comma-separated in choice order."""
    body = model.model_dump_json()
    if dump is not None:
        dump.response(json.loads(body))
    headers = {}
    if outcomes:
        headers[FINISH_GUARD_HEADER] = ",".join(o.stop_guard for o in outcomes)
        if any(o.thinking_guard for o in outcomes):
            headers[THINKING_GUARD_HEADER] = ",".join(o.thinking_guard for o in outcomes)
    return Response(body, media_type="application/json", headers=headers)


async def _recorded(events: AsyncIterator[str], dump: RequestDump) -> AsyncIterator[str]:
    """The SSE events as they go, and into the dump once the stream is over."""
    sent = []
    try:
        async for event in events:
            sent.append(event)
            yield event
    finally:
        dump.response("".join(sent))
