"""`REPLICAS=N make serve`: N tritonserver instances of one model behind NVIDIA Dynamo's
KV-aware router, on one machine, as a context manager.

    with ReplicaStack(model_path, replicas=3) as stack:
        OpenAI(base_url=stack.base_url, ...)

What runs: nats-server (JetStream, loopback), N tritonservers (each publishing its KV
events on a loopback ZMQ port), N Dynamo worker shims (launcher/dynamo_worker.py,
registering them in file discovery under a folder of this stack's), and one OpenAI
frontend routing over them (`--dynamo-namespace`, generation/replicas.py). Each
tritonserver has its watchdog thread (a dead stub or server is restarted on the same
ports), and `check()` restarts a shim that died. Stopping: the frontend, the shims, the
servers (drained first), nats; the stack's folder is removed.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from backend.settings.paths import model_name
from launcher.dynamo_worker import dynamo_env
from launcher.frontend import LOG_DIR, LOOPBACK, Frontend
from launcher.layout import BUILD_DIR, default_model_path
from launcher.procs import StartupError
from launcher.replicas import DynamoWorker, NatsServer, kv_events_endpoint
from launcher.stack import TritonServer
from launcher.watchdog import Watchdog

NAMESPACE = "tritonllm"
MAX_REPLICAS = 16
_UP = re.compile(r"^llm_router_instance_up\{[^}]*\} 1(?:\.0)?$", re.MULTILINE)


def replicas_from_env(value: str | None) -> int:
    """REPLICAS: unset or 1 is one instance (no Dynamo); 2..MAX_REPLICAS; else a ValueError."""
    if value is None or not value.strip():
        return 1
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"REPLICAS must be a whole number from 1 to {MAX_REPLICAS}, got {value!r}") from None
    if not 1 <= count <= MAX_REPLICAS:
        raise ValueError(f"REPLICAS must be from 1 to {MAX_REPLICAS}, got {count}")
    return count


class ReplicaStack:
    """nats, N tritonservers with their shims, and the frontend routing over them."""

    def __init__(
        self, model_path: str | Path | None = None, replicas: int = 3, *, host: str = LOOPBACK,
        port: int | None = None, served_model_name: str | None = None, env: dict[str, str] | None = None,
        envs: list[dict[str, str]] | None = None, router_mode: str = "kv", log_dir: Path | None = LOG_DIR,
    ):  # fmt: skip
        """`env`: for every process; `envs`: one more per instance (e.g. its KV_CACHE_MB)."""
        self.model_path = Path(model_path) if model_path else default_model_path()
        self.served_model_name = served_model_name or model_name(self.model_path)
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="replicas-", dir=BUILD_DIR))
        self.nats = NatsServer(self.root / "nats", log_dir=log_dir)
        self.discovery = self.root / "discovery"
        per = envs or [{} for _ in range(replicas)]
        self.servers = [
            TritonServer(
                self.model_path,
                env={**(env or {}), **extra, "KV_EVENTS_ENDPOINT": kv_events_endpoint()},
                log_dir=log_dir,
            )  # fmt: skip
            for extra in per
        ]
        self.workers = [
            DynamoWorker(
                server, self.nats.url, self.discovery, self.served_model_name, namespace=NAMESPACE, log_dir=log_dir
            )  # fmt: skip
            for server in self.servers
        ]
        self.frontend_env = {**(env or {}), **dynamo_env(self.nats.url, str(self.discovery))}
        args = ["--dynamo-namespace", NAMESPACE, "--router-mode", router_mode]
        self.frontend = Frontend(
            "unused:0", self.model_path, self.served_model_name, host=host, port=port, env=self.frontend_env,
            log_dir=log_dir, extra_args=args,
        )  # fmt: skip
        self.watchdogs = [Watchdog(server) for server in self.servers]

    base_url = property(lambda self: f"{self.frontend.url}/v1")
    metrics_url = property(lambda self: f"{self.frontend.url}/metrics")

    def start(self, timeout_s: float = 180.0) -> ReplicaStack:
        """Everything up, and every instance in the frontend's rotation."""
        try:
            self.nats.start()
            for server in self.servers:  # loading at once; started from this thread, which outlives them
                server.spawn()
            for server, worker in zip(self.servers, self.workers, strict=True):
                server.wait_ready()
                worker.start()
            for watchdog in self.watchdogs:
                watchdog.start()
            self.frontend.start([w.process for w in self.workers if w.process])
            self.wait_in_rotation(len(self.servers), timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def in_rotation(self) -> int:
        """How many instances the frontend routes to now."""
        return len(_UP.findall(httpx.get(self.metrics_url, timeout=5).text))

    def wait_in_rotation(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (found := self.in_rotation()) < count:
            if time.monotonic() > deadline:
                raise StartupError(f"{found} of {count} instances in the router's rotation after {timeout_s:.0f} s")
            self.check()
            time.sleep(0.2)

    def check(self) -> None:
        """One round of supervision: restart a shim that died (the watchdogs keep the
        servers); raise StartupError if the frontend died or a server's restart failed."""
        code = self.frontend.process.poll() if self.frontend.process else None
        if code is not None:
            raise StartupError(f"the frontend exited with status {code}")
        for watchdog in self.watchdogs:
            if watchdog.error is not None:
                raise watchdog.error
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is not None:
                print(f"supervisor: the Dynamo worker of {worker.triton.grpc_url} died; restarting it", flush=True)
                worker.start()

    def stop(self) -> None:
        for watchdog in self.watchdogs:
            watchdog.pause()
        for server in self.servers:
            server.drain()
        self.frontend.stop()
        for worker in self.workers:
            worker.stop()
        for server in self.servers:
            server.stop()
        for watchdog in self.watchdogs:
            watchdog.close()
        self.nats.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ReplicaStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
