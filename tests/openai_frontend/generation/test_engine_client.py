"""The engine client's reading of the model's errors: ErrorReport JSON, never prose."""

from __future__ import annotations

from backend.contract import ContractError, ErrorKind, ErrorReport
from openai_frontend.generation.engine_client import EngineError, ModelUnavailable, engine_error


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
