"""A stand-in for the frontend's engine client (TritonLLM), for driving the app in-process.

`FakeEngine` answers `model_info()` with a ModelInfo (the default model's facts unless
given others) and `generate(request)` by replaying a token list in packs as
`RequestOutput`s, the last with a `FinalEvent`. It records the `GenerationRequest`s it
received (`requests`) and counts the generations closed before their end (`cancelled`).
`adapters(command)` keeps an AdapterTable (`table`) as the engine does: load adds a name
or makes a new version of it (its slot kept), unload and activate refuse a name not
registered; it records the commands (`commands`). A generation whose adapter_slot names
no adapter in `table` is refused as the engine refuses it (not found).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from backend.contract import (
    BASE_SLOT,
    FOLLOW_ACTIVE,
    AdapterCommand,
    AdapterInfo,
    AdapterNotFound,
    AdapterTable,
    ContractError,
    ErrorReport,
    FinalEvent,
    FinishGuard,
    FinishReason,
    GenerationRequest,
    Logprob,
    ModelInfo,
    RequestOutput,
)
from openai_frontend.generation.engine_client import EngineError, engine_error

# The default model's facts, as its engine reports them (SmolLM2-135M-Instruct's preset).
DEFAULT_INFO = ModelInfo(
    max_model_len=8192,
    vocab_size=49152,
    sampling_defaults={"temperature": 0.2, "top_p": 0.9},
    tool_parser="hermes",
    tool_call_start="<tool_call>",
    tool_call_end="</tool_call>",
)
_GUARD_OF = {FinishReason.STOP: FinishGuard.EOS, FinishReason.LENGTH: FinishGuard.MAX_TOKENS}


def model_refusal(field: str, why: str) -> EngineError:
    """What the engine client raises when the model refuses a request naming `field`
    (the model sends an ErrorReport; the client decodes it)."""
    return engine_error(ErrorReport.of(ContractError(field, why)).encode())


def adapter_not_found(field: str, why: str) -> EngineError:
    """What the engine client raises when the model finds no adapter for `field`."""
    return engine_error(ErrorReport.of(AdapterNotFound(field, why)).encode())


def fake_logprob(token_id: int, alternatives: int, first_alternative: int | None = None) -> Logprob:
    """Made-up logprobs: token t has -t / 1000; its alternatives are the next ids."""
    start = token_id if first_alternative is None else first_alternative
    return Logprob(token_id, -token_id / 1000, [(start + j, -(start + j) / 1000) for j in range(alternatives)])


class FakeEngine:
    """Replays `token_ids` in packs of `pack_size`, then a final event of `reason`.

    `final`: more FinalEvent fields (timings, cached tokens, ...); `delay_s`: a sleep
    before each pack; `error`: raised instead of generating; `starts_in_thinking`: the
    engine's word on the first output; `hold` (an asyncio.Event, set by a test): the
    packs after the first wait for it. Logprobs (and the prompt's) come when asked.
    `table`: the adapters it serves (none by default, up to 4 at once); `command_error`:
    raised by the next adapter command instead of answering it.
    """

    def __init__(
        self,
        token_ids: Sequence[int] = (),
        pack_size: int = 2,
        reason: FinishReason = FinishReason.LENGTH,
        *,
        guard: FinishGuard | None = None,
        final: dict[str, Any] | None = None,
        error: Exception | None = None,
        info: ModelInfo = DEFAULT_INFO,
        delay_s: float = 0.0,
        starts_in_thinking: bool | None = None,
        table: AdapterTable | None = None,
    ):
        self.token_ids = list(token_ids)
        self.pack_size, self.reason, self.guard = pack_size, reason, guard or _GUARD_OF.get(reason, FinishGuard.EOS)
        self.final_fields = dict(final or {})
        self.error, self.info, self.delay_s = error, info, delay_s
        self.starts_in_thinking = starts_in_thinking
        self.hold: asyncio.Event | None = None
        self.requests: list[GenerationRequest] = []
        self.cancelled = 0
        self.model_info_calls = 0
        self.table = table or AdapterTable(max_loras=4, max_lora_rank=64)
        self.commands: list[AdapterCommand] = []
        self.command_error: Exception | None = None

    async def is_ready(self) -> bool:
        return True

    async def model_info(self) -> ModelInfo:
        self.model_info_calls += 1
        return self.info

    async def adapters(self, command: AdapterCommand) -> AdapterTable:
        self.commands.append(command)
        if self.command_error is not None:
            error, self.command_error = self.command_error, None
            raise error
        table, name = self.table, command.lora_name
        if command.op in ("unload", "activate") and name and table.by_name(name) is None:
            raise adapter_not_found("lora_name", f"no adapter {name!r} is registered")
        if command.op == "load":
            self.table = _loaded(table, name, command.lora_path)
        elif command.op == "unload":
            active = "" if table.active == name else table.active
            self.table = replace(table, adapters=[a for a in table.adapters if a.name != name], active=active)
        elif command.op == "activate":
            self.table = replace(table, active=name)
        return self.table

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        slot = request.adapter_slot
        if slot not in (BASE_SLOT, FOLLOW_ACTIVE) and all(a.slot != slot for a in self.table.adapters):
            raise adapter_not_found("adapter_slot", f"no adapter is registered in slot {slot}")
        ids, size = self.token_ids, self.pack_size
        finished = False
        try:
            for i in range(0, max(len(ids), 1), size):
                await asyncio.sleep(self.delay_s)
                if i and self.hold is not None:
                    await self.hold.wait()
                out = RequestOutput("", ids[i : i + size], self._logprobs(request, ids[i : i + size]))
                if i == 0:
                    out.prompt_logprobs = self._prompt_logprobs(request)
                    out.starts_in_thinking = self.starts_in_thinking
                if i + size >= len(ids):
                    out.final = FinalEvent(
                        self.reason, self.guard, len(request.prompt_tokens), len(ids), **self.final_fields
                    )
                    finished = True
                yield out
        finally:
            if not finished:
                self.cancelled += 1

    @staticmethod
    def _logprobs(request: GenerationRequest, tokens: list[int]) -> list[Logprob] | None:
        sampling = request.sampling
        if not sampling.wants_logprobs:
            return None
        return [fake_logprob(t, sampling.top_logprobs) for t in tokens]

    @staticmethod
    def _prompt_logprobs(request: GenerationRequest) -> list[Logprob] | None:
        k = request.sampling.prompt_logprobs
        if k is None:
            return None
        first, *rest = request.prompt_tokens
        return [Logprob(first, None, []), *(fake_logprob(t, k, first_alternative=t + 1) for t in rest)]


def _loaded(table: AdapterTable, name: str, path: str) -> AdapterTable:
    """The table with `name` loaded from `path`: a new version, in its slot if it had one."""
    old = table.by_name(name)
    slot = old.slot if old else max((a.slot for a in table.adapters), default=0) + 1
    version = max((a.version for a in table.adapters), default=0) + 1
    adapters = [a for a in table.adapters if a.name != name] + [AdapterInfo(name, slot, version, path, 8)]
    return replace(table, adapters=sorted(adapters, key=lambda a: a.slot))
