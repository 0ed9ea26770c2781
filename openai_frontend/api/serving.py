"""What the endpoint handlers share: the model's facts, the generations of a request, the
response (whole or streamed), and how failures become OpenAI errors."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from pathlib import Path
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from backend.contract import FinalEvent, GenerationRequest, ModelInfo
from openai_frontend.api.errors import OpenAIError, bad_request, model_not_found, server_error
from openai_frontend.api.protocol import GenerationBody
from openai_frontend.api.request_builder import for_choice
from openai_frontend.api.responses import ModelCard, ModelList
from openai_frontend.api.sse import ChunkFormat, sse_events
from openai_frontend.generation.choices import heads, interleave
from openai_frontend.generation.deltas import Delta, generate_text
from openai_frontend.generation.engine_client import EngineError, TritonLLM
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.operations.dump import RequestDump
from openai_frontend.operations.limits import Ticket
from openai_frontend.operations.metrics import Metrics
from openai_frontend.parsing.tools import ToolParser, get_tool_parser

T = TypeVar("T")
log = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
FINISH_GUARD_HEADER = "x-finish-guard"
THINKING_GUARD_HEADER = "x-thinking-guard"


class ClientGone(Exception):
    pass


class Serving:
    """The tokenizer, the engine client, the running model's facts and the counters."""

    def __init__(self, tokenization: Tokenization, served_model_name: str, dump_dir: Path | None = None):
        self.tokenization = tokenization
        self.model_name = served_model_name
        self.engine: TritonLLM | None = None  # set in the app's lifespan
        self.dump_dir = dump_dir  # --dump: one JSON file per request
        self.metrics = Metrics(served_model_name)
        self.created = int(time.time())
        self.info: ModelInfo | None = None  # the running model's facts, once asked
        self.tool_parser: ToolParser | None = None  # the model's tool-call format

    async def model_info(self) -> ModelInfo:
        """The running model's facts, asked of it once (ModelUnavailable while it is down)."""
        if self.info is None:
            info = await self.engine.model_info()
            self.tool_parser = get_tool_parser(info.tool_parser, (info.tool_call_start, info.tool_call_end))
            self.metrics.describe(info.max_model_len)
            self.info = info
        return self.info

    def models(self) -> ModelList:
        max_model_len = self.info.max_model_len if self.info is not None else None
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created, max_model_len=max_model_len)])

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def dump(self, response_id: str, endpoint: str, body: GenerationBody) -> RequestDump | None:
        if self.dump_dir is None:
            return None
        return RequestDump(self.dump_dir, response_id, endpoint, body.model_dump(mode="json", exclude_unset=True))

    def generate(
        self, body: GenerationBody, request: GenerationRequest, endpoint: str, ticket: Ticket, dump: RequestDump | None
    ) -> list[AsyncIterator[Delta]]:
        """One delta stream per choice: n model requests for the same prompt tokens (the
        model's prefix cache shares the prompt's KV blocks between them). `ticket`: the
        tenant it runs as and its token budget, charged here."""
        prompt = request.prompt_tokens
        self.metrics.received(endpoint, ticket.tenant)
        max_new_tokens = body.check_context(len(prompt), self.info.max_model_len)
        ticket.reserve(len(prompt), request.sampling.max_tokens or max_new_tokens, body.n)
        streams = []
        for index in range(body.n):
            choice = for_choice(request, index)
            if dump is not None:
                dump.tensors(choice)
            text = generate_text(self.engine, choice, self.tokenization.detokenizer(prompt), body.stop_strings())
            streams.append(ticket.metered(self._observed(text, index, dump, ticket.tenant)))
        return streams

    async def stream(
        self,
        body: GenerationBody,
        streams: list[AsyncIterator[Delta]],
        fmt: ChunkFormat,
        request: Request,
        dump: RequestDump | None,
    ) -> Response:
        # Every choice's first delta comes before the response begins: a refused request
        # still gets its HTTP status.
        deltas = interleave(streams)
        first = await self.until_done(body, heads(deltas, len(streams)), request)

        def to_error(exc: Exception) -> OpenAIError:
            error = self.error(body, exc)
            self.metrics.errors[error.status] += 1
            return error

        events = sse_events(first, deltas, len(streams), fmt, to_error)
        if dump is not None:
            events = _recorded(events, dump)
        return StreamingResponse(events, media_type="text/event-stream")

    async def until_done(self, body: GenerationBody, work: Awaitable[T], request: Request) -> T:
        try:
            return await _unless_disconnected(request, work)
        except ClientGone:
            raise OpenAIError(CLIENT_CLOSED_REQUEST, "the client closed the connection") from None
        except Exception as exc:
            raise self.error(body, exc) from exc

    def error(self, body: GenerationBody, exc: Exception) -> OpenAIError:
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, EngineError) and exc.field is not None:
            param = body.param_of(exc.field)
            return bad_request(param, exc.message)
        if not isinstance(exc, EngineError):
            log.error("generation failed", exc_info=exc)
        return server_error(str(exc) or type(exc).__name__)

    async def _observed(
        self, deltas: AsyncIterator[Delta], index: int, dump: RequestDump | None, tenant: str
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
                    if delta.final is not None:
                        ended = True
                        metrics.finished(delta.final, time.monotonic() - started, tenant)
                        if dump is not None:
                            dump.final(index, delta.final)
                    yield delta
        except (GeneratorExit, asyncio.CancelledError):
            if not ended:
                metrics.aborted()
            raise
        finally:
            metrics.running -= 1


def json_response(model, finals: list[FinalEvent], dump: RequestDump | None = None) -> Response:
    """The response; its headers name the guard that ended each choice (and the one that
    ended its thinking, if one did), comma-separated in choice order."""
    body = model.model_dump_json()
    if dump is not None:
        dump.response(json.loads(body))
    headers = {FINISH_GUARD_HEADER: ",".join(final.finish_guard.value for final in finals)}
    if any(final.thinking_guard for final in finals):
        guards = [final.thinking_guard.value if final.thinking_guard else "" for final in finals]
        headers[THINKING_GUARD_HEADER] = ",".join(guards)
    return Response(body, media_type="application/json", headers=headers)


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


async def _recorded(events: AsyncIterator[str], dump: RequestDump) -> AsyncIterator[str]:
    """The SSE events as they go, and into the dump once the stream is over."""
    sent = []
    try:
        async for event in events:
            sent.append(event)
            yield event
    finally:
        dump.response("".join(sent))
