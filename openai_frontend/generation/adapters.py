"""The LoRA adapters the engine serves, as this frontend last heard, and what a request's
`model` picks among them.

The engine owns the adapters (backend.contract.adapters); the frontend keeps a copy of
its AdapterTable: asked at start (next to the model's facts), asked again, once, when a
request names a model the copy does not list (another frontend may have loaded it),
and replaced by the table the engine answers each command with. A request names an
adapter by its `model`, as with vLLM; the frontend sends that adapter's slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from backend.contract import BASE_SLOT, FOLLOW_ACTIVE, AdapterCommand, AdapterInfo, AdapterTable
from openai_frontend.api.errors import bad_request, model_not_found
from openai_frontend.generation.engine_client import EngineError, ModelUnavailable, TritonLLM

LIST = AdapterCommand("list")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What a request's `model` picked: the name its response echoes, and the adapter
    slot it is sent with (BASE_SLOT: the base model, unless the body sets adapter_slot)."""

    model: str
    adapter_slot: int = BASE_SLOT


class Adapters:
    """The copy of the engine's AdapterTable (None: not asked yet, or known to be stale)."""

    def __init__(self, base_model: str):
        self.base_model = base_model
        self.table: AdapterTable | None = None

    async def known(self, engine: TritonLLM) -> AdapterTable:
        """The table; asked of the engine when there is no copy."""
        return self.table if self.table is not None else await self.refresh(engine)

    async def refresh(self, engine: TritonLLM) -> AdapterTable:
        """The engine's table as it is now; an empty one when the engine refuses to list
        (it serves no adapters: MAX_LORAS=0). ModelUnavailable while it cannot answer."""
        try:
            return await self.command(engine, LIST)
        except ModelUnavailable:
            raise
        except EngineError as exc:
            log.warning("the model lists no LoRA adapters: %s", exc)
            self.table = AdapterTable()
            return self.table

    async def command(self, engine: TritonLLM, command: AdapterCommand) -> AdapterTable:
        """Send `command`; the table it is answered with replaces the copy."""
        self.table = await engine.adapters(command)
        return self.table

    def forget(self) -> None:
        """The copy lists an adapter the engine no longer has: ask again when next needed."""
        self.table = None

    async def listed(self, engine: TritonLLM) -> list[AdapterInfo]:
        """The adapters for /v1/models; none while the engine cannot say (nor serve them)."""
        try:
            return (await self.known(engine)).adapters
        except ModelUnavailable:
            return []

    async def find(self, engine: TritonLLM, name: str) -> AdapterInfo | None:
        """The adapter called `name`; the engine is asked again, once, when the copy has none."""
        asked = self.table is None
        found = (await self.known(engine)).by_name(name)
        if found is None and not asked:
            found = (await self.refresh(engine)).by_name(name)
        return found

    async def choose(self, engine: TritonLLM, model: str | None, slot_sent: Any = None) -> ModelChoice:
        """What `model` picks: the base model (its name, or none) or an adapter by its name;
        a 404 model_not_found for any other. `slot_sent`: the body's adapter_slot, a 400
        when it names another slot than the adapter's."""
        if model is None or model == self.base_model:
            return ModelChoice(self.base_model)
        adapter = await self.find(engine, model)
        if adapter is None:
            raise model_not_found(model)
        if slot_sent is not None and slot_sent != adapter.slot:
            message = (
                f"adapter_slot: {slot_sent!r} is not the slot of model {model!r} ({adapter.slot}); "
                "send the model's name or a slot, not both"
            )
            raise bad_request("adapter_slot", message)
        return ModelChoice(model, adapter.slot)

    def name_of(self, slot: int) -> str:
        """The adapter a request's slot names, for its metrics ("": the base model, or one
        the copy does not list); FOLLOW_ACTIVE names the active one as last heard."""
        if self.table is None or slot == BASE_SLOT:
            return ""
        if slot == FOLLOW_ACTIVE:
            return self.table.active
        return next((a.name for a in self.table.adapters if a.slot == slot), "")
