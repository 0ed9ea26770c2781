"""The processes behind NVIDIA Dynamo's KV-aware router: nats-server (JetStream on, on
loopback) and one Dynamo worker shim per tritonserver (launcher/dynamo_worker.py), whose
tritonserver publishes its KV events (KV_EVENTS_ENDPOINT, backend/serving/kv_events.py)."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path

from launcher.dynamo_worker import dynamo_env
from launcher.frontend import LOG_DIR, LOOPBACK, log_path
from launcher.layout import REPO_ROOT
from launcher.procs import ManagedProcess, StartupError, free_port
from launcher.stack import TritonServer


def kv_events_endpoint() -> str:
    """A free loopback address for one tritonserver's KV events."""
    return f"tcp://{LOOPBACK}:{free_port()}"


class NatsServer:
    """nats-server with JetStream (Dynamo's KV event streams need it), its store in `store_dir`."""

    def __init__(self, store_dir: Path, port: int | None = None, log_dir: Path | None = LOG_DIR):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.log_dir = log_dir
        self.process: ManagedProcess | None = None

    url = property(lambda self: f"nats://{LOOPBACK}:{self.port}")

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        argv = [binary, "-a", LOOPBACK, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        self.process = ManagedProcess("nats-server", argv, {}, REPO_ROOT, log_path(self.log_dir, "nats", self.port))
        deadline = time.monotonic() + timeout_s
        while not _accepts(self.port):
            self.process.check_alive()
            if time.monotonic() > deadline:
                raise StartupError(f"nats-server did not listen on {self.port} within {timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=5)
            self.process = None


class DynamoWorker:
    """The shim of one tritonserver, registered under `namespace` in Dynamo's discovery."""

    def __init__(
        self, triton: TritonServer, nats_url: str, discovery_dir: Path, served_model_name: str,
        *, namespace: str = "tritonllm", log_dir: Path | None = LOG_DIR,
    ):  # fmt: skip
        self.triton = triton
        self.kv_events = triton.extra_env["KV_EVENTS_ENDPOINT"]
        self.env = dynamo_env(nats_url, str(discovery_dir))
        self.served_model_name = served_model_name
        self.namespace = namespace
        self.log_dir = log_dir
        self.process: ManagedProcess | None = None

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "launcher.dynamo_worker",
            "--namespace", self.namespace,
            "--triton-grpc-url", self.triton.grpc_url,
            "--triton-metrics-url", self.triton.metrics_url,
            "--kv-events", self.kv_events,
            "--model-path", str(self.triton.model_path),
            "--served-model-name", self.served_model_name,
        ]  # fmt: skip

    def start(self) -> DynamoWorker:
        env = {**os.environ, **self.env}
        log = log_path(self.log_dir, "dynamo-worker", self.triton.ports.grpc)
        self.process = ManagedProcess("dynamo worker", self.argv(), env, REPO_ROOT, log)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=10)
            self.process = None


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex((LOOPBACK, port)) == 0
