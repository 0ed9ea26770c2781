"""Runtime LoRA management: vLLM's POST /v1/load_lora_adapter {lora_name, lora_path} and
/v1/unload_lora_adapter {lora_name}, and this server's /v1/active_lora_adapter
{lora_name}: the adapter that adapter_slot -1 follows ("", null or the base model's
name: the base model).

They are off unless ALLOW_RUNTIME_LORA=1 (a 404 saying so, as vLLM's are without
VLLM_ALLOW_RUNTIME_LORA_UPDATING). With API keys, only the tenants named in
ADMIN_TENANTS (comma-separated) may call them, anyone else gets a 403; an open server
lets anyone. The engine does the work (backend.contract.adapters) and answers with its
adapter table, which replaces the frontend's copy. Loading a name already loaded makes
a new version of it (where vLLM refuses). Success is vLLM's plain-text sentence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from backend.contract import AdapterCommand, AdapterTable, ContractError
from openai_frontend.api.errors import NOT_FOUND, OpenAIError, bad_request, internal_error, permission_denied
from openai_frontend.api.serving import Serving
from openai_frontend.generation.engine_client import EngineError, ModelUnavailable
from openai_frontend.operations.auth import KeyRing, tenant_of


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str  # a PEFT folder (adapter_config.json, adapter_model.safetensors) the engine can read


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str


class ActiveLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str | None = None  # "", null or the base model's name: the base model


@dataclass(frozen=True, slots=True)
class LoraAdmin:
    """Who may manage adapters at run time."""

    enabled: bool = False  # ALLOW_RUNTIME_LORA=1
    keyed: bool = False  # API keys are configured: only the admin tenants may
    admin_tenants: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str], keys: KeyRing) -> LoraAdmin:
        tenants = frozenset(filter(None, (name.strip() for name in environ.get("ADMIN_TENANTS", "").split(","))))
        return cls(environ.get("ALLOW_RUNTIME_LORA", "").strip() == "1", not keys.open, tenants)

    def check(self, tenant: str) -> None:
        """A 404 while runtime management is off; a 403 for a tenant that is not an admin."""
        if not self.enabled:
            message = "Runtime LoRA adapter management is off on this server: set ALLOW_RUNTIME_LORA=1 to turn it on."
            raise OpenAIError(404, message, None, NOT_FOUND, "not_found")
        if self.keyed and tenant not in self.admin_tenants:
            raise permission_denied(
                "Managing LoRA adapters is for the tenants named in ADMIN_TENANTS; your API key's is not one of them."
            )


def _may_manage(request: Request) -> None:
    """Before the body is validated: a disabled endpoint or a refused tenant learns nothing more."""
    request.app.state.lora_admin.check(tenant_of(request))


router = APIRouter(dependencies=[Depends(_may_manage)])


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
    serving: Serving = request.app.state.serving
    if body.lora_name == serving.model_name:
        raise bad_request("lora_name", f"lora_name: {body.lora_name!r} is the base model's name")
    await _command(serving, AdapterCommand("load", body.lora_name, body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> Response:
    await _command(request.app.state.serving, AdapterCommand("unload", body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.post("/v1/active_lora_adapter")
async def active_lora_adapter(body: ActiveLoraAdapterRequest, request: Request) -> Response:
    serving: Serving = request.app.state.serving
    name = "" if body.lora_name in (None, serving.model_name) else body.lora_name
    await _command(serving, AdapterCommand("activate", name))
    if not name:
        return PlainTextResponse("Success: the base model is active (no LoRA adapter).")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' is active.")


async def _command(serving: Serving, command: AdapterCommand) -> AdapterTable:
    """The engine's table after `command`; a refusal is a 400 naming lora_name or
    lora_path, a name not registered a 404, the model down a 503."""
    try:
        command.check()
        return await serving.adapters.command(serving.engine, command)
    except ContractError as exc:
        raise bad_request(exc.field, str(exc)) from None
    except ModelUnavailable:
        raise
    except EngineError as exc:
        raise _refusal(exc) from exc


def _refusal(exc: EngineError) -> OpenAIError:
    if exc.not_found:
        return OpenAIError(404, exc.message, exc.field, NOT_FOUND, "model_not_found")
    if exc.field is not None:
        return bad_request(exc.field, exc.message)
    return internal_error(exc, "an adapter command failed")
