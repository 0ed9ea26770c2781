"""Errors as data: what the model reports when it refuses or fails a request.

A Triton error on a stream carries only a message, so the model sends a small JSON
object there (`ErrorReport.encode`): the kind, the message a person reads, and for a
refused request the contract field at fault. The frontend decodes it and never parses
prose. Messages that are not ours (Triton's own, e.g. a dead stub) do not decode.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class ContractError(ValueError):
    """A request that breaks the contract. `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EngineUnavailable(RuntimeError):
    """The model cannot take the request now (a drain before shutdown); retry later."""


class ErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"  # the client's fault: `field` says where
    UNAVAILABLE = "unavailable"  # retry later
    NOT_FOUND = "not_found"  # what it names (an adapter) is not there: `field` says which input
    INTERNAL = "internal"  # the model failed


@dataclass(frozen=True, slots=True)
class ErrorReport:
    kind: ErrorKind
    message: str
    field: str | None = None

    @classmethod
    def of(cls, error: BaseException) -> ErrorReport:
        if isinstance(error, ContractError):
            kind = ErrorKind.NOT_FOUND if getattr(error, "not_found", False) else ErrorKind.INVALID_REQUEST
            return cls(kind, str(error), error.field)
        if isinstance(error, EngineUnavailable):
            return cls(ErrorKind.UNAVAILABLE, str(error))
        return cls(ErrorKind.INTERNAL, str(error) or type(error).__name__)

    def encode(self) -> str:
        return json.dumps({"kind": self.kind.value, "message": self.message, "field": self.field})

    @classmethod
    def decode(cls, text: str) -> ErrorReport | None:
        """The report in an error message; None when the message is not one of ours."""
        try:
            data = json.loads(text)
            return cls(ErrorKind(data["kind"]), str(data["message"]), data.get("field"))
        except (ValueError, TypeError, KeyError):
            return None
