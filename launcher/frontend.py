"""The OpenAI frontend as a managed process (`python -m openai_frontend`), and where process logs go."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launcher.layout import BUILD_DIR, REPO_ROOT
from launcher.procs import ManagedProcess, free_port, wait_http_ok

LOG_DIR = BUILD_DIR / "logs"
LOOPBACK = "127.0.0.1"


def log_path(log_dir: Path | None, name: str, port: int, restart: int = 0) -> Path | None:
    suffix = f"-restart{restart}" if restart else ""
    return None if log_dir is None else log_dir / f"{name}-{os.getpid()}-{port}{suffix}.log"


class Frontend:
    """The OpenAI-compatible HTTP frontend (`python -m openai_frontend`)."""

    def __init__(
        self,
        triton_grpc_url: str,
        model_path: str | Path,
        served_model_name: str,
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = LOG_DIR,
        startup_timeout_s: float = 120.0,
        triton_metrics_url: str | None = None,
        extra_args: list[str] | None = None,
    ):
        self.triton_grpc_url = triton_grpc_url
        self.triton_metrics_url = triton_metrics_url  # None: the frontend's default
        self.model_path = Path(model_path)
        self.served_model_name = served_model_name
        self.host = host
        self.port = port or free_port(host)
        self.extra_env = dict(env or {})
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args or [])  # e.g. --dynamo-namespace (launcher/replica_stack.py)
        self.process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        host = LOOPBACK if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        metrics = ["--triton-metrics-url", self.triton_metrics_url] if self.triton_metrics_url else []
        return [
            sys.executable, "-m", "openai_frontend",
            "--host", self.host,
            "--port", str(self.port),
            "--triton-url", self.triton_grpc_url,
            "--model-path", str(self.model_path),
            "--served-model-name", self.served_model_name,
            *metrics,
            *self.extra_args,
        ]  # fmt: skip

    def start(self, watch: list[ManagedProcess] | None = None) -> Frontend:
        env = dict(os.environ, **self.extra_env)
        log = log_path(self.log_dir, "frontend", self.port)
        self.process = ManagedProcess("openai_frontend", self.argv(), env, REPO_ROOT, log)
        try:
            wait_http_ok(f"{self.url}/health", [self.process, *(watch or [])], self.startup_timeout_s, "the frontend")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=10)
            self.process = None
