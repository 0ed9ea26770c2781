"""The engine client's reading of the model's errors: ErrorReport JSON, never prose."""

from __future__ import annotations

import asyncio

import numpy as np

from backend import contract
from backend.contract import (
    AdapterCommand,
    AdapterInfo,
    AdapterNotFound,
    AdapterTable,
    ContractError,
    ErrorKind,
    ErrorReport,
)
from openai_frontend.generation.engine_client import EngineError, ModelUnavailable, TritonLLM, engine_error


def test_engine_error_names_the_contract_field_of_a_refusal():
    refusal = ErrorReport.of(ContractError("dry_multiplier", "not supported"))
    error = engine_error(refusal.encode())
    assert type(error) is EngineError and error.field == "dry_multiplier"
    assert error.message == "dry_multiplier: not supported"


def test_engine_error_of_a_failure_or_a_foreign_message_keeps_no_field():
    failure = engine_error(ErrorReport(ErrorKind.INTERNAL, "CUDA out of memory").encode())
    assert type(failure) is EngineError and failure.field is None and failure.message == "CUDA out of memory"
    # a field on a report that is not a refusal is not the client's fault
    assert engine_error(ErrorReport(ErrorKind.INTERNAL, "x: y", "x").encode()).field is None
    # text that is not an ErrorReport is never parsed for a field
    for message in ("dry_multiplier: not supported", "CUDA out of memory", "Error: something"):
        error = engine_error(message)
        assert type(error) is EngineError and error.field is None, message
        assert not isinstance(error, ModelUnavailable)


def test_engine_error_of_an_adapter_not_found_keeps_its_field_and_says_so():
    error = engine_error(ErrorReport.of(AdapterNotFound("adapter_slot", "no adapter in slot 3")).encode())
    assert type(error) is EngineError and error.not_found and error.field == "adapter_slot"
    assert not engine_error(ErrorReport.of(ContractError("lora_path", "unreadable")).encode()).not_found


class _Result:
    """A stream result as tritonclient gives it: named output arrays."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def get_response(self):
        outputs = [type("Output", (), {"name": name}) for name in self.arrays]
        return type("Response", (), {"outputs": outputs})

    def as_numpy(self, name: str) -> np.ndarray:
        return self.arrays[name]


def test_an_adapter_command_is_sent_alone_and_answered_with_the_table():
    table = AdapterTable([AdapterInfo("sql", 1, 7, "/adapters/sql", 8)], active="sql", max_loras=2, max_lora_rank=8)
    sent = []

    async def responses(arrays):
        sent.append(arrays)
        yield _Result(contract.encode_adapter_table(table))

    client = object.__new__(TritonLLM)  # no gRPC channel: the stream is the stand-in above
    client._responses = responses
    answer = asyncio.run(client.adapters(AdapterCommand("load", "sql", "/adapters/sql")))
    assert answer == table
    assert contract.decode_adapter_command(sent[0]) == AdapterCommand("load", "sql", "/adapters/sql")
