"""Requests on their way to the engine thread: each prepared (its grammar compiled, its
adapter resolved: `LLMEngine.prepare`) on a thread of its own, then submitted.

So a compilation, which may take the whole GRAMMAR_COMPILE_TIMEOUT_S, stalls neither
Triton's thread, nor the batch, nor any other request. A request being prepared is not
in the engine yet: an abort meanwhile ends it at once (its abort final goes out, and
what preparing makes of it later is dropped), and so does shutdown (an error). Either
way it gets exactly one final.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from backend.contract import FinalEvent, FinishGuard, FinishReason, GenerationRequest, RequestOutput
from backend.core.engine import Prepared

Prepare = Callable[[GenerationRequest], Prepared]  # LLMEngine.prepare
Submit = Callable[[str, GenerationRequest, float, Prepared], None]  # EngineThread.submit


@dataclass(slots=True)
class _Preparing:
    request: GenerationRequest
    arrival_time: float
    ended: bool = False  # its final went out meanwhile (an abort, a shutdown)


class Preparer:
    def __init__(
        self,
        prepare: Prepare,
        submit: Submit,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_failure: Callable[[str, Exception], None],
    ):
        self._prepare, self._submit = prepare, submit
        self._on_outputs, self._on_failure = on_outputs, on_failure
        # held while a prepared request is submitted: an abort comes before (it ends the
        # request here) or after (the engine has it); never in between, where it would be lost
        self._lock = threading.Lock()
        self._requests: dict[str, _Preparing] = {}

    def start(self, request_id: str, request: GenerationRequest, arrival_time: float) -> None:
        with self._lock:
            self._requests[request_id] = _Preparing(request, arrival_time)
        args = (request_id, request, arrival_time)
        threading.Thread(target=self._run, args=args, name="llm-prepare", daemon=True).start()

    def abort(self, request_id: str) -> bool:
        """End a request being prepared with its abort final; False if it is not being prepared."""
        with self._lock:
            preparing = self._requests.get(request_id)
            if preparing is None:
                return False
            if preparing.ended:
                return True
            preparing.ended = True
        self._on_outputs([_aborted(request_id, preparing)])
        return True

    def fail_all(self, error: Exception) -> None:
        """End every request being prepared with `error` (shutdown)."""
        with self._lock:
            stranded = [rid for rid, preparing in self._requests.items() if not preparing.ended]
            for request_id in stranded:
                self._requests[request_id].ended = True
        for request_id in stranded:
            self._on_failure(request_id, error)

    def _run(self, request_id: str, request: GenerationRequest, arrival_time: float) -> None:
        try:
            prepared, error = self._prepare(request), None
        except Exception as exc:  # a ContractError (the client's 400), or a bug: it fails alone
            prepared, error = None, exc
        with self._lock:
            if self._requests.pop(request_id).ended:
                return
            if error is None:
                self._submit(request_id, request, arrival_time, prepared)
                return
        self._on_failure(request_id, error)


def _aborted(request_id: str, preparing: _Preparing) -> RequestOutput:
    """The final of a request aborted before it reached the engine: no tokens, all its time queued."""
    final = FinalEvent(
        FinishReason.ABORT,
        FinishGuard.CANCELLED,
        num_prompt_tokens=len(preparing.request.prompt_tokens),
        num_output_tokens=0,
        queue_time_s=time.monotonic() - preparing.arrival_time,
    )
    return RequestOutput(request_id, [], final=final)
