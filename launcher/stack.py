"""The serving stack as context managers: tritonserver, the OpenAI frontend, both.

    with Stack(model_path) as stack:          # free loopback ports
        OpenAI(base_url=stack.base_url, ...)

Start-up fails fast (StartupError, with the log's tail) if a process dies.
`Stack(supervise=True)` also runs a launcher.watchdog.Watchdog thread: a dead model
stub (or server) gets tritonserver restarted on the same ports. Stopping
is ordered: the model drains (live requests end with their finals), the frontend
stops, then tritonserver (SIGTERM, short exit timeout), then any Python backend stub
that outlived it is killed and its shm file removed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from backend.contract import DRAIN_SIGNAL, MODEL_NAME
from backend.settings.paths import model_name
from launcher.frontend import LOG_DIR, LOOPBACK, Frontend, log_path
from launcher.layout import (
    MODEL_REPOSITORY,
    REPO_ROOT,
    TritonInstall,
    check_numpy_abi,
    default_model_path,
    find_triton,
    triton_env,
)
from launcher.procs import (
    ManagedProcess,
    StartupError,
    Stub,
    find_stubs,
    free_ports,
    http_ok,
    reap_stubs,
    signal_stubs,
    wait_http_ok,
)
from launcher.watchdog import Watchdog

__all__ = ["Frontend", "Stack", "StartupError", "TritonPorts", "TritonServer"]


@dataclass(frozen=True, slots=True)
class TritonPorts:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def free(cls) -> TritonPorts:
        return cls(*free_ports(3))

    @classmethod
    def from_env(cls) -> TritonPorts:
        """TRITON_{HTTP,GRPC,METRICS}_PORT where set, free ports elsewhere."""

        spare = iter(free_ports(3))

        def pick(name: str) -> int:
            value = os.environ.get(name)
            return int(value) if value else next(spare)

        return cls(pick("TRITON_HTTP_PORT"), pick("TRITON_GRPC_PORT"), pick("TRITON_METRICS_PORT"))


class TritonServer:
    """tritonserver serving model `llm` from model_repository/, on loopback."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        ports: TritonPorts | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = LOG_DIR,
        exit_timeout_s: int = 5,
        startup_timeout_s: float = 600.0,
    ):
        self.model_path = Path(model_path)
        self.ports = ports or TritonPorts.free()
        self.extra_env = dict(env or {})
        self.log_dir = log_dir
        self.exit_timeout_s = exit_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.process: ManagedProcess | None = None
        self.restarts = 0
        self._stubs: dict[int, Stub] = {}

    http_url = property(lambda self: f"http://{LOOPBACK}:{self.ports.http}")
    grpc_url = property(lambda self: f"{LOOPBACK}:{self.ports.grpc}")
    metrics_url = property(lambda self: f"http://{LOOPBACK}:{self.ports.metrics}/metrics")
    ready_url = property(lambda self: f"{self.http_url}/v2/models/{MODEL_NAME}/ready")

    def argv(self, install: TritonInstall) -> list[str]:
        p = self.ports
        return [
            str(install.tritonserver),
            f"--model-repository={MODEL_REPOSITORY}",
            f"--backend-directory={install.backend_dir}",
            f"--http-port={p.http}",
            f"--grpc-port={p.grpc}",
            f"--metrics-port={p.metrics}",
            f"--http-address={LOOPBACK}",
            f"--grpc-address={LOOPBACK}",
            f"--metrics-address={LOOPBACK}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]

    def start(self) -> TritonServer:
        return self.spawn().wait_ready()

    def spawn(self) -> TritonServer:
        """Start the process without waiting for the model (`wait_ready`): several
        servers load their models at once."""
        check_numpy_abi()
        install = find_triton()
        env = triton_env(install)
        env.update(self.extra_env)
        env["LLM_MODEL_PATH"] = str(self.model_path)
        env["LLM_SOURCE_ROOT"] = str(REPO_ROOT)
        if env.get("LORA_MODULES"):  # tritonserver runs in the repository: paths as the user gave them
            env["LORA_MODULES"] = absolute_lora_modules(env["LORA_MODULES"])
        log = log_path(self.log_dir, "tritonserver", self.ports.grpc, self.restarts)
        self.process = ManagedProcess("tritonserver", self.argv(install), env, REPO_ROOT, log)
        return self

    def wait_ready(self) -> TritonServer:
        try:
            wait_http_ok(self.ready_url, [self.process], self.startup_timeout_s, f"model {MODEL_NAME!r}")
        except BaseException:
            self.stop()
            raise
        self._track_stubs()
        return self

    def drain(self) -> None:
        """Ask the model to abort live requests (they get finals) and refuse new ones."""
        if self.process is not None and self.process.poll() is None:
            self._track_stubs()
            signal_stubs(list(self._stubs.values()), DRAIN_SIGNAL)

    def stop(self) -> None:
        if self.process is None:
            return
        self.drain()
        self.process.stop(timeout=self.exit_timeout_s + 3)
        reap_stubs(list(self._stubs.values()))
        self.process = None

    def restart(self) -> TritonServer:
        """Kill the server at once (its model is dead: nothing to drain, and a hung
        request would hold a SIGTERM for --exit-timeout-secs), then start it again on the
        same ports. Requests in flight get a broken gRPC stream, not a hang."""
        if self.process is not None:
            self.process.stop(timeout=0)
            reap_stubs(list(self._stubs.values()))
            self._stubs.clear()
            self.process = None
        self.restarts += 1
        return self.start()

    def has_stub(self) -> bool:
        """Whether the model's Python backend stub runs (Triton's readiness does not say)."""
        return self.process is not None and bool(find_stubs(self.process.pid))

    def is_model_ready(self) -> bool:
        return http_ok(self.ready_url, timeout=2.0)

    def _track_stubs(self) -> None:
        if self.process is not None:
            self._stubs.update((s.pid, s) for s in find_stubs(self.process.pid))

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Stack:
    """tritonserver and the frontend together; the frontend can be left out."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        port: int | None = None,
        host: str = LOOPBACK,
        served_model_name: str | None = None,
        triton: TritonServer | None = None,
        triton_ports: TritonPorts | None = None,
        with_frontend: bool = True,
        env: dict[str, str] | None = None,
        log_dir: Path | None = LOG_DIR,
        supervise: bool = False,
    ):
        """`triton`: an already running server to put the frontend on (not stopped here).
        `supervise`: restart our tritonserver when its model dies (launcher.watchdog)."""
        self.model_path = Path(model_path) if model_path else (triton.model_path if triton else default_model_path())
        self.served_model_name = served_model_name or model_name(self.model_path)
        self._owns_triton = triton is None
        self.triton = triton or TritonServer(self.model_path, ports=triton_ports, env=env, log_dir=log_dir)
        self.frontend = (
            Frontend(self.triton.grpc_url, self.model_path, self.served_model_name,
                     host=host, port=port, env=env, log_dir=log_dir, triton_metrics_url=self.triton.metrics_url)
            if with_frontend else None
        )  # fmt: skip
        self.watchdog = Watchdog(self.triton) if supervise and self._owns_triton else None

    base_url = property(lambda self: f"{self.frontend.url}/v1" if self.frontend else None)
    triton_grpc_url = property(lambda self: self.triton.grpc_url)
    triton_http_url = property(lambda self: self.triton.http_url)
    triton_metrics_url = property(lambda self: self.triton.metrics_url)

    def start(self) -> Stack:
        try:
            if self._owns_triton:
                self.triton.start()
            if self.frontend is not None:
                watch = [self.triton.process] if self.triton.process else []
                self.frontend.start(watch)
            if self.watchdog is not None:
                self.watchdog.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Drain the model first: live requests end with finish_reason abort and the
        frontend's streams close on their own, so the frontend stops at once. The
        watchdog is paused first and closed last (it may be the server's parent thread)."""
        if self.watchdog is not None:
            self.watchdog.pause()
        if self._owns_triton:
            self.triton.drain()
        if self.frontend is not None:
            self.frontend.stop()
        if self._owns_triton:
            self.triton.stop()
        if self.watchdog is not None:
            self.watchdog.close()

    def processes(self) -> list[ManagedProcess]:
        procs = [self.frontend.process if self.frontend else None, self.triton.process]
        return [p for p in procs if p is not None]

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def absolute_lora_modules(text: str) -> str:
    """LORA_MODULES (`name=path,...`) with each relative path made absolute from this
    process's working directory; anything malformed is left for the engine to refuse."""
    items = []
    for item in text.split(","):
        name, sep, path = item.partition("=")
        if sep and path.strip():
            item = f"{name}={Path(path.strip()).expanduser().absolute()}"
        items.append(item)
    return ",".join(items)
