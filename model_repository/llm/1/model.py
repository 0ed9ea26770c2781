"""Model `llm`: the thin Triton Python-backend adapter over the engine (decoupled).

execute() decodes each request with the contract into a validated GenerationRequest,
registers it as live and hands it to the engine thread, and returns at once: a request
with a grammar (or an adapter) is prepared on a thread of its own first
(backend.serving.preparer), so a grammar's compilation never holds execute() up. A
model-info query is answered from the engine's facts, an adapter command
(backend.contract.adapters) on a thread of its own (a load reads a folder) with the
adapter table after it. The engine thread pushes outputs into the live-request
registry; the sender thread (backend.serving.sender) sends, per stream, everything
pending as ONE response (a send is a blocking round trip, whatever it holds), the final
flag riding on the last, and aborts requests whose clients cancelled.

Every request gets its final flag: with its last tokens, with an error, or at shutdown.
Triton calls finalize() only once no request is in flight, so the launcher asks for a
drain first (contract.DRAIN_SIGNAL to the stub): live requests are aborted and get
their finals, new ones are refused. Errors travel as data (contract.ErrorReport).
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# The stub ignores PYTHONPATH: make the repository's packages importable.
_SOURCE_ROOT = os.environ.get("LLM_SOURCE_ROOT") or str(Path(__file__).resolve().parents[3])
if _SOURCE_ROOT not in sys.path:
    sys.path.insert(0, _SOURCE_ROOT)

from backend import contract  # noqa: E402
from backend.core.engine import LLMEngine  # noqa: E402
from backend.serving.drain import install_drain_handler  # noqa: E402
from backend.serving.engine_thread import EngineThread  # noqa: E402
from backend.serving.gauges import Gauges  # noqa: E402
from backend.serving.kv_events import KvEventSink  # noqa: E402
from backend.serving.live import LiveRequests  # noqa: E402
from backend.serving.sender import SenderLoop  # noqa: E402
from backend.settings.engine import EngineConfig  # noqa: E402

log = logging.getLogger("llm")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        _check_numpy_abi()
        config = EngineConfig.from_env(os.environ.get("LLM_MODEL_PATH"))
        self._live = LiveRequests()
        kv_events = KvEventSink.from_env(os.environ, config.block_size)  # for a KV-aware router (docs/replicas.md)
        self._engine = EngineThread(lambda: LLMEngine(config), self._live.push, self._live.fail, kv_events=kv_events)
        self._ids = itertools.count()
        self._draining = threading.Event()
        self._engine.start()
        self._loop = SenderLoop(self._live, _Responder(), self._engine, Gauges(_metric))
        self._sender = threading.Thread(target=self._loop.run, name="llm-sender", daemon=True)
        self._sender.start()
        install_drain_handler(contract.DRAIN_SIGNAL, self._drain)

    def execute(self, requests: list) -> None:
        for request in requests:
            self._accept(request, time.monotonic())
        return None

    def finalize(self) -> None:
        """Abort what is in flight, send every final, stop the threads."""
        self._engine.shutdown()
        self._live.close()
        self._sender.join(timeout=30)
        for sender in self._live.forget_all():
            _send_error(sender, RuntimeError("the server shut down"))
        if not self._sender.is_alive():  # else it may still publish
            self._loop = None  # its gauges hold the metrics, which must go before their families
            _release_metric_families()

    def _accept(self, request, arrival_time: float) -> None:
        sender = request.get_response_sender()
        arrays = {t.name(): t.as_numpy() for t in request.inputs()}
        info = self._engine.model_info
        try:
            if contract.is_model_info_query(arrays):
                _send(sender, contract.encode_model_info(info), FINAL)
                return
            command = contract.decode_adapter_command(arrays)
            if command is not None:
                threading.Thread(target=self._command, args=(sender, command), name="llm-adapters", daemon=True).start()
                return
            if self._draining.is_set():
                raise contract.EngineUnavailable("the server is shutting down")
            generation = contract.decode_request(arrays, info.vocab_size, info.max_model_len)
        except (contract.ContractError, contract.EngineUnavailable) as exc:
            _send_error(sender, exc)
            return
        request_id = f"{request.request_id() or 'req'}#{next(self._ids)}"
        self._live.open(request_id, sender, generation.stream)
        self._engine.accept(request_id, generation, arrival_time)  # its grammar's errors come as its final

    def _command(self, sender, command: contract.AdapterCommand) -> None:
        try:
            table = self._engine.adapter_command(command)
        except contract.ContractError as exc:
            _send_error(sender, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a failed command fails alone
            log.exception("adapter command failed")
            _send_error(sender, exc)
            return
        _send(sender, contract.encode_adapter_table(table), FINAL)

    def _drain(self) -> None:
        self._draining.set()
        self._loop.abort_all()


def _check_numpy_abi() -> None:
    """The stub's numpy bindings (pybind11) read NumPy 1 structs: NumPy 2 corrupts tensors."""
    if int(np.__version__.split(".")[0]) >= 2:
        raise pb_utils.TritonModelException(
            f"numpy {np.__version__} is installed, but the Python backend stub of nvidia-pytriton 0.7.0 "
            "needs numpy<2 (with numpy 2 every tensor arrives empty or garbled): install numpy==1.26.4"
        )


class _Responder:
    """The sender loop's door to Triton (backend.serving.sender.Responder)."""

    def send_output(self, sender, output: contract.RequestOutput) -> None:
        _send(sender, contract.encode_output(output), FINAL if output.finished else 0)

    def send_error(self, sender, error: Exception) -> None:
        _send_error(sender, error)


def _send(sender, arrays: dict[str, np.ndarray], flags: int) -> None:
    tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()]
    _send_quietly(sender, pb_utils.InferenceResponse(output_tensors=tensors), flags)


def _send_error(sender, error: Exception) -> None:
    report = contract.ErrorReport.of(error)
    code = {
        contract.ErrorKind.INVALID_REQUEST: pb_utils.TritonError.INVALID_ARG,
        contract.ErrorKind.NOT_FOUND: pb_utils.TritonError.NOT_FOUND,
        contract.ErrorKind.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
    }.get(report.kind, pb_utils.TritonError.INTERNAL)
    response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(report.encode(), code))
    _send_quietly(sender, response, FINAL)


def _send_quietly(sender, response: pb_utils.InferenceResponse, flags: int) -> None:
    """A send that fails (the client is gone) must not stop the sender thread."""
    try:
        sender.send(response, flags=flags)
    except Exception:
        log.exception("send failed")


_families: dict = {}  # by name; a MetricFamily must outlive its Metric objects


def _metric(name: str, description: str, kind: str, labels: dict[str, str] | None = None):
    """One of the model's metrics on Triton's metrics port (backend.serving.gauges)."""
    if name not in _families:
        kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER}
        _families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])
    return _families[name].Metric(labels=labels or {})


def _release_metric_families() -> None:
    """Free the metrics while the stub still runs. Left to the interpreter's exit, a
    MetricFamily's destructor writes to the stub's shared memory after it is gone and
    the stub segfaults on every unload (measured: 10 of 12 server logs)."""
    _families.clear()
    gc.collect()
